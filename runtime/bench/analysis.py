"""Pure statistics for the benchmark: no timing, no I/O, unit-tested.

Speedups are *paired*: each speculative run is divided by the plain run of the same prompt,
repeat and sampling settings, measured back to back in the same process, and the median of
those ratios is reported (not a ratio of medians, which can mix different prompts).
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Sequence

from ..adaptive import expected_tokens_per_round


def spread(values: Iterable[float]) -> dict[str, float]:
    """median, min, max and the number of values."""
    v = sorted(values)
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(v), "min": v[0], "max": v[-1], "n": len(v)}


def paired_speedups(runs: Sequence[dict[str, Any]], metric: str = "decode_tok_s") -> dict[tuple, list[float]]:
    """Ratios of ``metric`` over the plain run of the same (prompt, repeat, temperature).

    runs: records with keys prompt_id, repeat, temperature, drafter, k and ``metric``; the plain
    baseline is the record with drafter "none". Returns {(drafter, k, temperature): [ratio, ...]}.
    A configuration whose baseline is missing or zero is left out (never guessed).
    """
    base = {(r["prompt_id"], r["repeat"], r["temperature"]): r[metric] for r in runs if r["drafter"] == "none"}
    out: dict[tuple, list[float]] = {}
    for r in runs:
        if r["drafter"] == "none":
            continue
        b = base.get((r["prompt_id"], r["repeat"], r["temperature"]))
        if b:
            out.setdefault((r["drafter"], r["k"], r["temperature"]), []).append(r[metric] / b)
    return out


def ideal_speedup(alpha: float, c: float, k: int) -> float:
    """(1 - alpha^(k+1)) / ((1 - alpha)(1 + c k)): c = draft step time / target step time.

    Assumes every round drafts k tokens and verifying k+1 tokens costs one target step, which on
    a CPU it does not; :func:`round_cost_in_plain_steps` shows what a round really costs.
    """
    return expected_tokens_per_round(alpha, k) / (1.0 + c * k)


def round_cost_in_plain_steps(round_seconds: float, plain_step_seconds: float) -> float:
    """A speculative round's time in units of one plain decode step. Speedup = tokens per round / this,
    so with the acceptance it explains the whole result: the ideal formula assumes it is 1 + c·k."""
    return round_seconds / plain_step_seconds


def best_k(speedups: dict[tuple, float]) -> dict[tuple, tuple[int, float]]:
    """{(suite, drafter, temperature, k): speedup} -> {(suite, drafter, temperature): (best k, its speedup)}.
    Ties go to the smaller k (less work for the same result)."""
    best: dict[tuple, tuple[int, float]] = {}
    for (suite, drafter, temp, k), s in sorted(speedups.items(), key=lambda kv: kv[0][3]):
        key = (suite, drafter, temp)
        if key not in best or s > best[key][1]:
            best[key] = (k, s)
    return best
