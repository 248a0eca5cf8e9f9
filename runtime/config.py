"""Deployment presets (``configs/*.toml``) and the ``--config`` CLI option.

A preset may also carry a ``[board]`` table (memory_gb, unified, reserved_gb: what the memory plan,
``spec-export plan``, checks against). A preset has one table per command — ``[export]``, ``[build]`` (spec-export),
``[run]`` and ``[bench]`` (spec-run generate / bench) — whose keys are that
command's option names (``max_context``, ``precision``, ``backend``, …). ``--config NAME`` (a
preset in ``configs/``) or ``--config PATH`` (any TOML file) makes them the command's defaults;
options given on the command line still win.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from .errors import SpecEdgeError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6)
    import tomli as tomllib

SECTIONS = ("export", "build", "run", "bench")


def presets_dir() -> Path:
    """$SPECEDGE_CONFIGS, else the presets shipped in the package (``specedge.configs``: the checkout's
    ``configs/`` in an editable install, package data in a wheel)."""
    import importlib.util
    import os

    env = os.environ.get("SPECEDGE_CONFIGS")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("specedge.configs")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parent.parent / "configs"


def list_presets() -> list[str]:
    d = presets_dir()
    return sorted(p.stem for p in d.glob("*.toml")) if d.is_dir() else []


def config_path(name_or_path: str) -> Path:
    """The file ``--config`` names: a preset (a bare name such as ``cpu``), else the file at that path, whatever its
    suffix. A folder or a missing file is an error naming the presets."""
    p = Path(name_or_path)
    if not p.suffix and p.name == name_or_path:
        preset = presets_dir() / f"{name_or_path}.toml"
        if preset.is_file():
            return preset
    if p.is_file():
        return p
    what = "is a folder, not a TOML file" if p.is_dir() else "not found"
    raise SpecEdgeError(f"config {name_or_path!r} {what}: give a TOML file or one of the presets "
                        f"({', '.join(list_presets()) or 'none found in ' + str(presets_dir())})")


def load_config(name_or_path: str) -> dict[str, dict[str, Any]]:
    p = config_path(name_or_path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise SpecEdgeError(f"config {p} is not a TOML file: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise SpecEdgeError(f"config {p}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecEdgeError(f"config {p} is not valid TOML: {e}") from e
    unknown = sorted(set(data) - set(SECTIONS) - {"preset", "board"})
    if unknown:
        raise SpecEdgeError(f"config {p}: unknown table(s) {', '.join(unknown)}; allowed: {', '.join(SECTIONS)}")
    return data


def config_option(section: str):
    """A click ``--config`` option that loads ``[section]`` of a preset as the command's defaults."""

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
        if not value:
            return value
        try:
            table = load_config(value).get(section, {})
        except SpecEdgeError as e:
            raise click.BadParameter(str(e)) from None
        params = {p.name: p for p in ctx.command.params}
        bad = sorted(set(table) - set(params))
        if bad:
            raise click.BadParameter(f"[{section}] of {value} has keys this command does not take: {', '.join(bad)} "
                                     f"(options: {', '.join(sorted(set(params) - {'config'}))})")
        for key, v in table.items():  # click would turn 4.7 into 4 without a word
            if isinstance(params[key].type, click.types.IntParamType) and type(v) is not int:
                shown = json.dumps(v) if isinstance(v, (bool, float, str)) else repr(v)  # as TOML writes it
                raise click.BadParameter(f"[{section}] {key} = {shown} in {config_path(value)}: {key} takes an "
                                         f"integer")
        # lists become the comma-separated strings the options parse
        table = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in table.items()}
        ctx.default_map = {**(ctx.default_map or {}), **table}
        ctx.meta["specedge.config"] = value  # (spec-export export: a preset given by --config is its profile too)
        return value

    return click.option("--config", is_eager=True, expose_value=False, callback=callback,
                        help=f"Preset name ({', '.join(list_presets())}) or TOML file whose [{section}] table sets "
                             "this command's defaults; explicit options win.")
