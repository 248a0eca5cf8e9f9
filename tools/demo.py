"""The demo `make demo` runs: one prompt decoded plainly, with prompt-lookup speculation and with `auto`, on one
loaded decoder; shows that the text is the same token for token, the speedups and the statistics.

    python tools/demo.py BUNDLE "prompt" [--max-new-tokens 160] [--temperature 0] [--seed 1]

Exit 1 if any speculative text differs from the plain one (the product's promise is that it cannot).
"""

from __future__ import annotations

import argparse
import sys

from specedge.runtime import SamplingParams, SpecDecoder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("prompt")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    dec = SpecDecoder.load(a.bundle, verify="size")
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed)
    messages = [{"role": "user", "content": a.prompt}]
    dec.generate(messages, SamplingParams(max_new_tokens=8), drafter="none")  # warm-up (first-run allocations)
    runs = {}
    for label, drafter, k in (("plain", "none", None), ("prompt lookup, k=4", "prompt-lookup", 4),
                              ("auto (plain or lookup, chosen per round)", "auto", None)):
        runs[label] = dec.generate(messages, params, drafter=drafter, k=k)
    plain = runs["plain"]
    print(f"--- {'greedy' if a.temperature == 0 else f'temperature {a.temperature}, seed {a.seed}'} output "
          f"({len(plain.token_ids)} tokens) ---")
    print(plain.text)
    print("---")
    ok = True
    for label, res in runs.items():
        same = res.token_ids == plain.token_ids
        ok &= same
        speed = res.stats.decode_tok_s / plain.stats.decode_tok_s if plain.stats.decode_tok_s else 0.0
        print(f"{label:42s} {res.stats.decode_tok_s:6.1f} tok/s  {speed:4.2f}x plain  "
              f"{'identical to plain' if same else 'DIFFERS FROM PLAIN'}")
        print(f"    {res.stats}")
    print("speculative output == plain output, token for token" if ok else "MISMATCH: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
