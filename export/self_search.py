"""Which target layers a self draft should skip: measured acceptance times measured speed.

The calibration is the target's own greedy answers to the prompts (the built-in suites' or a prompts file's): a
draft that agrees with the target at a position proposes the token the target then accepts there. Every answer
sits in its own slot of one target cache, computed once; a candidate draft runs one step at each answer position
on those rows, as a round's first draft step would, and its row is put back after (so the next position sees the
target's rows). Its agreement there is its first-token acceptance ``alpha``.

The search: each layer skipped alone, ranked by the acceptance it keeps (a layer whose loss the draft barely
notices first); then the first m layers of that ranking skipped together, for growing m, each set timed and
measured. A set's predicted speed is a chain round's, tokens over seconds at its best draft length, against plain
decoding's one token per target step, from the target's measured verify steps. It prints every set it tried.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from specedge.runtime.backends.ort import OrtRunner, shared_weights
from specedge.runtime.bench.suites import BenchPrompt, suite_prompts
from specedge.runtime.errors import OptionError
from specedge.runtime.manifest import Manifest, read_manifest

from .self_draft import external_tensors, format_layers, with_self_draft

CALIBRATION_SUITES = ("chat", "code", "edit", "summarize")
SEARCH_GRAPH = ".self_search.onnx"  # a candidate's graph while its session is made (removed right after)


@dataclass(frozen=True)
class Trial:
    skip: tuple[int, ...]
    alpha: float  # first-token acceptance on the calibration answers
    draft_s: float  # seconds of one draft step (0: not timed)
    speedup: float  # predicted tokens per second against plain decoding (0: not predicted)
    k: int  # the draft length that prediction takes


@dataclass(frozen=True)
class SearchResult:
    best: Trial
    trials: list[Trial]
    plain_s: float  # seconds of a plain target step
    positions: int  # calibration positions each trial was measured at


def predicted_speedup(alpha: float, draft_s: float, verify_s: dict[int, float], k_max: int) -> tuple[float, int]:
    """A chain round at draft length k (1..k_max) yields 1 + a + ... + a^k tokens for k draft steps and one verify
    step of k + 1 rows; plain decoding yields one token per step of the plain width. The best k's ratio (below 1:
    slower than plain at every k), and k."""
    plain = verify_s[min(verify_s)]
    best = (0.0, 0)
    for k in range(1, k_max + 1):
        fits = [t for t in verify_s if t >= k + 1]
        if not fits:
            break
        tokens = sum(alpha ** j for j in range(k + 1))
        seconds = k * draft_s + verify_s[min(fits)]
        best = max(best, (tokens / seconds * plain, k))
    return best


class _Calibration:
    """The target's greedy answers, one per slot of a target runner whose cache holds their rows."""

    def __init__(self, bundle_dir: Path, manifest: Manifest, prompts: list[BenchPrompt], tokens: int,
                 threads: int | None, say: Callable[[str], None]):
        from specedge.runtime import SamplingParams, SpecDecoder

        base = dataclasses.replace(manifest, draft=None, drafter="none", drafter_params={})
        dec = SpecDecoder.load(bundle_dir, threads=threads)  # the plain answers (a draft, if any, is not used)
        self.seqs: list[np.ndarray] = []
        self.starts: list[int] = []
        try:
            for p in prompts:
                prompt, chat = p.as_request()
                ids = dec.encode_prompt(prompt, chat=chat)
                room = manifest.max_context - len(ids) - 1
                if room < 8:
                    continue
                r = dec.generate(prompt, SamplingParams(max_new_tokens=min(tokens, room), ignore_eos=True),
                                 chat=chat, drafter="none")
                self.seqs.append(np.array(ids + list(r.token_ids), dtype=np.int64))
                self.starts.append(len(ids))
        finally:
            dec.close()
        if not self.seqs:
            raise OptionError(f"no calibration prompt fits the bundle's context ({manifest.max_context} positions)")
        say(f"calibration: {len(self.seqs)} answers of the target, {self.positions} positions")
        target_model = onnx.load(str(Path(bundle_dir) / manifest.target.graph), load_external_data=False)
        self.weights = shared_weights(Path(bundle_dir) / str(manifest.target.weights), external_tensors(target_model))
        self.base = base
        # one spare slot beyond the answers' for the timed steps, at the position a draft step of the first answer
        # runs at: both models are timed attending over the same number of rows
        self.spare = len(self.seqs)
        self.at = min(len(self.seqs[0]), manifest.max_context - max(w.T for w in manifest.target.widths))
        self.target = OrtRunner(bundle_dir, base, "target", threads=threads, slots=len(self.seqs) + 1,
                                weights=self.weights)
        for s, seq in enumerate(self.seqs):  # every answer's rows, computed once
            for a in range(0, len(seq), manifest.prefill_chunk):
                self.target.step(seq[a: a + manifest.prefill_chunk], a, all_logits=False, slot=s)
        self.verify_s = _time(self.target, [w.T for w in manifest.target.widths if w.L == w.T], self.at, self.spare)

    @property
    def positions(self) -> int:
        return sum(len(q) - 1 - a for q, a in zip(self.seqs, self.starts))

    def trial(self, bundle_dir: Path, skip: tuple[int, ...], threads: int | None, timed: bool) -> tuple[float, float]:
        """(alpha, seconds of a draft step or 0) of the self draft skipping ``skip``."""
        cand = with_self_draft(bundle_dir, self.base, skip, graph=SEARCH_GRAPH)
        try:
            draft = OrtRunner(bundle_dir, cand, "draft", threads=threads, slots=len(self.seqs) + 1,
                              weights={n: self.weights[n] for n in cand.draft.tensors}, kv_of=self.target)
        finally:
            (Path(bundle_dir) / SEARCH_GRAPH).unlink(missing_ok=True)
        kv, layers = self.target.kv, list(cand.draft.layers)
        hits = total = 0
        for s, (seq, start) in enumerate(zip(self.seqs, self.starts)):
            for j in range(start, len(seq) - 1):
                saved = kv[layers, :, s, :, j].copy()
                hits += int(np.argmax(draft.step(seq[j: j + 1], j, all_logits=False, slot=s)[0]) == seq[j + 1])
                kv[layers, :, s, :, j] = saved
                total += 1
        step = _time(draft, [1], self.at, self.spare)[1] if timed else 0.0
        draft.close()
        return hits / total, step


