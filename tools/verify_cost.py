#!/usr/bin/env python3
"""What a multi-token (verify) step costs against a plain step, per bundle, interleaved in one run.

    python tools/verify_cost.py engines/qwen [engines/qwen-requant ...] [--past-len 128] [--repeats 15]
    python tools/verify_cost.py engines/qwen engines/qwen --lib OLD.so --lib NEW.so     # two kernel builds

For each bundle's target, every all-logits width T the bundle declares (and T = 1) is stepped ``repeats`` times
at ``past_len``, the widths and bundles in rotating order so the machine's state is shared fairly, each time as a
burst of ``burst`` timed steps after one untimed one. Timed singly in this rotation, the first step after another
width ran slow (a plain step up to 35 % slower than in a real decode, whose alternation of width 2 and one verify
width costs nothing extra), and every ratio to it came out too small. Prints the median milliseconds per step and
its ratio to the bundle's plain step — the width plain decoding runs: T = 1 where a lone row is computed exactly as
inside a wider step (specedge's own kernels and attention), else T = 2 (the batch-invariance rule: a plain round
carries a free one-token guess) — and to T = 1 and T = 2, with the CPU flags, since these ratios depend on the
kernels the CPU gets. ``--lib``, once per bundle, loads that bundle on a kernel library of its own (a file
``runtime.kernels.library_path()`` built, e.g. from another checkout or with another ``SPECEDGE_KERNEL_MARCH``), so
two builds of the kernels are timed side by side on one bundle.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from specedge.runtime import SpecDecoder
from specedge.runtime.bench.runner import machine_info


def load(bundle: str, lib: str | None) -> SpecDecoder:
    from specedge.runtime.kernels import use_library

    if lib is not None:
        try:
            use_library(lib)
        except FileNotFoundError as e:
            raise SystemExit(f"--lib {e}") from None
    return SpecDecoder.load(bundle)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundles", nargs="+")
    ap.add_argument("--past-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--burst", type=int, default=3, help="timed steps per width in a row (after one untimed)")
    ap.add_argument("--lib", action="append", default=[],
                    help="a kernel library for each bundle in turn (as many as bundles, or none)")
    a = ap.parse_args()
    if a.lib and len(a.lib) != len(a.bundles):
        ap.error(f"--lib given {len(a.lib)} times for {len(a.bundles)} bundles: give it once per bundle, or not at all")
    decs = [load(b, lib) for b, lib in zip(a.bundles, a.lib or [None] * len(a.bundles))]
    names = [b + (f" + {lib}" if lib else "") for b, lib in zip(a.bundles, a.lib or [None] * 99)]
    if len(set(names)) < len(names):
        ap.error("a bundle is named twice on the same kernels: give each its own --lib")
    a.bundles = names
    widths, plain_w = {}, {}
    for b, d in zip(a.bundles, decs):
        plain_w[b] = d.target.min_width  # what plain decoding runs: 1 where a lone row is exact, else 2 (+ a guess)
        d.target.min_width = 1  # measured here only; generation keeps the decoder's rule
        widths[b] = sorted({1} | {w.T for w in d.manifest.target.widths if w.T == w.L})
        for T in widths[b]:  # warm every width
            d.target.step(np.zeros(T, dtype=np.int64), a.past_len, all_logits=True)
    times: dict[tuple[str, int], list[float]] = {(b, T): [] for b in a.bundles for T in widths[b]}
    order = list(times)
    for r in range(a.repeats):
        for b, T in order[r % len(order):] + order[: r % len(order)]:
            d = decs[a.bundles.index(b)]
            ids = np.full(T, 100, dtype=np.int64)
            # a burst of steps at one width, as decoding runs them; the first, right after another width of the
            # rotation (the widest, or width 1), ran ~10 ms slow and is not timed (decoding's own alternation of
            # width 2 and a verify width shows no such cost: measured)
            for i in range(a.burst + 1):
                t0 = time.perf_counter()
                d.target.step(ids, a.past_len, all_logits=True)
                if i:
                    times[(b, T)].append(time.perf_counter() - t0)
    m = machine_info()
    print(f"Machine: {m['cpu']} ({m.get('cpu_flags', '')}), {m['cpus']} CPUs; onnxruntime {m['onnxruntime']}; "
          f"past_len {a.past_len}, {a.repeats} bursts of {a.burst} steps per width, interleaved")
    print("\n| bundle | T | ms per step (median) | vs its plain step (T) | vs T=1 | vs T=2 |")
    print("|---|---|---|---|---|---|")
    for b in a.bundles:
        med = {T: statistics.median(times[(b, T)]) * 1e3 for T in widths[b]}
        plain, two = med.get(plain_w[b], float("nan")), med.get(2, float("nan"))
        for T in widths[b]:
            print(f"| `{b}` | {T} | {med[T]:.1f} | {med[T] / plain:.2f}× (T={plain_w[b]}) | {med[T] / med[1]:.2f}× "
                  f"| {med[T] / two:.2f}× |")
    for d in decs:
        d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
