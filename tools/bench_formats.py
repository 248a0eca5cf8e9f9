"""Plain (and optionally speculative) decode speed of several bundles of one model, interleaved in one run.

    python tools/bench_formats.py engines/smollm2 engines/smollm2-int8 [engines/smollm2:width1] [--drafter none]
        [--repeats 2] [--per-suite 1] [--max-new-tokens 96] [--no-invariant]

Every bundle decodes the same suite prompts round-robin (bundle order rotated each repeat), greedy, so the
machine's state is shared fairly; prints decode tok/s (median over prompts x repeats) per bundle, relative to
the first one, with the CPU flags. Use it to compare weight formats (int4 exact GGUF blocks vs re-quantized,
int8, fp32) with the same decoding path.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench import suite_prompts
from specedge.runtime.bench.runner import machine_info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--drafter", default="none")
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--per-suite", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--no-invariant", action="store_true")
    a = ap.parse_args()
    info = machine_info()
    print(f"machine: {info}")
    # BUNDLE:width1 loads that bundle with width-1 plain steps (invariant=False) beside its default form
    decs = {b: SpecDecoder.load(b.removesuffix(":width1"), verify="size",
                                invariant=not (a.no_invariant or b.endswith(":width1"))) for b in a.bundles}
    prompts = suite_prompts(["code", "edit", "chat", "summarize", "json"], a.per_suite)
    params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
    for dec in decs.values():  # warm-up
        dec.generate("hello", SamplingParams(max_new_tokens=4), drafter=a.drafter, k=a.k)
    speeds: dict[str, list[float]] = {b: [] for b in decs}
    order = list(decs)
    for r in range(a.repeats):
        for p in prompts:
            msgs = [{"role": "user", "content": p.prompt}] if isinstance(p.prompt, str) else list(p.prompt)
            for b in order[r % len(order):] + order[: r % len(order)]:
                speeds[b].append(decs[b].generate(msgs, params, drafter=a.drafter, k=a.k).stats.decode_tok_s)
    base = statistics.median(speeds[order[0]])
    print(f"drafter={a.drafter} k={a.k} max_new_tokens={a.max_new_tokens} prompts={len(prompts)} x {a.repeats}")
    for b in order:
        med = statistics.median(speeds[b])
        print(f"{b:48s} {med:7.1f} tok/s (min {min(speeds[b]):.1f}, max {max(speeds[b]):.1f})  {med / base:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
