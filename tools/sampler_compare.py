"""Position-keyed vs classic (min(1, p/q)) speculative sampling: acceptance and speed, same prompts, one run.

    python tools/sampler_compare.py BUNDLE [--drafter model] [--k 4] [--temperature 0.7] [--per-suite 1]
        [--max-new-tokens 64] [--seeds 2]

For each suite prompt and seed the two samplers run back to back (order alternating), with the same drafter and
k; reports the acceptance rate (accepted / drafted) and the median decode tok/s of each, and checks that the keyed
text equals plain keyed decoding with the same seed (the reproducibility the keyed rule exists for).
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
    ap.add_argument("bundle")
    ap.add_argument("--drafter", default="model")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--per-suite", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=2)
    a = ap.parse_args()
    m = machine_info()
    print(f"machine: {m['cpu']} ({m['cpu_flags']}), {m['cpus']} CPUs; bundle {a.bundle}; drafter {a.drafter} "
          f"k={a.k} T={a.temperature}")
    dec = SpecDecoder.load(a.bundle, verify="size")
    drafted = {"keyed": 0, "classic": 0}
    accepted = dict(drafted)
    speed: dict[str, list[float]] = {"keyed": [], "classic": []}
    same = total = 0
    for p in suite_prompts(["code", "edit", "chat", "summarize", "json"], a.per_suite):
        msgs = [{"role": "user", "content": p.prompt}] if isinstance(p.prompt, str) else list(p.prompt)
        for seed in range(a.seeds):
            order = ("keyed", "classic") if seed % 2 == 0 else ("classic", "keyed")
            for sampler in order:
                params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=seed,
                                        sampler=sampler)
                res = dec.generate(msgs, params, drafter=a.drafter, k=a.k)
                drafted[sampler] += res.stats.drafted
                accepted[sampler] += res.stats.accepted
                speed[sampler].append(res.stats.decode_tok_s)
                if sampler == "keyed":
                    plain = dec.generate(msgs, params, drafter="none")
                    same += plain.token_ids == res.token_ids
                    total += 1
    for s in ("keyed", "classic"):
        rate = accepted[s] / drafted[s] if drafted[s] else 0.0
        print(f"{s:8s} acceptance {rate:.1%} ({accepted[s]}/{drafted[s]})  decode {statistics.median(speed[s]):.1f} "
              f"tok/s (median of {len(speed[s])})")
    print(f"keyed speculative text == keyed plain text: {same}/{total}")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
