"""Held-out exactness check: speculative text == plain text, token for token, on every built-in suite prompt.

    python tools/exactness_check.py engines/smollm2-int4 [more bundles] [--k 2,4,8] [--drafters lookup,model,auto]
        [--max-new-tokens 64] [--per-suite 0] [--temperature 0] [--seed 7] [--no-invariant]

Greedy (temperature 0) compares every drafter and k with plain decoding; with --temperature > 0 and a seed it
checks that the seed fixes the text whatever the drafter (plain, each drafter, and 5 repeated auto requests).
Prints one line per configuration and a summary count; exit 1 if anything differs.
"""

from __future__ import annotations

import argparse
import sys

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench.suites import suite_prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--k", default="2,4,8")
    ap.add_argument("--drafters", default="prompt-lookup,model,hybrid,auto")
    ap.add_argument("--suites", default="code,edit,chat,summarize,json")
    ap.add_argument("--per-suite", type=int, default=0, help="prompts per suite (0 = all)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-invariant", action="store_true", help="allow width-1 plain steps (the old behaviour)")
    a = ap.parse_args()
    ks = [int(x) for x in a.k.split(",")]
    same = total = 0
    for b in a.bundles:
        dec = SpecDecoder.load(b, verify="size", invariant=not a.no_invariant)
        drafters = [d for d in a.drafters.split(",") if d not in ("model", "hybrid") or dec.draft_runner is not None]
        params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                seed=a.seed if a.temperature > 0 else None)
        for p in suite_prompts(a.suites.split(","), a.per_suite):
            if dec.manifest.tokenizer.chat_template:
                prompt = [{"role": "user", "content": p.prompt}] if isinstance(p.prompt, str) else list(p.prompt)
            else:  # a base model's file: the text as it is
                prompt = p.as_request(False)[0]
            ref = dec.generate(prompt, params, drafter="none").token_ids
            runs = [(d, k) for d in drafters for k in ks if k <= dec.manifest.k]
            if a.temperature > 0:
                runs += [("auto", dec.manifest.k)] * 4  # 5 auto requests in all: the seed must fix each
            for d, k in runs:
                got = dec.generate(prompt, params, drafter=d, k=k).token_ids
                ok = got == ref
                same += ok
                total += 1
                if not ok:
                    first = next((i for i, (x, y) in enumerate(zip(got, ref)) if x != y), min(len(got), len(ref)))
                    print(f"DIFF {b} {p.id} drafter={d} k={k}: first difference at token {first}", flush=True)
        print(f"{b}: {same}/{total} identical to plain so far", flush=True)
    print(f"identical to plain: {same}/{total}")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
