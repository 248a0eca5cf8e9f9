"""What `make demo` runs: two prompts, each decoded plainly, with prompt lookup and with `auto`, on one loaded decoder.

    python tools/demo.py BUNDLE [--max-new-tokens 160] [--repeats 3] [--temperature 0] [--seed 1]

The first prompt is an edit of given code: the answer copies much of its context, so prompt lookup's drafts are
accepted and speculation pays. The second is free-form writing with nothing in the prompt to copy: `auto`, which
decides every round from measured step costs and acceptance, runs mostly plain rounds there and speculates only
where the answer starts repeating itself. For each it prints the decode speed of every mode
(the median of --repeats runs, the modes interleaved: a shared machine's speed moves between runs), its speedup over
plain in the same run, the acceptance, and whether the text equals the plain text token for token.

Exit 1 if any speculative output differs from plain: the product's promise is that it cannot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench.suites import EDIT_CODE
from specedge.runtime.cpu import cpu_flags, cpu_name

PROMPTS = (
    ("an edit of given code (the answer copies its context)",
     "Rename the variable `tmp` to `total` in this code. Reply with the complete updated code.\n\n```python\n"
     + EDIT_CODE + "```"),
    ("free-form writing (nothing in the prompt to copy)", "Write a short story about a robot who learns to paint."),
)
MODES = (("plain", "none"), ("prompt lookup", "prompt-lookup"), ("auto", "auto"))


def run_prompt(dec: SpecDecoder, text: str, params: SamplingParams, repeats: int) -> tuple[dict, bool]:
    """Every mode ``repeats`` times, interleaved (the order rotates each repeat); returns the runs per mode and
    whether every speculative output equals the plain one."""
    messages = [{"role": "user", "content": text}]
    runs: dict[str, list] = {label: [] for label, _ in MODES}
    for r in range(repeats):
        order = MODES[r % len(MODES):] + MODES[: r % len(MODES)]
        for label, drafter in order:
            runs[label].append(dec.generate(messages, params, drafter=drafter))
    plain_ids = runs["plain"][0].token_ids
    same = all(x.token_ids == plain_ids for res in runs.values() for x in res)
    return runs, same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    dec = SpecDecoder.load(a.bundle, verify="size")
    t = dec.manifest.target
    form = t.quant.get("format", "MatMulNBits") if t.quant else "fp32"
    print(f"bundle {a.bundle}: {t.family} {t.precision} ({form}), K={dec.manifest.k}, KV {dec.manifest.kv_mode}")
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs; {cpu_flags()}")
    sampling = "greedy" if a.temperature == 0 else f"temperature {a.temperature}, seed {a.seed}"
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=a.seed)
    dec.generate("Hello", SamplingParams(max_new_tokens=8), drafter="none")  # warm-up: first-run allocations
    ok = True
    for i, (what, text) in enumerate(PROMPTS, 1):
        runs, same = run_prompt(dec, text, params, max(1, a.repeats))
        ok &= same
        plain = statistics.median(x.stats.decode_tok_s for x in runs["plain"])
        print(f"\n[{i}] {what}; {sampling}, {len(runs['plain'][0].token_ids)} tokens, median of "
              f"{max(1, a.repeats)} runs a mode")
        for label, res in runs.items():
            speed = statistics.median(x.stats.decode_tok_s for x in res)
            s = res[0].stats
            extra = "" if label == "plain" else (
                f"  accepted {s.accepted}/{s.drafted} drafted ({100 * s.acceptance_rate:.0f} %)"
                + (f", rounds {dict(sorted(s.strategies.items()))}" if s.strategies else ""))
            print(f"    {label:<14} {speed:6.1f} tok/s  {speed / plain if plain else 0:4.2f}x plain{extra}")
        print(f"    text: {'identical to plain in every mode, token for token' if same else 'DIFFERS FROM PLAIN'}")
        body = runs["plain"][0].text.strip().replace("\n", "\n    | ")
        print(f"    | {body}")
    print("\nspeculative output == plain output, token for token" if ok else "\nMISMATCH: see above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
