"""What a decoder builds from its bundle before the loop runs: drafters by name, the checked draft length, the
width plain rounds run at, and the warnings a bundle's form earns."""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Callable
from pathlib import Path

from .adaptive import AutoDrafter
from .drafters import DraftCache, Drafter, ModelDrafter, NoDrafter, PromptLookupDrafter, SelfDrafter
from .errors import OptionError, SamplingParamsError
from .manifest import (
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    INTGEMM_FORMAT,
    SEK_ATTENTION,
    SEK_FORMAT,
    VERIFY_MODES,
    Manifest,
)
from .policy import SPEC_MODES, CostModel

DRAFTER_ALIASES = {"lookup": "prompt-lookup", "off": "none"}


def make_drafter(kind: str | None, manifest: Manifest, draft_cache: DraftCache | None,
                 cost_model: Callable[[], CostModel]) -> Drafter:
    """kind: auto (default) | hybrid | model | prompt-lookup (lookup) | none (off). ``cost_model`` is called only
    for auto and hybrid (it may time the steps)."""
    if kind is not None and not isinstance(kind, str):
        raise SamplingParamsError(f"drafter must be a name (auto, hybrid, model, prompt-lookup or none), "
                                  f"got {kind!r}")
    kind = DRAFTER_ALIASES.get(kind or "auto", kind or "auto")
    p = manifest.drafter_params
    if kind == "model":
        if draft_cache is None:
            raise SamplingParamsError("this bundle has no draft model; use drafter 'prompt-lookup' or 'none'")
        head = manifest.draft.head if manifest.draft is not None else None
        if manifest.draft is not None and manifest.draft.is_self:
            return SelfDrafter(draft_cache, manifest.target.dims.vocab, manifest.prefill_chunk)
        return ModelDrafter(draft_cache, manifest.target.dims.vocab, manifest.prefill_chunk,
                            None if head is None else head.ids())
    if kind == "prompt-lookup":
        return PromptLookupDrafter(p.get("ngram_max", DEFAULT_NGRAM_MAX), p.get("ngram_min", DEFAULT_NGRAM_MIN))
    if kind == "none":
        return NoDrafter()
    if kind in SPEC_MODES:
        model = make_drafter("model", manifest, draft_cache, cost_model) if draft_cache is not None else None
        return AutoDrafter(cost_model(), make_drafter("prompt-lookup", manifest, draft_cache, cost_model), model,
                           mode=kind)
    raise SamplingParamsError(f"unknown drafter {kind!r}; choose auto, hybrid, model, prompt-lookup (lookup) "
                              f"or none (off)")


def draft_length(k: object, K: int) -> int:
    """The k a request asked for (None: K), checked: an int (numpy's too) in 0..K, not a bool, 2.5 or "3"."""
    asked = K if k is None else k
    try:
        n = -1 if isinstance(asked, bool) else operator.index(asked)
    except TypeError:
        n = -1
    if not 0 <= n <= K:
        raise SamplingParamsError(f"k must be an integer in 0..{K} (the bundle's verify width is K+1={K + 1}), "
                                  f"got {asked!r}")
    return n


def width1_exact(manifest: Manifest) -> bool:
    """specedge's own kernels (matrices and attention) compute a lone row exactly as inside a wider step: plain
    decoding may run width 1 (no guess row) and stays bitwise the same."""
    return (manifest.target.quant or {}).get("attention") == SEK_ATTENTION


def plain_width(manifest: Manifest, invariant: bool) -> int:
    """The narrowest step the target runs: 1 where its kernels are exact at width 1 (or invariance is not asked
    for); else 2, so that a plain round runs width 2 with a free one-token guess and every logits row is computed by
    the kernels that compute it in a verify step."""
    return 2 if invariant and not width1_exact(manifest) else 1


def warn_about_form(bundle_dir: Path, manifest: Manifest, backend: str, invariant: bool) -> None:
    """Warn where a bundle's form cannot keep speculation bitwise equal to plain decoding on this backend."""
    t = manifest.target
    odd = [w.T for w in t.widths if w.L == w.T and w.T > 1 and w.T % 2]
    # integer GEMM alone, or specedge's kernel: exact at any width
    pairs = t.quant and t.quant.get("format") not in (INTGEMM_FORMAT, SEK_FORMAT)
    if invariant and pairs and odd and t.quant.get("block", 32) >= 64:  # block 32: the same rounding (measured)
        warnings.warn(f"{bundle_dir}: this int8/int4 target declares odd verify widths {odd}; with blocks >= 64 "
                      f"ONNX Runtime computes an odd last row by other rounding, so speculative output may differ "
                      f"from plain. Re-export it: new exports use even widths (docs/exactness.md).", stacklevel=4)
    if backend == "ort-cpu" and manifest.kv_mode == "portable":
        warnings.warn(f"{bundle_dir}: a portable-KV bundle on a CPU: its attention's rows differ by ~1e-6 between "
                      f"feeding patterns, so greedy speculation can differ from plain decoding (at near-ties in "
                      f"fp32, often in int8/int4). "
                      f"Export with --for cpu (in-place KV) for bitwise identity (docs/exactness.md).",
                      stacklevel=4)


MAX_BATCH = 48  # requests a decoder decodes together at most (each takes a row of the widest batch width)


def check_load_options(bundle: object, verify: str, threads: object, precision: object, max_batch: object = 1) -> None:
    """SpecDecoder.load's arguments, checked before anything is read."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH:
        raise OptionError(f"max_batch must be an int in 1..{MAX_BATCH} (requests decoded together), got "
                          f"{max_batch!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= 256):
        raise OptionError(f"threads must be an int in 1..256 (or None: physical cores), got {threads!r}")
    if verify not in VERIFY_MODES:
        raise OptionError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    if precision not in (None, "fp32", "fp16", "bf16"):
        raise OptionError(f"precision must be fp16 or bf16 (the bundle's reduced-precision graphs or engines), "
                          f"fp32 or None, got {precision!r}; int8/int4 weights are chosen at export (--weights)")
    if not isinstance(bundle, (str, os.PathLike)):
        raise OptionError(f"bundle must be a path to a bundle directory, got {type(bundle).__name__}")
