#!/usr/bin/env python3
"""What prompt lookup can buy on a bundle and its prompts: drafters replayed over greedy traces, without timing noise.

    python tools/dev/lookup_replay.py BUNDLE [--suite code,edit,... | --prompts FILE.jsonl] [--max-new-tokens 192]
                                  [--save-traces F]
    python tools/dev/lookup_replay.py --traces F [--traces G ...]        # replay saved traces again (no model run)
    python tools/dev/lookup_replay.py --traces F --retime BUNDLE          # ... at step times taken now
    python tools/dev/lookup_replay.py --traces F [--traces G] --drift 8 --order code,edit,chat,summarize,json \
        --order json,summarize,edit,chat,code ...                     # auto in several request orders

Greedy output does not depend on the drafter (speculative = plain, bitwise), so one plain generation per prompt
fixes what every drafter's tokens would be checked against. This tool makes those traces with the bundle, takes
its target's step time at each width it runs (``SpecDecoder.time_steps``: the median of 10, at the traces'
typical context length; ``--step-stat min``: the fastest, as traces saved before had; ``--retime``: taken again
for saved traces, on another kernel build or phase), and replays, round by round, with those step times:

* plain: width-2 rounds with the decoder's free one-token guess (as the batch-invariant decoder runs them);
* prompt lookup at fixed k (the drafter and the decoder's rules: no draft -> plain round with its guess);
* auto's lookup policy (``AutoDrafter`` itself, without a draft model: only lookup and plain);
* the bound: the best any policy choosing how many of lookup's tokens to send each round could do (dynamic
  programming over the trace, knowing the future) — what no choice of draft length can beat with this matcher;
* with a draft model (a bundle that has one): the draft at a fixed k (``model:k``) and ``auto`` with every option
  (``auto+model``, the decoder's own policy). The traces then carry the draft's greedy token and its confidence
  at every position of the output, given the committed text before it (one draft step per position): a draft
  round proposes those while its drafts agree with the text, which is all greedy acceptance looks at (after its
  first miss, the confidences the gate sees are the ones the text would have given: an approximation). A round
  pays the draft's catch-up (full prefill chunks, then one step of the cheapest width that holds the rest, at the
  draft's measured step times; the prompt too: the draft starts cold) and its single draft steps. Cost-model state
  (the draft's acceptance, the runs learned) carries over from prompt to prompt in trace order, as in one decoder.

Plain rounds run at width 2 with the free guess where the bundle's target has no width-1 step (batch-invariant
steps), else at width 1 without one. Speeds are tokens over summed step times (host work and the prefill left
out), so ratios between rows are what the step costs and the acceptance make them, free of a shared machine's
noise; a real run (``spec-run bench``) says what the rest costs.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specedge.runtime.adaptive import AutoDrafter
from specedge.runtime.drafters import (
    EMPTY,
    Drafter,
    NoDrafter,
    PromptLookupDrafter,
    Proposal,
    feed_plan,
)
from specedge.runtime.manifest import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN
from specedge.runtime.policy import CostModel
from specedge.runtime.sampling import SamplingParams, top1_probability

PARAMS = SamplingParams(max_new_tokens=1 << 30)


def make_traces(bundle: str, suites: list[str], max_new: int, prompts: str | None = None,
                stat: str = "median") -> dict:
    from specedge.runtime import SpecDecoder
    from specedge.runtime.bench.suites import load_prompts, suite_prompts

    dec = SpecDecoder.load(bundle)
    rows = []
    for bp in load_prompts(prompts) if prompts else suite_prompts(suites):
        prompt, chat = bp.as_request()
        r = dec.generate(prompt, SamplingParams(max_new_tokens=max_new), drafter="none", chat=chat)
        row = {"id": bp.id, "prompt": dec.encode_prompt(prompt, chat), "output": r.token_ids}
        row["target_conf"] = target_confidences(dec, row["prompt"] + row["output"], len(row["prompt"]))
        if dec.draft_runner is not None:
            row["draft_next"], row["draft_conf"] = draft_choices(dec, row["prompt"] + row["output"], len(row["prompt"]))
        rows.append(row)
        print(f"  trace {bp.id}: {len(r.token_ids)} tokens", file=sys.stderr, flush=True)
    dp = dec.manifest.drafter_params
    out = {"bundle": bundle, "k": dec.manifest.k, "ngram": [dp.get("ngram_max", DEFAULT_NGRAM_MAX),
                                                           dp.get("ngram_min", DEFAULT_NGRAM_MIN)],
           "rows": rows, "max_new_tokens": max_new}
    return retime(out, dec, stat)


def retime(run: dict, dec, stat: str = "median") -> dict:  # noqa: ANN001
    """The traces ``run`` with step times taken now, with ``dec`` (their bundle) on this machine and kernel build:
    greedy output is the same on every build of the kernels (bitwise), so traces made once replay another build's
    (``SPECEDGE_KERNEL_MARCH``) or another phase's costs. At the traces' typical context length, 10 steps per width
    taken in turn; ``stat`` "median" (the default) keeps the typical step, what a live run pays; "min" the fastest.
    Built for Haswell on a shared Zen 5 VM, the fastest made a 5-token step 1.93x and 2.39x a 1-token one in two
    passes a second apart, the median 2.03x and 2.10x (a live run's cost model had learned 2.06x): a memory-bound
    step's fastest strays further from its typical time, and replayed at the fastest, the draft model did not pay on
    the JSON prompts where it ran 1.2-1.35x plain live."""
    from specedge.runtime import kernels
    from specedge.runtime.bench.runner import machine_info

    rows = run["rows"]
    past = int(np.mean([len(r["prompt"]) + len(r["output"]) // 2 for r in rows])) if rows else None
    timed = dec.time_steps(repeats=10, past_len=past, all_logits_only=True, roles=("target",), stat=stat)
    m = machine_info()
    out = {**run, "steps": {str(T): s for T, s in timed["target"].items() if T >= dec.target.min_width},
           "cpu": m["cpu"], "cpu_flags": m["cpu_flags"], "step_stat": stat, "kernel_build": kernels._march()}
    if dec.draft_runner is not None:  # every width the draft's catch-up may take (its prefill chunk too)
        draft = dec.time_steps(repeats=10, past_len=past, roles=("draft",), stat=stat)["draft"]
        out.update(draft_steps={str(T): s for T, s in draft.items()}, prefill_chunk=dec.manifest.prefill_chunk)
    return out


def target_confidences(dec, seq: list[int], n_prompt: int) -> list[float]:  # noqa: ANN001
    """The target's top-1 probability for each output token seq[n_prompt:], given the text before it: the sequence
    teacher-forced through the target's widest all-logits step (rows are the same at every width on a
    batch-invariant target; elsewhere close)."""
    runner = dec.target
    w = max(x.T for x in runner.entry.widths if x.L == x.T)
    conf: list[float] = []
    for a in range(0, len(seq) - 1, w):
        chunk = seq[a: min(a + w, len(seq) - 1)]
        p = top1_probability(np.asarray(runner.step(chunk, a, all_logits=True)).reshape(len(chunk), -1))
        conf += [float(p[i]) for i in range(len(chunk)) if a + i + 1 >= n_prompt]  # row i predicts seq[a + i + 1]
    return conf


def draft_choices(dec, seq: list[int], n_prompt: int) -> tuple[list[int], list[float]]:  # noqa: ANN001
    """The draft's greedy token and its top probability after seq[:n], for n = n_prompt + 1 .. len(seq) - 1: what
    a draft round starting at n proposes while its drafts agree with the text. One draft step per position (the
    decoder's own drafter, a one-token round each time)."""
    model = dec.make_drafter("model")
    greedy, rng = SamplingParams(max_new_tokens=1), np.random.default_rng(0)
    tokens = np.asarray(seq, dtype=np.int64)
    nxt, conf = [], []
    for n in range(n_prompt + 1, len(seq)):
        prop = model.propose(tokens[:n], 1, greedy, rng, keep=lambda c: True)
        nxt.append(int(prop.tokens[0]))
        conf.append(float(model.confidences[0]))
        model.commit(0)
    return nxt, conf


def accepted(draft: np.ndarray, future: list[int]) -> int:
    m = 0
    for d, f in zip(draft.tolist(), future):
        if d != f:
            break
        m += 1
    return m


def replay(make: Callable[[CostModel], Drafter], seq: list[int], n_prompt: int, steps: dict[int, float],
           k: int, ngram_max: int, costs: CostModel | None = None,
           model: ReplayModel | None = None, max_new: int | None = None,
           drift: Drift | None = None, target_conf: list[float] | None = None) -> tuple[float, int]:
    """Seconds of steps and rounds to decode seq[n_prompt + 1:] (the prefill gave seq[n_prompt]) with the drafter,
    under the decoder's rules: an empty proposal runs a plain round — at width 2 with the free guess (the decoder's
    own guesser) in its second row where the target has no width-1 step, else a width-1 step; a round commits the
    accepted tokens and the target's next. ``costs``: the cost model to decide with (default: a new one from
    ``steps``), fed every step's time as the decoder feeds it; ``model``: the replayed draft the drafter proposes
    with, whose catch-ups and draft steps count; ``max_new``: the request's max_new_tokens (what ``auto`` spreads a
    catch-up over; default: unbounded); ``drift``: the machine's speed changing under the run (``Drift``): the
    drafter observes (and times its pace by) the drifted seconds, and the seconds returned are still ``steps``'s,
    so that they score its decisions, not the luck of the phases it ran in. ``target_conf``: the target's top-1
    probability for each output token (the trace's ``target_conf``), passed to a drafter that asks for it as the
    decoder passes it (``observe_confidence``: the rows each round commits)."""
    costs = CostModel(dict(steps)) if costs is None else costs
    drafter = make(costs)
    drafter.reset()
    now = [0.0]
    if hasattr(drafter, "clock"):  # auto times the request's pace: by the replayed seconds, not the host's
        drafter.clock = lambda: now[0]
    if model is not None:
        model.drift, model.clock = drift, (lambda: now[0])
    guesser = PromptLookupDrafter(ngram_max, 1)
    guessing = min(steps) >= 2
    tokens = np.asarray(seq, dtype=np.int64)
    n, t, felt, rounds = n_prompt + 1, 0.0, 0.0, 0
    spent0, felt0 = (model.spent, model.felt) if model is not None else (0.0, 0.0)
    params = PARAMS if max_new is None else SamplingParams(max_new_tokens=max_new)
    while n < len(seq):
        prop = drafter.propose(tokens[:n], min(k, len(seq) - n - 1), params, None)
        guess = len(prop.tokens) == 0 and guessing
        draft = prop.tokens
        if guess:  # the decoder's free guess: lookup's first token, else the last token again
            draft = guesser.propose(tokens[:n], 1, PARAMS, None).tokens
            draft = draft if len(draft) else tokens[n - 1: n]
        m = accepted(draft, seq[n:])
        if guess:
            costs.observe_guess(m)
        drafter.commit(0 if guess else m)
        if target_conf is not None and getattr(drafter, "wants_confidence", lambda: False)():
            drafter.observe_confidence(target_conf[n - n_prompt: n - n_prompt + m + 1])
        nominal = width_time(steps, len(draft) + 1)
        seconds = nominal if drift is None else drift.felt(now[0], nominal)
        costs.observe_target(len(draft) + 1, seconds)
        t, felt = t + nominal, felt + seconds
        n += m + 1
        rounds += 1
        now[0] = felt + (model.felt - felt0 if model is not None else 0.0)
    return t + (model.spent - spent0 if model is not None else 0.0), rounds


def width_time(steps: dict[int, float], n: int) -> float:
    """Seconds of the step that n tokens run in (the smallest width that holds them)."""
    return steps[min(T for T in steps if T >= n)]


class Drift:
    """A shared machine's speed as it changes under a run: phases (exponential lengths, ``phase_s`` seconds on
    average) at a level drawn log-uniformly from [low, high], times a per-step jitter (log-normal, ``jitter``).
    The live cost model's per-width averages were seen drifting apart this way (a run ended with T=1 at 26.8 ms
    against T=2 at 24.5, whose fastest-of-10 are 21.6 and 22.1). Every width and the draft are scaled alike: a
    phase of a shared VM (a neighbour's memory traffic) slows them all. One seed gives one history, the same for
    every drafter replayed on a prompt."""

    def __init__(self, seed: int, phase_s: float = 2.0, low: float = 0.8, high: float = 1.25, jitter: float = 0.05):
        self.rng = np.random.default_rng(seed)
        self.phase_s, self.low, self.high, self.jitter = phase_s, low, high, jitter
        self.ends: list[float] = []
        self.levels: list[float] = []
        self.steps = np.random.default_rng(seed + 1_000_003)

    def level(self, t: float) -> float:
        while not self.ends or self.ends[-1] <= t:
            self.ends.append((self.ends[-1] if self.ends else 0.0) + float(self.rng.exponential(self.phase_s)))
            self.levels.append(float(np.exp(self.rng.uniform(np.log(self.low), np.log(self.high)))))
        return self.levels[int(np.searchsorted(self.ends, t, side="right"))]

    def felt(self, t: float, seconds: float) -> float:
        """What ``seconds`` of work starting at replayed time t takes on the drifting machine."""
        return seconds * self.level(t) * float(np.exp(self.steps.normal(0.0, self.jitter)))


class ReplayModel:
    """The draft model as a trace recorded it (``draft_choices``), behind ``ModelDrafter``'s interface: what
    ``AutoDrafter`` and a fixed ``model:k`` call. Its rows follow ModelDrafter's invariant; its seconds (``spent``)
    are the draft's measured step times: a catch-up of the committed tokens it has not seen (full prefill chunks,
    then the cheapest width that holds the rest, the first draw riding in that step) and one step per other draw."""

    name = "model"

    def __init__(self, nxt: list[int], conf: list[float], n_prompt: int, draft_steps: dict[int, float], chunk: int,
                 warm: bool = False):
        self.nxt, self.conf, self.first = nxt, conf, n_prompt + 1  # nxt[i]: the draft's token after seq[:first + i]
        self.warm = warm
        self.draft_steps, self.chunk = draft_steps, chunk
        # the draft's widths, as feed_plan reads them off a runner (every row's logits at every width: a catch-up's
        # last token may ride in any of them)
        self._runner = SimpleNamespace(entry=SimpleNamespace(widths=[SimpleNamespace(T=T, L=T) for T in draft_steps]),
                                       min_width=1, pads_into_cache=False, max_context=1 << 30)
        self.rows, self._base, self._k = 0, 0, 0
        self.spent = self.time_catch_up = 0.0  # seconds at the measured step times
        self.felt = 0.0  # the same under ``drift`` (what the drafter observes): set by ``replay``
        self.drift: Drift | None = None
        self.clock: Callable[[], float] = lambda: 0.0
        self.step_time: float | None = None
        self.dropped: tuple[int, float] | None = None
        self.last_was_stopper = False
        self.confidences: list[float] = []
        self.branches: list = []  # runner-ups: a trace has none

    def reset(self) -> None:
        # cold: the prompt is caught up in the first round that drafts; warm: the draft cache holds it already
        self.rows, self._k = (self.first - 1 if self.warm else 0), 0

    def _step(self, take: int) -> float:
        return min(s for T, s in self.draft_steps.items() if T >= take)

    def catchup_plan(self, n_tokens: int, tokens=None) -> list[int]:  # noqa: ANN001
        """The steps the decoder's draft would take (``feed_plan`` priced by its step times, as
        ``ModelDrafter.catchup_plan`` prices them by its ``StepClock``): full chunks, then the cheapest steps for the
        rest. Not the smallest width that holds the rest: where a wide step costs more a token than narrow ones (a
        41-token prompt as one 64-wide step of the Qwen 0.5B draft built for Haswell: 302 ms, against 233 ms for
        8 + 2 + 16 + 16), the decoder takes the cheaper plan, and so must its replay."""
        behind = n_tokens - 1 - self.rows
        if behind <= 0:
            return []
        return [take for take, _ in feed_plan(self._runner, behind + 1, self.rows, self.chunk,
                                              cost=self.draft_steps.get, last_any=True)]

    def propose(self, tokens, k, params, rng, keep=None, keep_last=None, branches=0) -> Proposal:  # noqa: ANN001
        # a trace records the draft's drawn tokens only, so a replayed round has no runner-ups: chains, never trees
        n = len(tokens)
        plan = self.catchup_plan(n) if k > 0 else []
        catchup = sum(self._step(take) for take in plan)
        self.spent += catchup
        catchup = self._felt(catchup)
        self.time_catch_up += catchup
        self.felt += catchup
        self.rows = max(self.rows, n - 1)
        self._base, self.confidences, self.dropped, self.last_was_stopper = n, [], None, False
        if k <= 0:
            self._k = 0
            return EMPTY
        draft, kept, steps = [], k, k
        for i in range(k):
            token, conf = self.nxt[n + i - self.first], self.conf[n + i - self.first]
            if keep is not None and not keep(conf) and i > 0:
                steps = i + 1
                if keep_last is not None and keep_last(conf, i + 1):
                    draft.append(token)
                    self.confidences.append(conf)
                    kept, self.last_was_stopper = i + 1, True
                else:
                    kept, self.dropped = i, (token, conf)
                break
            draft.append(token)
            self.confidences.append(conf)
        singles = steps - bool(plan)
        self.step_time = self._felt(self.draft_steps[1]) if singles else None
        self.spent += singles * self.draft_steps[1]
        self.felt += singles * (self.step_time or 0.0)
        self._k, self.rows = kept, n - 1 + kept
        return Proposal(np.array(draft, dtype=np.int64), None)

    def _felt(self, seconds: float) -> float:
        return seconds if self.drift is None or seconds == 0 else self.drift.felt(self.clock(), seconds)

    def commit(self, n_accepted: int) -> None:
        if self._k > 0:
            self.rows = self._base + min(n_accepted, self._k - 1)


class _FixedModel(NoDrafter):
    """The draft model at a fixed k (what ``--spec model:k`` runs)."""

    name = "model"

    def __init__(self, model: ReplayModel, k: int):
        self.model, self.k = model, k

    def reset(self) -> None:
        self.model.reset()

    def propose(self, tokens, k, params, rng):  # noqa: ANN001
        return self.model.propose(tokens, min(k, self.k), params, rng)

    def commit(self, n_accepted: int) -> None:
        self.model.commit(n_accepted)


def bound(seq: list[int], n_prompt: int, steps: dict[int, float], k: int, ngram_max: int, ngram_min: int) -> float:
    """Least seconds any per-round choice of lookup draft length (0: a plain round, at width 2 with its guess where
    the target has no width-1 step, else at width 1) can take."""
    look, guesser = PromptLookupDrafter(ngram_max, ngram_min), PromptLookupDrafter(ngram_max, 1)
    guessing = min(steps) >= 2
    tokens = np.asarray(seq, dtype=np.int64)
    N, start = len(seq), n_prompt + 1
    best = np.zeros(N + 1)
    for n in range(N - 1, start - 1, -1):
        if guessing:
            g = guesser.propose(tokens[:n], 1, PARAMS, None).tokens
            g = g if len(g) else tokens[n - 1: n]
            options = [width_time(steps, 2) + best[min(N, n + 1 + accepted(g, seq[n:]))]]
        else:
            options = [width_time(steps, 1) + best[n + 1]]
        cont = look.propose(tokens[:n], min(k, N - n - 1), PARAMS, None).tokens
        a = accepted(cont, seq[n:])
        options += [width_time(steps, j + 1) + best[min(N, n + 1 + min(j, a))]
                    for j in range(2 if guessing else 1, len(cont) + 1)]
        best[n] = min(options)
    return float(best[start])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--suite", default="code,edit,chat,summarize,json")
    ap.add_argument("--prompts", help="JSONL prompt file (as spec-run bench --prompts) instead of the suites")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--k", default="2,4,8", help="fixed lookup draft lengths to replay")
    ap.add_argument("--save-traces", help="write the traces and step times here (JSON)")
    ap.add_argument("--retime", metavar="BUNDLE", help="replay --traces with step times taken now with BUNDLE (the "
                    "traces' own) on this machine and kernel build (SPECEDGE_KERNEL_MARCH), not the saved ones")
    ap.add_argument("--step-stat", choices=("median", "min"), default="median",
                    help="step times taken here: the median of 10 per width (default: what a run pays) or the fastest")
    ap.add_argument("--traces", action="append", default=[], help="replay saved traces instead of running BUNDLE")
    ap.add_argument("--ngram-max", type=int, default=None,
                    help="replay with this matcher length instead of the bundle's (1..64)")
    ap.add_argument("--warm-draft", action="store_true",
                    help="the draft has seen each prompt when its request starts (a chat turn whose history the draft "
                    "cache holds; a benchmark that ran model:k on the same prompt first); default: cold")
    ap.add_argument("--model-k", type=int, default=4, help="the fixed draft length of the model:k row (traces of a "
                    "bundle with a draft model)")
    ap.add_argument("--drift", type=int, default=0, metavar="N",
                    help="replay auto under N histories of a machine whose speed changes (phases of a shared VM: "
                    "Drift) and score its decisions at the measured step times (the mean over the N); default 0: "
                    "a steady machine")
    ap.add_argument("--order", action="append", default=[], metavar="SUITES",
                    help="replay the traces' requests in this order of suites (comma-separated: code,json,...; a "
                    "suite's prompts keep their order, suites not named come last); repeat for several orders: "
                    "auto's cost model carries over from request to request, so what it learned on one kind of "
                    "request prices the next. Ends with every order's auto+model / best fixed per suite and their "
                    "geometric mean and lowest, then auto+model / plain per trace set and suite (the floor: 0.97)")
    a = ap.parse_args()
    if a.drift < 0:
        ap.error(f"--drift must be >= 0, got {a.drift}")
    if a.ngram_max is not None and not 1 <= a.ngram_max <= 64:
        ap.error(f"--ngram-max must be in 1..64, got {a.ngram_max}")
    if bool(a.bundle) == bool(a.traces):
        ap.error("give a BUNDLE or --traces FILE")
    if a.retime and not a.traces:
        ap.error("--retime re-times saved traces: give --traces FILE")
    runs = ([{**_read_traces(ap, f), "file": Path(f).name} for f in a.traces] if a.traces
            else [make_traces(a.bundle, a.suite.split(","), a.max_new_tokens, a.prompts, a.step_stat)])
    if a.retime:
        from specedge.runtime import SpecDecoder

        dec = SpecDecoder.load(a.retime)
        for run in runs:
            if run.get("k") != dec.manifest.k or ("draft_steps" in run) != (dec.draft_runner is not None):
                ap.error(f"--retime {a.retime}: not the bundle of the traces ({run.get('bundle')}: K={run.get('k')}, "
                         f"{'with' if 'draft_steps' in run else 'without'} a draft model)")
        runs = [retime(run, dec, a.step_stat) for run in runs]
    if a.save_traces:
        with open(a.save_traces, "w") as fh:
            json.dump({k: v for k, v in runs[0].items() if k != "file"}, fh)
    if a.order:
        suites = {row["id"].rsplit("-", 1)[0] for run in runs for row in run["rows"]}
        unknown = sorted({s.strip() for order in a.order for s in order.split(",") if s.strip()} - suites)
        if unknown:
            ap.error(f"--order names suites the traces do not have: {', '.join(unknown)} "
                     f"(they have {', '.join(sorted(suites))})")
        runs = [in_order(run, order) for order in a.order for run in runs]
    cells: list[tuple[str, str, float]] = []  # (run and order, suite, auto+model / the best fixed configuration)
    vs_plain: list[tuple[str, str, float]] = []  # (run, suite, auto+model's speed / plain's), every order
    ks = [int(x) for x in a.k.split(",")]
    for run in runs:
        steps = {int(T): s for T, s in run["steps"].items()}
        K, (nmax, nmin) = run["k"], run["ngram"]
        nmax = max(a.ngram_max, nmin) if a.ngram_max is not None else nmax
        ks_here = [k for k in ks if k <= K]
        flags = run["cpu_flags"] if isinstance(run["cpu_flags"], str) else " ".join(run["cpu_flags"])
        drafted = "draft_steps" in run and all("draft_next" in row for row in run["rows"])
        build = f"; kernels {run['kernel_build']}" if run.get("kernel_build") else ""
        print(f"\n## {run['bundle']} (K={K}; lookup n-grams {nmin}..{nmax}; CPU {run['cpu']}; flags {flags}{build})"
              + (f"; draft {'warm' if a.warm_draft else 'cold'} at each prompt" if drafted else ""))
        print(f"step ms ({run.get('step_stat', 'min')}): "
              + ", ".join(f"T={T} {s * 1e3:.1f}" for T, s in sorted(steps.items())))
        mk = min(a.model_k, K)
        histories = list(range(a.drift)) if a.drift else [None]
        if a.drift:
            print(f"auto under {a.drift} drifting-machine histories (Drift), scored at these step times")
        cols = ["plain", *[f"lookup:{k}" for k in ks_here], "auto", "bound"]
        if drafted:
            cols[-1:-1] = [f"model:{mk}", "auto+model"]
            draft_steps = {int(T): s for T, s in run["draft_steps"].items()}
            # one decoder's, per machine history
            carried = [CostModel(dict(steps), draft_steps[1], draft_widths=dict(draft_steps)) for _ in histories]
        print("\n| prompt | tokens | plain tok/s | " + " | ".join(c for c in cols[1:]) + " |")
        print("|---" * (len(cols) + 2) + "|")
        ratios: dict[str, list[float]] = {c: [] for c in cols[1:]}
        by_suite: dict[str, list[float]] = {}  # auto+model / the best fixed configuration, per prompt
        by_suite_plain: dict[str, list[float]] = {}  # auto+model / plain, per prompt
        makers: dict[str, Callable[[CostModel], Drafter]] = {"plain": lambda c: NoDrafter()}
        for k in ks_here:
            makers[f"lookup:{k}"] = functools.partial(lambda c, k: _Fixed(PromptLookupDrafter(nmax, nmin), k), k=k)
        makers["auto"] = lambda c: AutoDrafter(c, PromptLookupDrafter(nmax, nmin), None)
        for i, row in enumerate(run["rows"]):
            seq, P = row["prompt"] + row["output"], len(row["prompt"])
            gen = len(seq) - P - 1
            if gen < 2:
                continue
            mx = run.get("max_new_tokens")  # (older trace files: unbounded)
            drifts = [None if h is None else Drift(1000 * h + i) for h in histories]
            t = {name: replay(make, seq, P, steps, K, nmax, max_new=mx)[0] for name, make in makers.items()
                 if name != "auto"}  # (fixed configurations do not look at the clock)
            t["auto"] = float(np.mean([replay(makers["auto"], seq, P, steps, K, nmax, max_new=mx, drift=d)[0]
                                       for d in drifts]))
            t["bound"] = bound(seq, P, steps, K, nmax, nmin)
            if drafted:
                def model() -> ReplayModel:
                    return ReplayModel(row["draft_next"], row["draft_conf"], P, draft_steps, run["prefill_chunk"],
                                       a.warm_draft)
                m1 = model()
                t[f"model:{mk}"] = replay(lambda c: _FixedModel(m1, mk), seq, P, steps, K, nmax, model=m1,
                                          max_new=mx)[0]
                auto_model = []
                for d, c in zip(drifts, carried):
                    m2 = model()
                    auto_model.append(replay(lambda c: AutoDrafter(c, PromptLookupDrafter(nmax, nmin), m2), seq, P,
                                             steps, K, nmax, costs=c, model=m2, max_new=mx, drift=d,
                                             target_conf=row.get("target_conf"))[0])
                t["auto+model"] = float(np.mean(auto_model))
                fixed = min(t[c] for c in cols[1:] if c.startswith(("lookup:", "model:")))
                by_suite.setdefault(row["id"].rsplit("-", 1)[0], []).append(fixed / t["auto+model"])
                by_suite_plain.setdefault(row["id"].rsplit("-", 1)[0], []).append(t["plain"] / t["auto+model"])
            for c in cols[1:]:
                ratios[c].append(t["plain"] / t[c])
            print(f"| {row['id']} | {gen} | {gen / t['plain']:.1f} | "
                  + " | ".join(f"{t['plain'] / t[c]:.2f}x" for c in cols[1:]) + " |")
        if not ratios["bound"]:
            print("(no prompt generated two tokens or more: nothing to replay)")
            continue
        print("| mean / min | | | " + " | ".join(f"{np.mean(v):.3f} / {min(v):.2f}" for v in ratios.values()) + " |")
        if by_suite:
            print("\nauto+model / the best fixed configuration (geometric mean, min): " + ", ".join(
                f"{name} {np.exp(np.mean(np.log(v))):.3f} ({min(v):.2f})" for name, v in by_suite.items()))
            label = run.get("file", run["bundle"]) + (f" [{run['order']}]" if run.get("order") else "")
            cells += [(label, name, float(np.exp(np.mean(np.log(v))))) for name, v in by_suite.items()]
            vs_plain += [(run.get("file", run["bundle"]), name, float(np.exp(np.mean(np.log(v)))))
                         for name, v in by_suite_plain.items()]
    if a.order and cells:
        print("\n## auto+model / the best fixed configuration per suite, in every order replayed\n")
        for label in dict.fromkeys(c[0] for c in cells):
            print(f"- {label}: " + ", ".join(f"{s} {v:.3f}" for lb, s, v in cells if lb == label))
        vals = [v for _, _, v in cells]
        worst = min(cells, key=lambda c: c[2])
        print(f"\nover {len(vals)} (trace set, order, suite): geometric mean {np.exp(np.mean(np.log(vals))):.4f}, "
              f"{sum(v < 0.9 for v in vals)} below 0.9, lowest {worst[2]:.3f} ({worst[1]}, {worst[0]})")
        # the floor for auto is 0.97x plain decoding: per trace set and suite, over the orders
        print("\n## auto+model / plain per suite (geometric mean over the orders; lowest order)\n")
        for f in dict.fromkeys(c[0] for c in vs_plain):
            per = {s: [v for ff, ss, v in vs_plain if ff == f and ss == s] for _, s, _ in vs_plain}
            print(f"- {f}: " + ", ".join(f"{s} {np.exp(np.mean(np.log(v))):.3f} ({min(v):.2f})"
                                        for s, v in per.items() if v))
        low = [c for c in vs_plain if c[2] < 0.97]
        print(f"\n{len(low)} of {len(vs_plain)} (trace set, order, suite) below 0.97x plain")
    return 0


def in_order(run: dict, order: str) -> dict:
    """``run`` with its requests sorted by the suites of ``order`` (comma-separated; a suite's own prompts keep
    their order, suites not named come after)."""
    names = [s.strip() for s in order.split(",") if s.strip()]

    def rank(row: dict) -> int:  # (sorted is stable: a suite's prompts keep their order)
        suite = row["id"].rsplit("-", 1)[0]
        return names.index(suite) if suite in names else len(names)

    return {**run, "order": ",".join(names), "rows": sorted(run["rows"], key=rank)}


def _read_traces(ap: argparse.ArgumentParser, path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        ap.error(f"--traces {path}: not a readable trace file written by --save-traces ({e})")


class _Fixed(NoDrafter):
    """Prompt lookup at a fixed k (what ``--spec prompt-lookup:k`` runs)."""

    name = "prompt-lookup"

    def __init__(self, lookup: PromptLookupDrafter, k: int):
        self.lookup, self.k = lookup, k

    def propose(self, tokens, k, params, rng):  # noqa: ANN001
        return self.lookup.propose(tokens, min(k, self.k), params, rng)


if __name__ == "__main__":
    sys.exit(main())
