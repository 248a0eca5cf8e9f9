#!/usr/bin/env python3
"""How often a bundle's KV cache precision changes the target's next token: two bundles of the same model and form
that differ in their KV dtype (say fp16 against fp32), over the built-in suites' prompts.

    python tools/kv_accuracy.py engines/qwen-kv32 engines/qwen32k [--suites code,edit,chat,summarize,json]
        [--per-suite 0] [--max-new-tokens 96]

For each prompt the reference bundle (the first) decodes greedily; then both bundles' targets take the reference's
whole sequence, prompt and answer, in prefill chunks, and the next token each predicts at every answer position is
compared (teacher forcing: a difference at one position does not carry into the next). Prints the agreement per
suite and overall, and the relative RMS of the logits' difference.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench.runner import machine_info
from specedge.runtime.bench.suites import SUITES, suite_prompts


def answer_logits(dec: SpecDecoder, ids: list[int], start: int) -> np.ndarray:
    """The target's logits predicting tokens start+1 .. len(ids)-1 (rows start .. len-2), fed in its widest
    all-logits steps."""
    t = dec.target
    width = max(w.T for w in dec.manifest.target.widths if w.T == w.L)
    rows, pos = [], 0
    while pos < len(ids) - 1:
        n = min(width, len(ids) - 1 - pos)
        out = np.array(t.step(np.array(ids[pos: pos + n]), pos, all_logits=True))[:n]
        rows.append(out)
        pos += n
    return np.concatenate(rows)[start:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--per-suite", type=int, default=0, help="prompts of each suite (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    ref, other = SpecDecoder.load(a.reference), SpecDecoder.load(a.other)
    for d in (ref, other):
        d.target.min_width = 1
    info = machine_info()
    print(f"Machine: {info['cpu']} ({info.get('cpu_flags', '')}); reference {a.reference} (KV "
          f"{ref.manifest.kv_dtype}), other {a.other} (KV {other.manifest.kv_dtype})")
    print("\n| suite | prompts | answer positions | same next token | logits rel. RMS difference |")
    print("|---|---|---|---|---|")
    total_same = total = 0
    for suite in a.suites.split(","):
        same = n = 0
        err, norm = 0.0, 0.0
        prompts = suite_prompts([suite], a.per_suite)
        for p in prompts:
            request, chat = p.as_request()
            prompt_ids = ref.encode_prompt(request, chat)
            r = ref.generate(request, SamplingParams(max_new_tokens=a.max_new_tokens), drafter="none", chat=chat)
            ids = prompt_ids + list(r.token_ids)
            x, y = answer_logits(ref, ids, len(prompt_ids) - 1), answer_logits(other, ids, len(prompt_ids) - 1)
            same += int((x.argmax(-1) == y.argmax(-1)).sum())
            n += len(x)
            err += float(((x - y) ** 2).sum())
            norm += float((x ** 2).sum())
        total_same, total = total_same + same, total + n
        print(f"| {suite} | {len(prompts)} | {n} | {same / n:.2%} | {np.sqrt(err / norm):.2e} |", flush=True)
    print(f"| all | | {total} | {total_same / total:.2%} | |")
    ref.close()
    other.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
