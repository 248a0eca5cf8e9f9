"""Deployment profiles: the form an export takes for where the bundle will run (`spec-export export --for NAME`).

A profile is a preset (``configs/NAME.toml``) read for its ``[export]`` table and for where it runs (its ``[run]``
backend). Its model names are not taken: they are what ``spec-export plan NAME`` sizes, while ``--for`` only chooses
the form of the models given on the command line. Every option set on the command line or by ``--config`` wins.

The ``cpu`` profile (the default) is the fastest form that keeps a GGUF's own weights and is bitwise exact on a CPU:
its 4-bit blocks through specedge's kernels (``--quant-form auto``: where a C compiler runs here), the in-place KV
cache, odd verify widths up to K and the file's own lm_head. Three rules follow from "keeps the weights" and
"exact":

* a source that is not a GGUF keeps its float weights (fp32): re-quantizing is lossy, so it is asked for by name
  (``--weights int4``), never implied by a profile;
* without a C compiler the 4-bit blocks go to ONNX Runtime's MatMulNBits (exact too, slower), and the export says so;
* on a CPU profile the portable KV mode is refused: its attention sums a position's value into the cache part or
  the new part depending on the step that fed it, so its rows differ by ~1e-6 between feeding patterns; greedy
  speculation then differs from plain decoding at near-ties in fp32 and often in int8/int4 (docs/exactness.md).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specedge.runtime.errors import OptionError

if TYPE_CHECKING:
    from .quant import WeightFormat

DEFAULT_PROFILE = "cpu"
MODEL_KEYS = ("target", "draft")  # a preset's models are for `spec-export plan`; --for never takes them
GPU_BACKENDS = ("trt", "ort-trt", "ort-cuda")
KERNEL_MACHINES = ("x86_64", "amd64", "aarch64", "arm64")  # where specedge's kernels have vector paths


@dataclass(frozen=True)
class Profile:
    name: str
    device: str  # "cpu" | "gpu": where the bundle runs (the preset's [run] backend)
    export: dict[str, Any] = field(default_factory=dict)  # [export] defaults, model names left out


def load_profile(name: str, fallback: Profile | None = None) -> Profile:
    """The profile NAME (a preset name or a TOML file); OptionError listing the presets otherwise. A file with no
    form options in its [export] table is ``fallback`` where one is given (a --config that names models only)."""
    from specedge.runtime.config import list_presets, load_config
    from specedge.runtime.errors import SpecEdgeError

    try:
        cfg = load_config(name)
    except SpecEdgeError as e:
        raise OptionError(f"--for {name}: {e}") from None
    backend = cfg.get("run", {}).get("backend", "ort-cpu")
    table = {k: v for k, v in cfg.get("export", {}).items() if k not in MODEL_KEYS}
    if not table and fallback is not None:
        return fallback
    if not table:
        raise OptionError(f"--for {name}: the preset has no [export] table (presets: {', '.join(list_presets())})")
    return Profile(Path(name).stem, "gpu" if backend in GPU_BACKENDS else "cpu", table)


def default_verify_widths(k: int) -> tuple[int, ...]:
    """The narrower verify widths a bundle of draft length K declares when none are given: the odd ones from 3 up to
    K (K+1 is always there). A short draft then runs in a step near its own size instead of K+1 rows: on a CPU a
    step's cost grows with its width (docs/cpu-kernels.md)."""
    return tuple(range(3, k + 1, 2))


def kernels_buildable() -> str | None:
    """None where specedge's kernels can be built on this machine (a C compiler and an x86-64 or AArch64 CPU),
    else why not."""
    import shutil

    from specedge.runtime.errors import BackendUnavailableError
    from specedge.runtime.kernels import compiler

    if platform.machine().lower() not in KERNEL_MACHINES:
        return f"this CPU ({platform.machine()}) is neither x86-64 nor AArch64"
    try:
        cc = compiler()
    except BackendUnavailableError:
        return "no C compiler was found (cc, gcc, clang or $CC)"
    if shutil.which(cc[0]) is None:
        return f"the C compiler {cc[0]} (from $CC) was not found"
    return None