def _time(runner: OrtRunner, widths: list[int], at: int, slot: int, least_s: float = 0.25,
          repeats: tuple[int, int] = (5, 200)) -> dict[int, float]:
    """The fastest step at each width, at position ``at`` of ``slot`` (rows nobody reads), of at least ``repeats[0]``
    and at most ``repeats[1]`` steps, more while they have taken under ``least_s`` seconds: a step of a few
    milliseconds is timed over many."""
    out = {}
    for t in widths:
        ids = np.zeros(t, dtype=np.int64)
        runner.step(ids, at, all_logits=t > 1, slot=slot)
        times: list[float] = []
        while len(times) < repeats[1] and (len(times) < repeats[0] or sum(times) < least_s):
            t0 = time.perf_counter()
            runner.step(ids, at, all_logits=t > 1, slot=slot)
            times.append(time.perf_counter() - t0)
        out[t] = min(times)
    return out


def search_skip(bundle_dir: str | Path, prompts: list[BenchPrompt] | None = None, tokens: int = 32,
                max_skip: float = 0.6, threads: int | None = None,
                progress: Callable[[str], None] | None = None) -> SearchResult:
    """The skip set with the best predicted speed over plain decoding among those tried (see the module)."""
    say = progress or (lambda s: None)
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir, verify="size")
    if manifest.draft is not None and not manifest.draft.is_self:
        raise OptionError(f"{bundle_dir} has a draft model; the search makes a self draft, of a bundle without one")
    n = manifest.target.dims.n_layers
    if not 0 < max_skip < 1:
        raise OptionError(f"max_skip must be a fraction of the layers in (0, 1), got {max_skip}")
    cal = _Calibration(bundle_dir, manifest, prompts or suite_prompts(CALIBRATION_SUITES, per_suite=1), tokens,
                       threads, say)
    try:
        plain_s = cal.verify_s[min(cal.verify_s)]
        say(f"target: plain step {plain_s * 1e3:.1f} ms; verify steps "
            + ", ".join(f"T={t} {s * 1e3:.1f} ms" for t, s in sorted(cal.verify_s.items())))
        singles = []
        for i in range(n):
            alpha, _ = cal.trial(bundle_dir, (i,), threads, timed=False)
            singles.append((alpha, i))
            say(f"  skip {i:>3}: alpha {alpha:.3f}")
        order = [i for _, i in sorted(singles, key=lambda a: (-a[0], a[1]))]
        trials = []
        most = max(1, int(max_skip * n))
        for m in sorted({*range(2, most + 1, max(1, n // 12)), most}):
            skip = tuple(sorted(order[:m]))
            alpha, step = cal.trial(bundle_dir, skip, threads, timed=True)
            speed, k = predicted_speedup(alpha, step, cal.verify_s, manifest.k)
            trials.append(Trial(skip, alpha, step, speed, k))
            say(f"  skip {m:>2} layers ({format_layers(skip)}): alpha {alpha:.3f}, draft step {step * 1e3:.1f} ms "
                f"({step / plain_s:.2f} of plain), predicted {speed:.2f}x plain at k={k}")
    finally:
        cal.target.close()
    best = max(trials, key=lambda t: (t.speedup, -len(t.skip)))
    return SearchResult(best, [Trial((i,), a, 0.0, 0.0, 0) for a, i in singles] + trials, plain_s, cal.positions)
