#!/usr/bin/env python3
"""Plain vs speculative decoding on one bundle, measured in one run on this machine.

    python tools/bench.py engines/qwen-coder --k 2,4,6,8 --drafters none,model,prompt-lookup --max-new 64

Every configuration runs the same prompts; the plain baseline (drafter none) is measured in the
same run, interleaved per prompt after a warm-up. Reports decode tok/s (median over prompts and
repeats), speedup over plain, acceptance, mean accepted tokens per round, and the draft / verify /
host time split, plus the machine (CPU, cores, measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from specedge.runtime import SamplingParams, SpecDecoder

SUITES = {
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
        "Write a Python class Stack with push, pop, peek and is_empty methods.",
    ],
    "edit": [
        "Rename the variable `tmp` to `total` in this code and return the full code:\n```python\n"
        "def add_all(xs):\n    tmp = 0\n    for x in xs:\n        tmp = tmp + x\n    return tmp\n\n"
        "def mean(xs):\n    tmp = add_all(xs)\n    return tmp / len(xs)\n```",
    ],
    "chat": [
        "Explain in a short paragraph why the sky is blue.",
        "Give three tips for writing readable code.",
    ],
}


def bandwidth_gbs(mb: int = 512) -> float:
    a = np.ones(mb * 1024 * 1024 // 8)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t) / 1e9)  # read + write
    return best


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--k", default="2,4,6,8")
    ap.add_argument("--drafters", default="none,model,prompt-lookup")
    ap.add_argument("--suites", default="code,edit,chat")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--per-suite", type=int, default=0, help="use only the first N prompts of each suite")
    ap.add_argument("--json", default=None, help="also write raw results here")
    a = ap.parse_args()

    dec = SpecDecoder.load(a.bundle, verify="size")
    K = dec.manifest.k
    ks = [k for k in map(int, a.k.split(",")) if k <= K]
    drafters = [d for d in a.drafters.split(",") if d != "model" or dec.manifest.draft is not None]
    configs = [("none", 0)] + [(d, k) for d in drafters if d != "none" for k in ks]
    params = SamplingParams(max_new_tokens=a.max_new, ignore_eos=True)
    dec.generate("warm up", SamplingParams(max_new_tokens=8), drafter="none")
    results: dict[tuple[str, str, int], list[dict]] = {}
    for suite in a.suites.split(","):
        for prompt in SUITES[suite][: a.per_suite or None]:
            for _ in range(a.repeats):
                for drafter, k in configs:  # interleaved: every config on the same prompt back to back
                    r = dec.generate([{"role": "user", "content": prompt}], params, drafter=drafter, k=k)
                    results.setdefault((suite, drafter, k), []).append(r.stats.as_dict())
                    print(f"{suite:5} {drafter:13} k={k} {r.stats.decode_tok_s:6.1f} tok/s "
                          f"acc={r.stats.acceptance_rate:.2f}", flush=True)
    m = dec.manifest
    print(f"\nmachine: {cpu_name()}, {os.cpu_count()} cpus, copy bandwidth {bandwidth_gbs():.1f} GB/s; "
          f"backend {dec.backend}; target {m.target.family} {m.target.dims.n_layers}L/{m.target.dims.hidden}"
          f"{'; draft ' + m.draft.family + ' ' + str(m.draft.dims.n_layers) + 'L/' + str(m.draft.dims.hidden) if m.draft else ''}"
          f"; fp32; greedy; {a.max_new} new tokens; bundle K={K}\n")
    print("| suite | drafter | K | decode tok/s | speedup vs plain | acceptance | accepted/round | draft / verify / host s |")
    print("|---|---|---|---|---|---|---|---|")
    for suite in a.suites.split(","):
        base = statistics.median(s["decode_tok_s"] for s in results[(suite, "none", 0)])
        for drafter, k in configs:
            rs = results[(suite, drafter, k)]
            tps = statistics.median(s["decode_tok_s"] for s in rs)
            split = " / ".join(f"{statistics.median(x[f] for x in rs):.2f}" for f in ("time_draft_s", "time_verify_s", "time_host_s"))
            print(f"| {suite} | {drafter} | {k} | {tps:.1f} | {tps / base:.2f}x | "
                  f"{statistics.median(s['acceptance_rate'] for s in rs):.2f} | "
                  f"{statistics.median(s['mean_accepted_per_round'] for s in rs):.2f} | {split} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{s}|{d}|{k}": v for (s, d, k), v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