def settle(values: dict[str, Any], given: set[str], profile: Profile, target: str,
           say: Callable[[str], None]) -> dict[str, Any]:
    """The export's option values under ``profile``: ``values`` holds every option (click's defaults where not
    ``given``); returns them with the profile's defaults and the "auto" choices resolved but the lm_head's, which
    needs the file (:func:`head_from_file`). ``target`` is the --target as given: nothing is read or fetched here.
    Raises OptionError for a combination the profile's device cannot run exactly."""
    from .fetch import KNOWN_MODELS

    target = str(target)
    out = dict(values)
    for name, v in profile.export.items():
        if name not in given:
            out[name] = v
    if "verify_widths" not in given and "verify_widths" not in profile.export:
        out["verify_widths"] = default_verify_widths(int(out["k"]))
    if isinstance(out.get("verify_widths"), list):
        out["verify_widths"] = tuple(out["verify_widths"])

    is_gguf = target in KNOWN_MODELS or target.endswith(".gguf")  # every known model is a GGUF
    if out["weights"] in ("int8", "int4") and "weights" not in given and not is_gguf:
        if Path(target).exists():  # (a missing one is the export's error to give)
            say(f"{target} is not a GGUF: its weights are kept as they are (fp32). Re-quantizing them is lossy: ask "
                f"for it with --weights int8 or int4 (spec-export info then prints the error it added)")
        out["weights"] = "fp32"
    if out.get("quant_form") == "auto":
        out["quant_form"] = auto_form(out["weights"], profile, say)
    if out.get("kv_mode") == "auto":  # row-addressed steps where the form's attention has them (batches of requests)
        out["kv_mode"] = "rows" if out.get("quant_form") == "specedge" else "ort-inplace"
    if out.get("kv_dtype", "auto") == "auto":  # fp16 where specedge's attention reads the cache (every model's)
        quantized = all(w in ("int8", "int4") for w in (out["weights"], out.get("draft_weights") or out["weights"]))
        out["kv_dtype"] = ("fp16" if out.get("quant_form") == "specedge" and quantized
                           and out["kv_mode"] in ("rows", "ort-inplace") else "fp32")
    if profile.device == "cpu" and out["kv_mode"] == "portable":
        raise OptionError(
            f"--kv-mode portable is not bitwise exact on a CPU (--for {profile.name}): its attention sums a "
            "position's value in the cache part or the new part depending on the step that fed it, so greedy "
            "speculation can differ from plain decoding (at near-ties in fp32; often in int8/int4, where the "
            "activations' rounding amplifies it: docs/exactness.md). Use --kv-mode ort-inplace (exact in every "
            "weight format), or export for TensorRT with --for jetson-orin-nano-8gb or --for datacenter-gpu")
    return out


def auto_form(weights: str, profile: Profile, say: Callable[[str], None]) -> str:
    """--quant-form auto: specedge's kernels on a CPU where they can be built, else ONNX Runtime's MatMulNBits
    (a GPU profile names its form; an fp32 export has no quantized matrices)."""
    if weights not in ("int8", "int4") or profile.device != "cpu":
        return "matmulnbits"
    why = kernels_buildable()
    if why is None:
        return "specedge"
    say(f"note: {why}, so the 4-bit blocks go to ONNX Runtime's MatMulNBits (exact, slower: docs/cpu-kernels.md): "
        "install a C compiler (apt install gcc) and export again for specedge's kernels")
    return "matmulnbits"


def head_from_file(fmt: WeightFormat, target: Path) -> WeightFormat:
    """--lm-head auto from a GGUF: the file's own output.weight blocks where it has them in a form the quantized
    matrices carry exactly (Q6_K in Q4_K_M files: exact, and smaller than a re-quantized int8 head); else as it was
    (auto: int8). A tied head is the embedding's blocks, carried so where their type is one of those (Gemma 3's Q8_0
    token_embd); a float source has none."""
    import dataclasses

    from .loaders import load_source
    from .quant import GGUF_REPACKABLE

    if fmt.lm_head != "auto" or not fmt.quantized or fmt.form not in ("specedge", "matmulnbits"):
        return fmt
    src = load_source(target)
    raw = src.raw("embed" if src.config.tie_embeddings else "lm_head")
    return dataclasses.replace(fmt, lm_head="gguf") if raw is not None and raw[0] in GGUF_REPACKABLE else fmt
