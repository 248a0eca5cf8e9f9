"""tools/dev/kernel_mca.py: it finds the marked AVX2 loop in every row count of a pass, and llvm-mca's model of it grows
with the rows (the model is what the AVX2 loop's design is checked against: no AVX2-only machine here)."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys

import pytest

from .tools_loader import TOOLS, load_tool

TOOL = TOOLS / "dev" / "kernel_mca.py"


def test_regions_are_read_between_the_markers_in_order():
    asm = ("\tnop\n# LLVM-MCA-BEGIN a\n\tvpmaddubsw %ymm0, %ymm1, %ymm2\n# LLVM-MCA-END a\n"
           "# LLVM-MCA-BEGIN b\n\tvpaddw %ymm0, %ymm1, %ymm2\n\tvpaddw %ymm0, %ymm1, %ymm3\n# LLVM-MCA-END b\n")
    found = load_tool("kernel_mca").regions(asm)
    assert [name for name, _ in found] == ["a", "b"]
    assert found[0][1].count("vpmaddubsw") == 1 and found[1][1].count("vpaddw") == 2


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not shutil.which("llvm-mca")
                    or not shutil.which("cc"), reason="needs an x86 C compiler and llvm-mca")
def test_the_avx2_loop_is_modelled_for_every_row_count():
    r = subprocess.run([sys.executable, str(TOOL), "--cpus", "haswell,znver2"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    rows = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == "avx2_q4":
            rows[int(cells[1])] = [float(c) for c in cells[2:]]
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for cpu in range(2):  # more rows, more cycles a chunk, but less than a pass per row
        assert all(rows[r][cpu] < rows[r + 1][cpu] for r in range(1, 5))
        assert rows[5][cpu] < 5 * rows[1][cpu]
