#!/usr/bin/env python3
"""llvm-mca's cycle model of the kernel's marked inner loops, for CPUs this machine is not.

    python tools/dev/kernel_mca.py [--march haswell] [--cpus haswell,skylake,znver2,znver3] [--src runtime/csrc]

The AVX2 path runs on AVX2-only cores (Intel Haswell to Comet Lake, AMD Zen 1-3), and a machine with AVX-512 runs
it only when told to, on ports it does not have: timing it there says little about them. This compiles
runtime/csrc/sek_gemm.c for ``--march`` with -DSEK_MCA, which puts llvm-mca's region markers
(SEK_MCA_BEGIN/END) around the marked loop bodies, and prints llvm-mca's cycles per iteration of each region
for each ``--cpus`` model (its scheduling model, not a measurement: no memory stalls, no front end beyond the
model's). Each region is one inlined copy of a loop body; ``rows`` is its vpmaddubsw count / 4, the rows of the
pass for AVX2's 4-bit loop (`avx2_q4`), whose iteration is one 8-k chunk of a 16-column tile. Compare sources with
``--src`` (a copy of runtime/csrc with the markers where you want them).
Needs llvm-mca (Debian: llvm) and the C compiler the runtime uses ($CC, else cc, gcc or clang).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def regions(asm: str) -> list[tuple[str, str]]:
    """(name, body) of each marked region, in the order of the assembly."""
    return re.findall(r"# LLVM-MCA-BEGIN (\S+)\n(.*?)# LLVM-MCA-END", asm, flags=re.S)


def cycles(body: str, cpu: str, mca: str, iterations: int = 200) -> float:
    """llvm-mca's cycles per iteration of a loop body on `cpu`."""
    lines = [ln for ln in body.splitlines() if ln.strip() and not ln.lstrip().startswith((".", "#"))]
    r = subprocess.run([mca, f"-mcpu={cpu}", f"-iterations={iterations}"], input="\n".join(lines) + "\n",
                       capture_output=True, text=True, check=True)
    total = re.search(r"Total Cycles:\s+(\d+)", r.stdout)
    if not total:
        raise RuntimeError(f"llvm-mca gave no cycle count for {cpu}:\n{r.stderr[-2000:]}")
    return int(total.group(1)) / iterations


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--march", default="haswell", help="the compiler's -march (default haswell: AVX2 + FMA)")
    ap.add_argument("--cpus", default="haswell,skylake,znver2,znver3", help="llvm-mca -mcpu models")
    ap.add_argument("--src", type=Path, default=ROOT / "runtime" / "csrc", help="the kernel sources to model")
    a = ap.parse_args()
    mca = shutil.which("llvm-mca") or next(iter(sorted(Path("/usr/bin").glob("llvm-mca-*"))), None)
    if not mca:
        print("llvm-mca not found: install LLVM (Debian: apt install llvm)", file=sys.stderr)
        return 2
    from specedge.runtime.kernels import CFLAGS, compiler

    cc = compiler()  # the runtime's own choice ($CC, else cc, gcc or clang) and flags, less -shared
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sek_gemm.s"
        flags = [f for f in CFLAGS if f != "-shared"]
        r = subprocess.run([*cc, *flags, "-DSEK_MCA", f"-march={a.march}", "-S", "-o", str(out),
                            str(a.src / "sek_gemm.c")], capture_output=True, text=True)
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        found = regions(out.read_text())
    if not found:
        print(f"no marked regions in {a.src / 'sek_gemm.c'} built for -march={a.march}", file=sys.stderr)
        return 1
    cpus = a.cpus.split(",")
    print(f"llvm-mca cycles per loop iteration; {a.src} built with {' '.join([*cc, *flags])} -march={a.march}\n")
    print("| region | rows | " + " | ".join(cpus) + " |\n|---|---|" + "---|" * len(cpus))
    seen = set()
    for name, body in found:
        rows = body.count("vpmaddubsw") // 4
        key = (name, rows, body.count("\n"))
        if key in seen:  # the same inlined copy at another call site
            continue
        seen.add(key)
        print(f"| {name} | {rows} | " + " | ".join(f"{cycles(body, c, mca):.1f}" for c in cpus) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
