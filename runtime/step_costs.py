"""Step costs: how long each model's step takes at each declared width, timed here and kept between processes.

`auto` decides with these (``policy.CostModel``). Timing every width takes ~1.5 s for the Qwen pair on 2 cores, so
on ONNX Runtime CPU the times are kept a day in SPECEDGE_COST_CACHE (default SPECEDGE_CACHE/costs; "off" keeps
nothing), under a key of everything that changes them: the bundle's manifest, backend, precision, threads, the plain
width, ONNX Runtime's version, the kernel build and the CPU.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from .manifest import MANIFEST_NAME

COST_CACHE_MAX_AGE_S = 24 * 3600  # step costs kept between processes this long
# How the kept costs were timed (`time_runner`: every width in turn in each pass); a kept entry timed another way is
# timed again, since its widths' ratios may hold a shared machine's passing phase.
STEP_TIMING = 2

Steps = dict[str, dict[int, float]]  # {role: {width T: seconds}}


def read_step_costs(path: Path | None) -> Steps | None:
    """Step costs a previous process measured, or None (none kept, too old, timed another way, unreadable)."""
    if path is None:
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("timing") != STEP_TIMING or not 0 <= time.time() - float(raw["measured_at"]) <= COST_CACHE_MAX_AGE_S:
            return None
        steps = {role: {int(t): float(s) for t, s in raw["steps"][role].items()} for role in raw["steps"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if "target" not in steps or not all(s > 0 and math.isfinite(s) for d in steps.values() for s in d.values()):
        return None
    return steps


def write_step_costs(path: Path | None, steps: Steps) -> None:
    """Keep measured step costs for the next process (atomically; a cache that cannot be written is skipped)."""
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump({"timing": STEP_TIMING, "measured_at": time.time(),
                       "steps": {r: {str(t): s for t, s in d.items()} for r, d in steps.items()}}, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def cost_cache_file(bundle_dir: Path, backend: str, precision: str, threads: int | None,
                    min_width: int) -> Path | None:
    """Where a decoder's step costs are kept between processes (None: not kept: GPU backends, whose steps are quick
    to time, SPECEDGE_COST_CACHE=off, or a bundle whose manifest cannot be read any more)."""
    where = os.environ.get("SPECEDGE_COST_CACHE", "")
    if where.lower() in ("off", "0", "none") or backend != "ort-cpu":
        return None
    from . import kernels
    from .cpu import cpu_features

    try:
        import onnxruntime

        ort_version = onnxruntime.__version__
    except ImportError:  # pragma: no cover - the backend is ort-cpu
        ort_version = "?"
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 0
    try:
        h = hashlib.sha256((bundle_dir / MANIFEST_NAME).read_bytes())
    except OSError:  # the bundle moved since it was loaded: time the steps, keep nothing
        return None
    for part in (backend, precision, str(threads), str(min_width), ort_version, str(kernels._built),
                 " ".join(sorted(cpu_features() or ())), platform.processor(), str(cpus)):
        h.update(b"\0" + part.encode())
    base = Path(where).expanduser() if where else kernels.cache_root() / "costs"
    return base / f"{h.hexdigest()[:20]}.json"


def time_runner(runner, max_context: int, repeats: int, past_len: int | None, all_logits_only: bool,  # noqa: ANN001
                reduce) -> dict[int, float]:  # noqa: ANN001
    """Seconds of one step of ``runner`` at each of its declared widths, ``reduce`` (np.min or np.median) over
    ``repeats``, after one warm-up step each. Dummy tokens at ``past_len`` (default S_max / 4): the caller owns the
    cache and must treat its rows as garbage afterwards. ``all_logits_only`` skips the prefill widths.

    Every pass runs the widths in turn, so a shared machine that changes phase during the timing moves every width
    alike; timed one width after another, the late widths would take a slow phase into auto's cost model as their
    shape."""
    widths = [w for w in runner.entry.widths if not (all_logits_only and w.L != w.T)]
    args = [(np.zeros(w.T, dtype=np.int64), min(max_context // 4 if past_len is None else past_len,
                                                 max_context - w.T), w.L == w.T) for w in widths]
    for ids, pos, all_logits in args:
        runner.step(ids, pos, all_logits=all_logits)  # warm each width
    times: dict[int, list[float]] = {w.T: [] for w in widths}
    for _ in range(repeats):
        for w, (ids, pos, all_logits) in zip(widths, args):
            t0 = time.perf_counter()
            runner.step(ids, pos, all_logits=all_logits)
            times[w.T].append(time.perf_counter() - t0)
    return {T: float(reduce(ts)) for T, ts in times.items()}
