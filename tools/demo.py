"""The demo `make demo` runs: one prompt decoded plainly, with prompt-lookup speculation and with `auto`, on one
loaded decoder; shows that the text is the same token for token, the speedups and the statistics.

    python tools/demo.py BUNDLE "prompt" [--max-new-tokens 160] [--temperature 0] [--seed 1] [--repeats 3]

Each mode runs --repeats times, the modes interleaved (the order rotates every repeat), and the speed shown is the
median: on a shared 2-core machine one run of one mode can be 25 % off.

Exit 1 if any speculative text differs from the plain one (the product's promise is that it cannot).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from specedge.runtime import SamplingParams, SpecDecoder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("prompt")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    dec = SpecDecoder.load(a.bundle, verify="size")
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed)
    messages = [{"role": "user", "content": a.prompt}]
    dec.generate(messages, SamplingParams(max_new_tokens=8), drafter="none")  # warm-up (first-run allocations)
    modes = [("plain", "none", None), ("prompt lookup, k=4", "prompt-lookup", 4),
             ("auto (plain or lookup, chosen per round)", "auto", None)]
    all_runs: dict[str, list] = {label: [] for label, _, _ in modes}
    for r in range(max(1, a.repeats)):
        for label, drafter, k in modes[r % len(modes):] + modes[: r % len(modes)]:
            all_runs[label].append(dec.generate(messages, params, drafter=drafter, k=k))
    runs = {label: res[0] for label, res in all_runs.items()}
    tok_s = {label: statistics.median(x.stats.decode_tok_s for x in res) for label, res in all_runs.items()}
    plain = runs["plain"]
    print(f"--- {'greedy' if a.temperature == 0 else f'temperature {a.temperature}, seed {a.seed}'} output "
          f"({len(plain.token_ids)} tokens) ---")
    print(plain.text)
    print("---")
    ok = True
    print(f"decode speed: median of {max(1, a.repeats)} interleaved runs per mode")
    for label, res in runs.items():
        same = all(x.token_ids == plain.token_ids for x in all_runs[label])
        ok &= same
        speed = tok_s[label] / tok_s["plain"] if tok_s["plain"] else 0.0
        print(f"{label:42s} {tok_s[label]:6.1f} tok/s  {speed:4.2f}x plain  "
              f"{'identical to plain' if same else 'DIFFERS FROM PLAIN'}")
        print(f"    {res.stats}")
    print("speculative output == plain output, token for token" if ok else "MISMATCH: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
