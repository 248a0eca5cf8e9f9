#!/usr/bin/env python3
"""A/B two decoders in one process, alternated prompt by prompt: two bundles, or one bundle on two kernel libraries.

    python tools/dev/ab_decode.py BUNDLE_A BUNDLE_B [--spec model:4,auto:8] [--suite code,chat,...] [--per-suite 2]
                              [--rounds 2] [--max-new-tokens 96]
    python tools/dev/ab_decode.py BUNDLE --lib LIB_A --lib LIB_B [...]      # two builds of runtime/csrc
                                                                             # (A: old, B: new)

A shared VM's speed drifts by tens of percent within minutes, so two decoders timed in blocks minutes apart say
when each ran, not which is faster. Here both are loaded once, and every prompt runs on A and on B back to back, the
order swapped every prompt and every round; the verdict is the median of the per-prompt ratios B/A (with their
range), which a phase change of the machine moves only for the pairs it splits. Per configuration it also reports
the accepted/drafted tokens of each side and whether their outputs are identical (greedy: two builds of the same
kernels must give the same text; two bundles of one target, e.g. a trimmed draft head, too).

A kernel library is a file ``runtime.kernels.library_path()`` built, e.g. with another ``SPECEDGE_KERNEL_MARCH``:
    SPECEDGE_KERNEL_MARCH=haswell python -c "from specedge.runtime.kernels import library_path; print(library_path())"
Each decoder's sessions register the library that was current when it loaded; ONNX Runtime keeps both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass, field

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench import suite_prompts
from specedge.runtime.bench.runner import machine_info


@dataclass
class Side:
    speeds: list[float] = field(default_factory=list)
    accepted: int = 0
    drafted: int = 0


def parse_spec(s: str) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, s.split(",")):
        name, _, k = item.partition(":")
        if name not in ("none", "prompt-lookup", "model", "auto", "hybrid") or (name != "none" and not k.isdigit()):
            raise SystemExit(f"--spec {item!r}: expected DRAFTER:K with DRAFTER none, prompt-lookup, model, auto or "
                             "hybrid (none:0 for plain decoding)")
        out.append((name, int(k or 0)))
    if not out:
        raise SystemExit("--spec is empty: give at least one DRAFTER:K")
    return out


def ab(decoders, requests, specs, rounds: int, params: SamplingParams, say=print) -> dict:
    """requests: (id, text, chat) triples. Returns {config: (Side A, Side B, identical outputs, pairs)}."""
    res = {c: (Side(), Side(), [0], [0]) for c in specs}
    for r in range(rounds):
        for pi, (pid, text, chat) in enumerate(requests):
            for c in specs:
                order = (0, 1) if (pi + r) % 2 == 0 else (1, 0)
                ids = {}
                for i in order:
                    g = decoders[i].generate(text, params, drafter=c[0], k=c[1], chat=chat)
                    side = res[c][i]
                    side.speeds.append((len(g.token_ids) - 1) / g.stats.decode_s if g.stats.decode_s > 0 else 0.0)
                    side.accepted += g.stats.accepted
                    side.drafted += g.stats.drafted
                    ids[i] = g.token_ids
                res[c][2][0] += ids[0] == ids[1]
                res[c][3][0] += 1
                a, b = res[c][0].speeds[-1], res[c][1].speeds[-1]
                say(f"{pid} {c[0]}:{c[1]} A {a:.1f} B {b:.1f} tok/s, B/A {b / a if a else float('nan'):.3f}"
                    + ("" if ids[0] == ids[1] else " (outputs differ)"))
    return res


def summary(res: dict) -> list[str]:
    lines = ["| config | A tok/s (median) | B tok/s (median) | B/A, median of per-prompt ratios (min–max) | "
             "accepted/drafted A | B | identical outputs |", "|---|---|---|---|---|---|---|"]
    for (name, k), (a, b, same, pairs) in res.items():
        ratios = [y / x for x, y in zip(a.speeds, b.speeds) if x > 0]
        lines.append(f"| {name}:{k} | {statistics.median(a.speeds):.2f} | {statistics.median(b.speeds):.2f} | "
                     f"**{statistics.median(ratios):.3f}×** ({min(ratios):.3f}–{max(ratios):.3f}) | "
                     f"{a.accepted}/{a.drafted} | {b.accepted}/{b.drafted} | {same[0]}/{pairs[0]} |")
    return lines


def load(bundle: str, lib: str | None) -> SpecDecoder:
    from specedge.runtime.kernels import use_library

    if lib is not None:
        try:
            use_library(lib)
        except FileNotFoundError as e:
            raise SystemExit(f"--lib {e}") from None
    dec = SpecDecoder.load(bundle, verify="size")
    dec.generate("Hello", SamplingParams(max_new_tokens=8))  # warm-up
    return dec


def main(argv: list[str] | None = None) -> int:
    # a benchmark times its own steps: auto starts from this process's measurement, not a kept one
    os.environ.setdefault("SPECEDGE_COST_CACHE", "off")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+", help="BUNDLE_A BUNDLE_B, or one BUNDLE with --lib twice")
    ap.add_argument("--lib", action="append", default=[], help="a kernel library (twice: A, then B)")
    ap.add_argument("--spec", default="model:4", help="comma list of DRAFTER:K (none:0 = plain)")
    ap.add_argument("--suite", default="code,chat,summarize,json,edit")
    ap.add_argument("--per-suite", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args(argv)
    if len(a.bundles) == 2 and not a.lib:
        pairs = [(a.bundles[0], None), (a.bundles[1], None)]
    elif len(a.bundles) == 1 and len(a.lib) == 2:
        pairs = [(a.bundles[0], a.lib[0]), (a.bundles[0], a.lib[1])]
    else:
        ap.error("give two bundles, or one bundle and --lib twice")
    specs = parse_spec(a.spec)
    decoders = [load(b, lib) for b, lib in pairs]
    templated = all(bool(d.manifest.tokenizer.chat_template) for d in decoders)  # else the prompts' text alone
    requests = [(p.id, *p.as_request(templated)) for p in suite_prompts(a.suite.split(","), a.per_suite)]
    m = machine_info()
    flags = m["cpu_flags"] if isinstance(m["cpu_flags"], str) else " ".join(m["cpu_flags"])
    sides = [bundle + (f" + {lib}" if lib else "") for bundle, lib in pairs]
    print(f"CPU {m['cpu']} ({flags}); A: {sides[0]}; B: {sides[1]}; {len(requests)} prompts x {a.rounds} round(s), "
          f"{a.max_new_tokens} tokens, greedy", flush=True)
    res = ab(decoders, requests, specs, a.rounds, SamplingParams(max_new_tokens=a.max_new_tokens),
             say=lambda s: print(s, file=sys.stderr, flush=True))
    print("\n".join(summary(res)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
