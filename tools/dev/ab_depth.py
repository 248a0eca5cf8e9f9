#!/usr/bin/env python3
"""A/B two kernel libraries' decode step at depth, in one process: one bundle loaded on each, stepped alternately.

    python tools/dev/ab_depth.py BUNDLE --lib LIB_A --lib LIB_B [--depths 128,8192,16384] [--rounds 3]

Each decoder's target takes its one-row step at past_len D over cache rows written with random values first (as
tools/long_context.py does), A then B at each depth, every round; per library and depth the fastest round's median
step (a shared VM's speed drifts within minutes, so the two are timed side by side, never in blocks apart).

A kernel library is a file ``runtime.kernels.library_path()`` built; one from another checkout's sources:
    python -c "import pathlib, specedge.runtime.kernels as k; k._src_dir = lambda: pathlib.Path('OTHER/runtime/csrc');
               print(k.library_path())"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from long_context import _ints, fill_cache, step_ms  # noqa: E402

from specedge.runtime import SpecDecoder  # noqa: E402
from specedge.runtime.bench.runner import machine_info  # noqa: E402
from specedge.runtime.cpu import physical_cores  # noqa: E402
from specedge.runtime.kernels import use_library  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--lib", action="append", default=[], help="a kernel library (twice: A, then B)")
    ap.add_argument("--depths", type=_ints, default=[128, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if len(a.lib) != 2:
        ap.error("give --lib twice: A, then B")
    if a.rounds < 1:
        ap.error("--rounds: at least 1")
    decs = []
    for lib in a.lib:
        try:
            use_library(lib)
        except FileNotFoundError as e:
            raise SystemExit(f"--lib {e}") from None
        dec = SpecDecoder.load(a.bundle, threads=physical_cores(), verify="size")
        if max(a.depths) + 1 > dec.manifest.max_context:
            raise SystemExit(f"--depths: {max(a.depths)} does not fit the bundle's context S_max="
                             f"{dec.manifest.max_context} (export with --max-context)")
        fill_cache(dec, max(a.depths) + 1)
        decs.append(dec)
    print(machine_info())
    best = [{d: float("inf") for d in a.depths} for _ in decs]
    for r in range(a.rounds):
        for d in a.depths:
            for i, dec in enumerate(decs):
                best[i][d] = min(best[i][d], step_ms(dec, d, 1, 3))
        print(f"  round {r + 1}/{a.rounds} done", file=sys.stderr)
    print("| depth | A: step ms | A: vs first depth | B: step ms | B: vs first depth | B / A |")
    print("|---|---|---|---|---|---|")
    d0 = a.depths[0]
    for d in a.depths:
        x, y = best[0][d], best[1][d]
        print(f"| {d} | {x:.1f} | {x / best[0][d0]:.2f}× | {y:.1f} | {y / best[1][d0]:.2f}× | {y / x:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
