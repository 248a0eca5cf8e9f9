"""Step costs: how long each model's step takes at each declared width, timed here and kept between processes.

`auto` decides with these (``policy.CostModel``). A step's cost grows with the context it attends over, so the widths
are timed at a short context (``COST_DEPTH`` positions) and a few of them again deep in the cache (``DEEP_DEPTH``):
their difference is each width's cost per position, which the cost model adds for a request's own context. Timing
takes a few seconds for the Qwen pair on 2 cores, so on ONNX Runtime CPU the times are kept a day in
SPECEDGE_COST_CACHE (default SPECEDGE_CACHE/costs; "off" keeps nothing), under a key of everything that changes them:
the bundle's manifest, backend, precision, threads, the plain width, ONNX Runtime's version, the kernel build and the
CPU.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .manifest import MANIFEST_NAME

COST_CACHE_MAX_AGE_S = 24 * 3600  # step costs kept between processes this long
# How the kept costs were timed (`time_runner`: every width in turn in each pass, at `cost_depth`, and the slopes of
# `time_slopes`); a kept entry timed another way is timed again, since its widths' ratios may hold a shared machine's
# passing phase, or another context's attention.
STEP_TIMING = 3
# The context the widths are timed at: a chat or code prompt's. Timed at a quarter of S_max instead, a 32,768-position
# bundle would price every step at 8,192 positions: the Qwen target's plain step at 50.8 ms where a short prompt's
# runs 29, its 3-token step at 1.69x the plain one where it costs 1.49x, the draft's step at twice its cost; and auto
# then ran code prompts plain where the draft model paid 1.19x (docs/speculation.md).
COST_DEPTH = 128
# ... and the context a few widths are timed at again, for each width's cost per position
DEEP_DEPTH = 4096

Steps = dict[str, dict[int, float]]  # {role: {width T: seconds}}


@dataclass
class StepCosts:
    """What the cost model is built from: seconds per step per role and width at ``depth`` positions of context, and
    per role the seconds each further position adds to a step of some widths (``slopes``; none where the bundle's
    context is too short to time them apart)."""

    steps: Steps
    depth: int
    slopes: Steps = field(default_factory=dict)


def cost_depth(max_context: int) -> int:
    """The context the widths are timed at: COST_DEPTH, or a quarter of a shorter S_max."""
    return min(COST_DEPTH, max_context // 4)


def read_step_costs(path: Path | None) -> StepCosts | None:
    """Step costs a previous process measured, or None (none kept, too old, timed another way, unreadable)."""
    if path is None:
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("timing") != STEP_TIMING or not 0 <= time.time() - float(raw["measured_at"]) <= COST_CACHE_MAX_AGE_S:
            return None
        steps = {role: {int(t): float(s) for t, s in raw["steps"][role].items()} for role in raw["steps"]}
        slopes = {role: {int(t): float(s) for t, s in raw["slopes"][role].items()} for role in raw["slopes"]}
        depth = int(raw["depth"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if "target" not in steps or not all(s > 0 and math.isfinite(s) for d in steps.values() for s in d.values()):
        return None
    if depth < 0 or not all(s >= 0 and math.isfinite(s) for d in slopes.values() for s in d.values()):
        return None
    return StepCosts(steps, depth, slopes)


def write_step_costs(path: Path | None, costs: StepCosts) -> None:
    """Keep measured step costs for the next process (atomically; a cache that cannot be written is skipped)."""
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            tmp = f.name
            json.dump({"timing": STEP_TIMING, "measured_at": time.time(), "depth": costs.depth,
                       "steps": {r: {str(t): s for t, s in d.items()} for r, d in costs.steps.items()},
                       "slopes": {r: {str(t): s for t, s in d.items()} for r, d in costs.slopes.items()}}, f)
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
    ``repeats``, after one warm-up step each. Dummy tokens at ``past_len`` (default ``cost_depth``): the caller owns
    the cache and must treat its rows as garbage afterwards. ``all_logits_only`` skips the prefill widths.

    Every pass runs the widths in turn, so a shared machine that changes phase during the timing moves every width
    alike; timed one width after another, the late widths would take a slow phase into auto's cost model as their
    shape."""
    widths = [w for w in runner.entry.widths if not (all_logits_only and w.L != w.T)]
    at = cost_depth(max_context) if past_len is None else past_len
    args = [(np.zeros(w.T, dtype=np.int64), min(at, max_context - w.T), w.L == w.T) for w in widths]
    for ids, pos, all_logits in args:
        runner.step(ids, pos, all_logits=all_logits)  # warm each width
    times: dict[int, list[float]] = {w.T: [] for w in widths}
    for _ in range(repeats):
        for w, (ids, pos, all_logits) in zip(widths, args):
            t0 = time.perf_counter()
            runner.step(ids, pos, all_logits=all_logits)
            times[w.T].append(time.perf_counter() - t0)
    return {T: float(reduce(ts)) for T, ts in times.items()}


def time_slopes(runner, max_context: int, widths: list[int], repeats: int, reduce) -> dict[int, float]:  # noqa: ANN001
    """Seconds each position of context adds to a step of ``runner`` at each of ``widths`` (all-logits widths it
    declares): the step timed at ``cost_depth`` and at DEEP_DEPTH (or half a shorter S_max), in turn in each pass as
    ``time_runner`` times, the difference over the positions between (never below 0). Empty where the two contexts
    would lie too close to tell apart (S_max below 1,024)."""
    lo, hi = cost_depth(max_context), min(DEEP_DEPTH, max_context // 2)
    declared = {w.T for w in runner.entry.widths if w.L == w.T}
    widths = [T for T in widths if T in declared and hi + T <= max_context]
    if hi - lo < 256 or not widths:
        return {}
    runs = [(T, at) for T in widths for at in (lo, hi)]
    for T, at in runs:
        runner.step(np.zeros(T, dtype=np.int64), at, all_logits=True)  # warm each
    times: dict[tuple[int, int], list[float]] = {r: [] for r in runs}
    for _ in range(repeats):
        for T, at in runs:
            t0 = time.perf_counter()
            runner.step(np.zeros(T, dtype=np.int64), at, all_logits=True)
            times[(T, at)].append(time.perf_counter() - t0)
    return {T: max(0.0, float(reduce(times[(T, hi)]) - reduce(times[(T, lo)])) / (hi - lo)) for T in widths}
