#!/usr/bin/env python3
"""How far int8/int4 bundles move the target's logits from an fp32 bundle of the same model.

    python tools/quant_accuracy.py engines/smollm2 engines/smollm2-int4 engines/smollm2-int8 --max-new-tokens 64

For each built-in suite prompt the fp32 (first) bundle generates a greedy continuation; every
bundle then scores the same prompt + continuation teacher-forced (verify-width steps, all
logits), and the report gives, per candidate: top-1 agreement with fp32 over the generated
positions (how often a greedy step would pick a different token), max and mean |Δlogit|
relative to the fp32 logit range, and the mean KL(p_fp32 || p_candidate). Also the greedy
generation of each candidate and the position of its first divergence from fp32.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench import suite_prompts


def teacher_forced_logits(dec: SpecDecoder, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), V] for every position, fed in the widest all-logits width."""
    W = max(w.T for w in dec.manifest.target.widths if w.L == w.T)
    out = []
    for i in range(0, len(ids), W):
        chunk = np.array(ids[i: i + W])
        out.append(np.array(dec.target.step(chunk, i, all_logits=True)))
    return np.concatenate(out)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reference", help="fp32 bundle")
    ap.add_argument("candidates", nargs="+")
    ap.add_argument("--suite", default="code,edit,chat,summarize,json")
    ap.add_argument("--per-suite", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    prompts = suite_prompts(a.suite.split(","), a.per_suite)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    ref = SpecDecoder.load(a.reference, verify="size")
    cases = []
    for p in prompts:
        text, chat = p.as_request()
        ids = ref.encode_prompt(text, chat)
        gen = ref.generate(text, params, drafter="none", chat=chat).token_ids
        cases.append((p, ids, gen, teacher_forced_logits(ref, ids + gen)[len(ids) - 1: -1]))
    ref.close()
    rows = []
    for path in a.candidates:
        dec = SpecDecoder.load(path, verify="size")
        agree = total = 0
        rel_max, rel_sum, kl_sum, diverge = 0.0, 0.0, 0.0, []
        for p, ids, gen, ref_logits in cases:
            text, chat = p.as_request()
            lg = teacher_forced_logits(dec, ids + gen)[len(ids) - 1: -1]  # predictions for the generated positions
            rng = (ref_logits.max(-1) - ref_logits.min(-1))[:, None]
            rel = np.abs(lg - ref_logits) / rng
            rel_max, rel_sum = max(rel_max, float(rel.max())), rel_sum + float(rel.mean(-1).sum())
            lp, lq = log_softmax(ref_logits), log_softmax(lg)
            kl_sum += float((np.exp(lp) * (lp - lq)).sum(-1).sum())
            agree += int((lg.argmax(-1) == ref_logits.argmax(-1)).sum())
            total += len(gen)
            own = dec.generate(text, params, drafter="none", chat=chat).token_ids
            diverge.append(next((i for i, (x, y) in enumerate(zip(own, gen)) if x != y), min(len(own), len(gen))))
        m = dec.manifest.target
        rows.append({"bundle": path, "precision": m.precision, "quant": m.quant, "kv_mode": dec.manifest.kv_mode,
                     "positions": total, "top1_agreement": agree / total, "max_rel_logit_err": rel_max,
                     "mean_rel_logit_err": rel_sum / total, "mean_kl": kl_sum / total,
                     "first_divergence": diverge})
        dec.close()
    print(f"reference {a.reference}; {len(cases)} prompts, {a.max_new_tokens} greedy tokens each\n")
    print("| bundle | weights | lm_head | top-1 agreement | mean / max rel. logit error | mean KL | "
          "greedy output identical to fp32 up to token |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        q = r["quant"]
        print(f"| `{r['bundle']}` | {r['precision']}{' b' + str(q['block']) if q else ''} | "
              f"{q.get('lm_head', 'fp32') if q else 'fp32'} | {r['top1_agreement']:.1%} | "
              f"{r['mean_rel_logit_err']:.4f} / {r['max_rel_logit_err']:.3f} | {r['mean_kl']:.4f} | "
              f"{r['first_divergence']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
