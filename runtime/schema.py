"""JSON -> frozen dataclasses, checked against the dataclasses' own annotations.

The manifest's schema is its dataclasses (:mod:`.manifest`): this module walks their type hints, so every field
is checked for its type before a constructor runs, and an error names the field's path
(``manifest.target.dims.n_layers``), what it must be and what it is. Unknown fields are refused by name (a bundle
written by a newer specedge says so instead of failing later).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from .errors import BundleError

_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"


def load(tp: Any, value: Any, where: str) -> Any:
    """``value`` (parsed JSON) as an instance of type ``tp``; BundleError naming ``where`` if it does not fit."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return _load_dataclass(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for a in options:
            try:
                return load(a, value, where)
            except BundleError as e:
                errors.append(str(e))
        raise BundleError(errors[0] if len(errors) == 1
                          else f"{where} must be one of {options}, got {_describe(value)}")
    if tp in _NAMES:
        ok = isinstance(value, tp) and not (tp is not bool and isinstance(value, bool))
        if tp is float and isinstance(value, int) and not isinstance(value, bool):
            ok, value = True, float(value)
        if not ok:
            raise BundleError(f"{where} must be {_NAMES[tp]}, got {_describe(value)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise BundleError(f"{where} must be a list, got {_describe(value)}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [load(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise BundleError(f"{where} must be an object, got {_describe(value)}")
        _, vt = typing.get_args(tp) or (str, Any)
        return {str(k): load(vt, v, f"{where}.{k}") for k, v in value.items()}
    raise TypeError(f"schema: no rule for type {tp!r} at {where}")  # a programming error, not bad input


def _load_dataclass(cls: Any, value: Any, where: str) -> Any:
    if not isinstance(value, dict):
        raise BundleError(f"{where} must be an object, got {_describe(value)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise BundleError(f"{where} has unknown field(s) {unknown}; this specedge reads {sorted(fields)} "
                          f"(a bundle written by a newer specedge?)")
    missing = [n for n, f in fields.items() if n not in value and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise BundleError(f"{where} is missing field(s) {missing}")
    kwargs = {n: load(hints[n], v, f"{where}.{n}") for n, v in value.items()}
    try:
        return cls(**kwargs)
    except BundleError as e:
        raise BundleError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise BundleError(f"{where} is malformed: {e}") from None
