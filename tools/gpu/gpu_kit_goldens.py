"""The GPU kit's goldens: a fixed script of runner steps, recorded on ONNX Runtime CPU, replayed on any backend.

A *step script* is a list of runner calls ``step(tokens, past_len, all_logits)`` on a bundle's target and
draft, in one order (the two models interleaved, as a speculative decoder runs them; on TensorRT they share
one stream and one scratch block):

* ``past_len 0``: every declared width of each model on a fresh cache (rows past the cursor: zeros);
* ``past_len P``: a P-token prefix, then every width at past_len P (each step reads the prefix and
  overwrites rows P.. that the previous step wrote: stale rows past the cursor must not matter);
* ``rollback``: ten simulated rounds — the draft proposes k (1..K) one-token steps, the target verifies
  k+1 tokens (padded into the smallest declared width >= k+1), a random number of them is accepted and
  both cursors move back to just past the accepted ones, so the next round overwrites rejected rows;
* ``padded prefill``: a prefill chunk shorter than P at past_len > 0 (padding computed, never committed).

:func:`record` runs a script on the fp32 (or int4, fp32-compute) graphs with ONNX Runtime CPU and stores every step's
logits with the script itself (``.npz``: ``op{i}`` arrays + ``meta`` JSON), so a check replays exactly what
was recorded (:func:`replay`) and compares step by step (:func:`compare`) under a named :data:`TOLERANCES`
entry. Nothing here needs a GPU; the backends are opened by the caller.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np

GOLDENS_VERSION = 1
ROUNDS = 10  # simulated speculative rounds in the rollback part of a script


@dataclass(frozen=True)
class Tol:
    """A step passes when max|got - ref| <= rel * max|ref| + atol over its logits [L, V], and every row's argmax
    equals the reference's unless the reference's own top-1/top-2 gap is below 2 x that bound (a near-tie,
    counted and reported, not failed)."""

    rel: float
    atol: float
    why: str

    def bound(self, ref: np.ndarray) -> float:
        return float(self.rel * np.abs(ref).max() + self.atol)

    def text(self) -> str:
        return f"max|d| <= {self.rel:g} x max|ref| + {self.atol:g}; argmax equal per row (near-ties exempt)"


# Logits of the tiny kit models reach |x| ~ 3-5. fp16 bounds: measured on ONNX Runtime CPU, the fp16 graphs
# differ from the fp32 goldens by <= 0.6 % of the logit scale (prepare records the measured value in kit.json);
# 3 % leaves room for TensorRT's fp16 tactics, which accumulate in fp16 tiles, and for 2 layers of fp16 KV.
TOLERANCES = {
    "exact": Tol(0.0, 0.0, "same graphs, same backend, same machine: bit for bit"),
    "fp32": Tol(1e-3, 1e-4, "fp32 graphs, fp32 math (ONNX Runtime CUDA with use_tf32=0) vs fp32 on the CPU"),
    "tf32": Tol(1e-2, 1e-3, "fp32 graphs whose matmuls run in TF32 (ONNX Runtime CUDA and its TensorRT EP default "
                            "on compute capability >= 8.0: 10-bit mantissa inputs, fp32 accumulation)"),
    "fp16": Tol(3e-2, 2e-2, "fp16 graphs (weights, activations, KV in fp16; norms, softmax, logits fp32) vs fp32"),
    "int4": Tol(1e-2, 1e-3, "the same int4 MatMulNBits graph (accuracy_level 0: fp32 compute on the CPU) on another "
                            "execution provider; CUDA's kernel may use TF32 / fp16 tiles"),
    # int4 on a GPU: the int4-qdq bundle's fp16 graph (TensorRT builds it as weight-only INT4) vs its int4 graph
    # computed in fp32 on the CPU. The int4 weights are the same (scales rounded to fp16: 2^-11 relative), so what
    # differs is fp16 compute, as for the fp16 bound; measured on ONNX Runtime CPU <= 0.7 % of the logit scale.
    "int4-fp16": Tol(3e-2, 2e-2, "int4 on the GPU: the int4-qdq fp16 graph (INT4 DequantizeLinear weights, fp16 "
                                 "scales, activations and KV; norms, softmax, logits fp32) on TensorRT (weight-only "
                                 "INT4) or ONNX Runtime vs the same int4 weights computed in fp32 on the CPU"),
}


def step_script(manifest: Any, seed: int = 0) -> list[dict]:
    """The steps to record for one bundle: [{role, tokens, past_len, all_logits, part}] (see the module doc)."""
    rng = np.random.default_rng(seed)
    roles = [r for r in ("target", "draft") if r in manifest.models]
    widths = {r: manifest.models[r].widths for r in roles}
    P, K, V = manifest.prefill_chunk, manifest.k, manifest.tokenizer.vocab_size
    ops: list[dict] = []

    def op(role: str, n: int, past_len: int, all_logits: bool, part: str) -> None:
        ops.append({"role": role, "tokens": rng.integers(3, V, n).tolist(), "past_len": int(past_len),
                    "all_logits": bool(all_logits), "part": part})

    def every_width(past_len: int, part: str) -> None:
        for ws in zip_longest(*(widths[r] for r in roles)):  # target and draft interleaved
            for r, w in zip(roles, ws):
                if w is not None:
                    op(r, w.T, past_len, w.L == w.T, part)

    every_width(0, "past_len 0")
    for r in roles:
        op(r, P, 0, False, "past_len P")
    every_width(P, "past_len P")
    pos = P  # both cursors: rows [0, pos) are committed
    for _ in range(ROUNDS):
        k = int(rng.integers(1, K + 1))
        for j in range(k if "draft" in roles else 0):  # the draft proposes k tokens, one step each
            op("draft", 1, pos + j, False, "rollback")
        op("target", k + 1, pos, True, "rollback")  # verify [last committed, d1..dk]
        pos += int(rng.integers(0, k + 1)) + 1  # accepted + the target's own token: rejected rows are stale
    for r in roles:
        op(r, max(1, P // 2 - 1), pos, False, "padded prefill")
    return ops


def run_script(runners: dict[str, Any], ops: list[dict]) -> list[np.ndarray]:
    """Run every step in order; a copy of each step's logits [rows, V] (a runner's output is a view)."""
    return [np.array(runners[o["role"]].step(o["tokens"], o["past_len"], o["all_logits"]), dtype=np.float32)
            for o in ops]


def record(path: Path, bundle_dir: Path, manifest: Any, runners: dict[str, Any], what: str, seed: int = 0) -> dict:
    """Record one bundle's script with `runners` (ONNX Runtime CPU) into `path` (.npz); returns its meta."""
    ops = step_script(manifest, seed)
    logits = run_script(runners, ops)
    graphs = {r: manifest.files[e.graph]["sha256"] for r, e in manifest.models.items()}
    meta = {"version": GOLDENS_VERSION, "what": what, "bundle": bundle_dir.name, "graphs": graphs, "seed": seed,
            "widths": {r: [[w.T, w.L] for w in e.widths] for r, e in manifest.models.items()}, "ops": ops}
    arrays = {f"op{i}": a for i, a in enumerate(logits)}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez_compressed(path, **arrays)
    return meta


