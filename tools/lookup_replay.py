#!/usr/bin/env python3
"""What prompt lookup can buy on a bundle and its prompts: drafters replayed over greedy traces, without timing noise.

    python tools/lookup_replay.py BUNDLE [--suite code,edit,... | --prompts FILE.jsonl] [--max-new-tokens 192]
                                  [--save-traces F]
    python tools/lookup_replay.py --traces F [--traces G ...]        # replay saved traces again (no model run)

Greedy output does not depend on the drafter (speculative = plain, bitwise), so one plain generation per prompt
fixes what every drafter's tokens would be checked against. This tool makes those traces with the bundle, takes
its target's step time at each width it runs (``SpecDecoder.time_steps``: the fastest of 10, at the traces'
typical context length), and replays, round by round, with those step times:

* plain: width-2 rounds with the decoder's free one-token guess (as the batch-invariant decoder runs them);
* prompt lookup at fixed k (the drafter and the decoder's rules: no draft -> plain round with its guess);
* auto's lookup policy (``AutoDrafter`` itself, without a draft model: only lookup and plain);
* the bound: the best any policy choosing how many of lookup's tokens to send each round could do (dynamic
  programming over the trace, knowing the future) — what no choice of draft length can beat with this matcher.

Speeds are tokens over summed step times (host work and the prefill left out), so ratios between rows are what
the step costs and the acceptance make them, free of a shared machine's noise; a real run (``spec-run bench``)
says what the rest costs. Draft-model rounds are not replayed (they need the draft's own outputs).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Callable

import numpy as np

from specedge.runtime.adaptive import AutoDrafter, CostModel
from specedge.runtime.drafters import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, Drafter, NoDrafter, PromptLookupDrafter
from specedge.runtime.sampling import SamplingParams

PARAMS = SamplingParams(max_new_tokens=1 << 30)


def make_traces(bundle: str, suites: list[str], max_new: int, prompts: str | None = None) -> dict:
    from specedge.runtime import SpecDecoder
    from specedge.runtime.bench.runner import machine_info
    from specedge.runtime.bench.suites import load_prompts, suite_prompts

    dec = SpecDecoder.load(bundle)
    rows = []
    for bp in load_prompts(prompts) if prompts else suite_prompts(suites):
        prompt, chat = bp.as_request()
        r = dec.generate(prompt, SamplingParams(max_new_tokens=max_new), drafter="none", chat=chat)
        rows.append({"id": bp.id, "prompt": dec.encode_prompt(prompt, chat), "output": r.token_ids})
        print(f"  trace {bp.id}: {len(r.token_ids)} tokens", file=sys.stderr, flush=True)
    # at the traces' typical context length; the fastest of 10 (a single busy moment doubled a 10 ms step)
    past = int(np.mean([len(r["prompt"]) + len(r["output"]) // 2 for r in rows]))
    steps = dec.time_steps(repeats=10, past_len=past, all_logits_only=True)["target"]
    steps = {T: s for T, s in steps.items() if T >= dec.target.min_width}
    m = machine_info()
    dp = dec.manifest.drafter_params
    return {"bundle": bundle, "k": dec.manifest.k, "ngram": [dp.get("ngram_max", DEFAULT_NGRAM_MAX),
                                                            dp.get("ngram_min", DEFAULT_NGRAM_MIN)],
            "steps": {str(T): s for T, s in steps.items()}, "cpu": m["cpu"], "cpu_flags": m["cpu_flags"], "rows": rows}


def accepted(draft: np.ndarray, future: list[int]) -> int:
    m = 0
    for d, f in zip(draft.tolist(), future):
        if d != f:
            break
        m += 1
    return m


def replay(make: Callable[[CostModel], Drafter], seq: list[int], n_prompt: int, steps: dict[int, float],
           k: int, ngram_max: int) -> tuple[float, int]:
    """Seconds of target steps and rounds to decode seq[n_prompt + 1:] (the prefill gave seq[n_prompt]) with the
    drafter, under the (batch-invariant) decoder's rules: an empty proposal runs a plain width-2 round whose second row checks
    the free guess (the decoder's own guesser); a round commits the accepted tokens and the target's next."""
    costs = CostModel(dict(steps))
    drafter = make(costs)
    drafter.reset()
    guesser = PromptLookupDrafter(ngram_max, 1)
    tokens = np.asarray(seq, dtype=np.int64)
    n, t, rounds = n_prompt + 1, 0.0, 0
    while n < len(seq):
        prop = drafter.propose(tokens[:n], min(k, len(seq) - n - 1), PARAMS, None)
        guess = len(prop.tokens) == 0
        draft = prop.tokens
        if guess:  # the decoder's free guess: lookup's first token, else the last token again
            draft = guesser.propose(tokens[:n], 1, PARAMS, None).tokens
            draft = draft if len(draft) else tokens[n - 1: n]
        m = accepted(draft, seq[n:])
        if guess:
            costs.observe_guess(m)
        drafter.commit(0 if guess else m)
        t += costs.verify_time(len(draft) + 1)
        n += m + 1
        rounds += 1
    return t, rounds


def bound(seq: list[int], n_prompt: int, steps: dict[int, float], k: int, ngram_max: int, ngram_min: int) -> float:
    """Least seconds any per-round choice of lookup draft length (0: plain round with its guess) can take."""
    costs = CostModel(dict(steps))
    look, guesser = PromptLookupDrafter(ngram_max, ngram_min), PromptLookupDrafter(ngram_max, 1)
    tokens = np.asarray(seq, dtype=np.int64)
    N, start = len(seq), n_prompt + 1
    best = np.zeros(N + 1)
    for n in range(N - 1, start - 1, -1):
        g = guesser.propose(tokens[:n], 1, PARAMS, None).tokens
        g = g if len(g) else tokens[n - 1: n]
        options = [costs.verify_time(2) + best[min(N, n + 1 + accepted(g, seq[n:]))]]
        cont = look.propose(tokens[:n], min(k, N - n - 1), PARAMS, None).tokens
        a = accepted(cont, seq[n:])
        options += [costs.verify_time(j + 1) + best[min(N, n + 1 + min(j, a))] for j in range(2, len(cont) + 1)]
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
    ap.add_argument("--traces", action="append", default=[], help="replay saved traces instead of running BUNDLE")
    ap.add_argument("--ngram-max", type=int, default=None,
                    help="replay with this matcher length instead of the bundle's (1..64)")
    a = ap.parse_args()
    if a.ngram_max is not None and not 1 <= a.ngram_max <= 64:
        ap.error(f"--ngram-max must be in 1..64, got {a.ngram_max}")
    if bool(a.bundle) == bool(a.traces):
        ap.error("give a BUNDLE or --traces FILE")
    runs = ([_read_traces(ap, f) for f in a.traces] if a.traces
            else [make_traces(a.bundle, a.suite.split(","), a.max_new_tokens, a.prompts)])
    if a.save_traces:
        with open(a.save_traces, "w") as fh:
            json.dump(runs[0], fh)
    ks = [int(x) for x in a.k.split(",")]
    for run in runs:
        steps = {int(T): s for T, s in run["steps"].items()}
        K, (nmax, nmin) = run["k"], run["ngram"]
        nmax = max(a.ngram_max, nmin) if a.ngram_max is not None else nmax
        ks_here = [k for k in ks if k <= K]
        flags = run["cpu_flags"] if isinstance(run["cpu_flags"], str) else " ".join(run["cpu_flags"])
        print(f"\n## {run['bundle']} (K={K}; lookup n-grams {nmin}..{nmax}; CPU {run['cpu']}; flags {flags})")
        print("step ms: " + ", ".join(f"T={T} {s * 1e3:.1f}" for T, s in sorted(steps.items())))
        cols = ["plain", *[f"lookup:{k}" for k in ks_here], "auto", "bound"]
        print("\n| prompt | tokens | plain tok/s | " + " | ".join(c for c in cols[1:]) + " |")
        print("|---" * (len(cols) + 2) + "|")
        ratios: dict[str, list[float]] = {c: [] for c in cols[1:]}
        makers: dict[str, Callable[[CostModel], Drafter]] = {"plain": lambda c: NoDrafter()}
        for k in ks_here:
            makers[f"lookup:{k}"] = functools.partial(lambda c, k: _Fixed(PromptLookupDrafter(nmax, nmin), k), k=k)
        makers["auto"] = lambda c: AutoDrafter(c, PromptLookupDrafter(nmax, nmin), None)
        for row in run["rows"]:
            seq, P = row["prompt"] + row["output"], len(row["prompt"])
            gen = len(seq) - P - 1
            if gen < 2:
                continue
            t = {name: replay(mk, seq, P, steps, K, nmax)[0] for name, mk in makers.items()}
            t["bound"] = bound(seq, P, steps, K, nmax, nmin)
            for c in cols[1:]:
                ratios[c].append(t["plain"] / t[c])
            print(f"| {row['id']} | {gen} | {gen / t['plain']:.1f} | "
                  + " | ".join(f"{t['plain'] / t[c]:.2f}x" for c in cols[1:]) + " |")
        if not ratios["bound"]:
            print("(no prompt generated two tokens or more: nothing to replay)")
            continue
        print("| mean / min | | | " + " | ".join(f"{np.mean(v):.3f} / {min(v):.2f}" for v in ratios.values()) + " |")
    return 0


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
