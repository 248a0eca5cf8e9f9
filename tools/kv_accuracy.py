#!/usr/bin/env python3
"""How often a bundle's KV cache precision changes the target's next token: bundles of the same model and form
that differ in their KV dtype (say fp16 and int8 against fp32), over the built-in suites' prompts.

    python tools/kv_accuracy.py engines/qwen-kv32 engines/qwen-kv16 [engines/qwen-kv8 ...]
        [--suites code,edit,chat,summarize,json] [--per-suite 0] [--max-new-tokens 96]

For each prompt the reference bundle (the first) decodes greedily; then its target and each other bundle's take the
reference's whole sequence, prompt and answer, in prefill chunks, and the next token each predicts at every answer
position is compared (teacher forcing: a difference at one position does not carry into the next). Prints, per
other bundle, the agreement per suite and overall, how many of the differences fall where the reference's top two
logits lie within 1 of each other (near-ties), and the relative RMS of the logits' difference.
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


NEAR_TIE = 1.0  # a reference top-1 less than this many logits above its second: a near-tie


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference")
    ap.add_argument("other", nargs="+", help="one or more bundles compared with the reference, each on its own")
    ap.add_argument("--suites", default=",".join(SUITES))
    ap.add_argument("--per-suite", type=int, default=0, help="prompts of each suite (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    ref, others = SpecDecoder.load(a.reference), [SpecDecoder.load(o) for o in a.other]
    for d in (ref, *others):
        d.target.min_width = 1
    info = machine_info()
    print(f"Machine: {info['cpu']} ({info.get('cpu_flags', '')}); reference {a.reference} (KV "
          f"{ref.manifest.kv_dtype}), " + ", ".join(f"other {o} (KV {d.manifest.kv_dtype})"
                                                    for o, d in zip(a.other, others)))
    suites = a.suites.split(",")
    # per other bundle and suite: [prompts, positions, same, differing at a near-tie, squared error, squared norm]
    acc = [{s: [0, 0, 0, 0, 0.0, 0.0] for s in suites} for _ in others]
    for suite in suites:
        for p in suite_prompts([suite], a.per_suite):
            request, chat = p.as_request()
            prompt_ids = ref.encode_prompt(request, chat)
            r = ref.generate(request, SamplingParams(max_new_tokens=a.max_new_tokens), drafter="none", chat=chat)
            ids = prompt_ids + list(r.token_ids)
            x = answer_logits(ref, ids, len(prompt_ids) - 1)
            top2 = np.sort(x, axis=-1)[:, -2:]
            for o, dec in enumerate(others):
                y = answer_logits(dec, ids, len(prompt_ids) - 1)
                differ = x.argmax(-1) != y.argmax(-1)
                c = acc[o][suite]
                c[0] += 1
                c[1] += len(x)
                c[2] += int((~differ).sum())
                c[3] += int((differ & (top2[:, 1] - top2[:, 0] < NEAR_TIE)).sum())
                c[4] += float(((x - y) ** 2).sum())
                c[5] += float((x ** 2).sum())
    for name, dec, table in zip(a.other, others, acc):
        print(f"\n{name} (KV {dec.manifest.kv_dtype}) against {a.reference} (KV {ref.manifest.kv_dtype}):\n")
        print(f"| suite | prompts | answer positions | same next token | differing at a near-tie (< {NEAR_TIE:g}) | "
              "logits rel. RMS difference |")
        print("|---|---|---|---|---|---|")
        for suite, (k, n, same, tie, err, norm) in table.items():
            print(f"| {suite} | {k} | {n} | {same / n:.2%} | {tie} of {n - same} | {np.sqrt(err / norm):.2e} |")
        n, same, tie = (sum(c[i] for c in table.values()) for i in (1, 2, 3))
        print(f"| all | | {n} | {same / n:.2%} | {tie} of {n - same} | |", flush=True)
        dec.close()
    ref.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