def load(path: Path) -> tuple[dict, list[np.ndarray]]:
    z = np.load(path)
    meta = json.loads(bytes(z["meta"]).decode())
    if meta.get("version") != GOLDENS_VERSION:
        raise ValueError(f"{path}: goldens version {meta.get('version')}, this kit reads {GOLDENS_VERSION}")
    return meta, [z[f"op{i}"] for i in range(len(meta["ops"]))]


def compare(meta: dict, ref: list[np.ndarray], got: list[np.ndarray], tol: Tol) -> dict:
    """Step-by-step comparison, summarised per part of the script; `passed` is the verdict."""
    parts: dict[str, dict] = {}
    worst = None
    for i, (o, r, g) in enumerate(zip(meta["ops"], ref, got)):
        p = parts.setdefault(o["part"], {"steps": 0, "passed": 0, "max_absdiff": 0.0, "max_reldiff": 0.0,
                                         "argmax_mismatch": 0, "near_ties": 0, "widths": set()})
        p["steps"] += 1
        p["widths"].add(f"{o['role']} T={width_of(meta, o)}")
        if g.shape != r.shape or not np.isfinite(g).all():
            ok, d, rel, bad, ties = False, float("inf"), float("inf"), r.shape[0], 0
        else:
            d = float(np.abs(g - r).max())
            scale = float(np.abs(r).max())
            rel = d / scale if scale else d
            bound = tol.bound(r)
            top2 = np.sort(r, axis=-1)[:, -2:]
            gap = top2[:, 1] - top2[:, 0]
            differ = np.argmax(g, -1) != np.argmax(r, -1)
            ties = int((differ & (gap < 2 * bound)).sum()) if tol.rel or tol.atol else 0
            bad = int(differ.sum()) - ties
            ok = d <= bound and bad == 0
        p["passed"] += ok
        p["max_absdiff"] = max(p["max_absdiff"], d)
        p["max_reldiff"] = max(p["max_reldiff"], rel)
        p["argmax_mismatch"] += bad
        p["near_ties"] += ties
        if not ok and worst is None:
            worst = {"step": i, **{k: o[k] for k in ("role", "past_len", "all_logits", "part")},
                     "n_tokens": len(o["tokens"]), "max_absdiff": d, "bound": tol.bound(r) if np.isfinite(d) else None,
                     "shape": [list(r.shape), list(g.shape)], "finite": bool(np.isfinite(g).all())}
    for p in parts.values():
        p["widths"] = sorted(p["widths"], key=lambda w: (w.split()[0] != "target", int(w.split("=")[1])))
        p["max_absdiff"], p["max_reldiff"] = _round(p["max_absdiff"]), _round(p["max_reldiff"])
    steps = sum(p["steps"] for p in parts.values())
    passed = sum(p["passed"] for p in parts.values())
    return {"passed": passed == steps == len(meta["ops"]) and len(got) == len(ref), "steps": steps,
            "steps_passed": passed, "tolerance": {**asdict(tol), "rule": tol.text()}, "parts": parts,
            "first_failure": worst}


