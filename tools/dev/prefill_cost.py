#!/usr/bin/env python3
"""What a prompt's prefill costs when its last step computes its last row's logits alone, against every row's.

    python tools/dev/prefill_cost.py BUNDLE [--suite chat,code,edit,summarize,json] [--per-suite 2] [--repeats 3]
                                     [--threads 2]

On the CPU a width that computes every row's logits also runs with its last row's alone (``OrtRunner._lone``), and
a target whose kernels compute a lone row exactly chunks a prompt by fixed prices and feeds its last step that way
(``feed_plan``'s ``lone_last``). Here each prompt's whole prefill (no cached prefix) is timed both ways in one
process, back to back, the order swapped every prompt: "lone" as the decoder runs it, "every row" as a target
whose lone rows are not exact must run it (``lone_last`` off: the rest in an all-logits width). Reported per
prompt: its tokens, the fastest of ``--repeats`` of each, their ratio, whether the first token is the same; then the
median ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime import decoder as decoder_module
from specedge.runtime.bench import suite_prompts
from specedge.runtime.drafters import feed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--suite", default="chat,code,edit,summarize,json")
    ap.add_argument("--per-suite", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    dec = SpecDecoder.load(a.bundle, threads=a.threads)
    target = dec.target
    lone = target._picks[False]  # the widths a last-row step picks from, lone twins included
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)

    def every_row_feed(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        return feed(*args, **{**kw, "lone_last": False})

    def prefill(use_lone: bool, p) -> tuple[float, list[int]]:  # noqa: ANN001
        target._picks[False] = lone if use_lone else target._picks[True]
        decoder_module.feed = feed if use_lone else every_row_feed
        best, ids = float("inf"), []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            out = dec.generate(p.prompt, params, drafter="none", reuse_prefix=False, chat=not p.raw)
            best, ids = min(best, time.perf_counter() - t0), out.token_ids
        return best, ids

    ratios = []
    print("| prompt | tokens | every row ms | lone ms | lone / every row | first token the same |")
    print("|---|---|---|---|---|---|")
    for i, p in enumerate(suite_prompts(a.suite.split(","), a.per_suite)):
        order = (True, False) if i % 2 else (False, True)
        got = {use: prefill(use, p) for use in order}
        ratio = got[True][0] / got[False][0]
        ratios.append(ratio)
        n = len(dec.encode_prompt(p.prompt, chat=not p.raw))
        print(f"| {p.suite}-{p.id} | {n} | {got[False][0] * 1e3:.0f} | {got[True][0] * 1e3:.0f} | {ratio:.2f} | "
              f"{'yes' if got[True][1] == got[False][1] else 'NO'} |")
    target._picks[False], decoder_module.feed = lone, feed
    print(f"\nmedian lone / every row: {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