def width_of(meta: dict, o: dict) -> int:
    """The declared width a step runs in (min_width 1): the smallest T >= its tokens, all-logits widths for
    all_logits steps."""
    fits = [t for t, n_logits in meta["widths"][o["role"]]
            if t >= len(o["tokens"]) and (not o["all_logits"] or n_logits == t)]
    return min(fits)


def _round(x: float) -> float:
    return x if not np.isfinite(x) else float(f"{x:.4g}")


def replay(goldens: Path, runners: dict[str, Any], tol: Tol, after: Callable[[], None] | None = None) -> dict:
    """Replay a goldens file's script on `runners` and compare. `after` runs once the script is done (timing)."""
    meta, ref = load(goldens)
    got = run_script(runners, meta["ops"])
    if after:
        after()
    return compare(meta, ref, got, tol)


def script_summary(meta: dict) -> dict:
    """What a script exercises, for a plan: steps per part and the (role, T) widths declared."""
    parts: dict[str, int] = {}
    for o in meta["ops"]:
        parts[o["part"]] = parts.get(o["part"], 0) + 1
    return {"steps": len(meta["ops"]), "per_part": parts,
            "widths_T": {r: [t for t, _ in ws] for r, ws in meta["widths"].items()}}


# ------------------------------------------------------------------ greedy goldens
def greedy_run(dec: Any, prompt: str, n: int, drafter: str = "none", k: int | None = None) -> Any:
    """One greedy chat generation of n tokens (eos ignored): the GenerationResult (token_ids, stats)."""
    from specedge.runtime import SamplingParams

    return dec.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), drafter=drafter, k=k, chat=True)


def greedy_tokens(dec: Any, prompt: str, n: int, drafter: str = "none", k: int | None = None) -> list[int]:
    return list(greedy_run(dec, prompt, n, drafter, k).token_ids)


def top2_gaps(runner: Any, ids: list[int], tokens: list[int], prefill_chunk: int) -> list[float]:
    """The reference's top-1 minus top-2 logit before each greedy token (teacher-forced, width >= 2 steps as the
    decoder runs them): a small gap is a near-tie that another backend may break the other way."""
    from specedge.runtime.drafters import feed

    last = feed(runner, np.array(ids), 0, prefill_chunk)
    gaps, pos = [], len(ids)
    for t in tokens:
        top2 = np.partition(last, -2)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        last = runner.step([t, t], pos, all_logits=True)[0]  # the second row is padding-like, never used
        pos += 1
    return gaps


def greedy_match(golden: list[int], gaps: list[float], got: list[int], tie: float) -> dict:
    """Plain greedy tokens of another backend vs the golden ones: equal, or diverging first where the golden's
    top-2 gap is below `tie` (a near-tie; what follows it legitimately differs)."""
    j = next((i for i, (a, b) in enumerate(zip(golden, got)) if a != b), None)
    if j is None and len(got) != len(golden):
        j = min(len(got), len(golden))
    if j is None:
        return {"equal": True, "passed": True}
    gap = gaps[j] if j < len(gaps) else None
    return {"equal": False, "first_difference": j, "golden_gap": gap, "tie_bound": tie,
            "passed": gap is not None and gap < tie}
