#!/usr/bin/env python3
"""Peak memory of loading a TensorRT engine file, old way (``path.read_bytes()``) vs ``deserialize_mapped``,
with a stand-in for TensorRT (no GPU needed): its ``deserialize_cuda_engine`` copies the whole plan into a new
buffer, as TensorRT copies the weights into device memory — on a Jetson that memory is the same DRAM.

    python tools/dev/engine_load_rss.py [--gb 1.0]

Each way runs in a fresh process; reported: anonymous RSS (private memory: what cannot be reclaimed) at the
moment the copy exists, and file-backed RSS (page cache of the mapped plan: reclaimable, shared).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np

def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("RssAnon", "RssFile", "VmHWM"):
            out[k] = int(v.split()[0]) / 1024  # MB
    return out

class FakeRuntime:
    def deserialize_cuda_engine(self, buf):
        device = np.empty(len(buf), dtype=np.uint8)  # the engine's own copy ("device memory")
        device[:] = np.frombuffer(buf, dtype=np.uint8)
        self.at_peak = status()
        return device

path, how = Path(sys.argv[1]), sys.argv[2]
rt = FakeRuntime()
base = status()
if how == "read_bytes":
    engine = rt.deserialize_cuda_engine(path.read_bytes())
else:
    from specedge.runtime.backends.trt import deserialize_mapped
    engine = deserialize_mapped(rt, path)
print(json.dumps({"how": how, "base": base, "peak": rt.at_peak}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0, help="size of the stand-in engine file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        plan = Path(d) / "fake.plan"
        n = int(args.gb * (1 << 30))
        with open(plan, "wb") as f:
            chunk = bytes(range(256)) * 4096
            for _ in range(n // len(chunk)):
                f.write(chunk)
        size_mb = plan.stat().st_size / 2**20
        print(f"stand-in engine file: {size_mb:.0f} MB")
        for how in ("read_bytes", "mmap"):
            out = subprocess.run([sys.executable, "-c", CHILD, str(plan), how], capture_output=True, text=True,
                                 check=True)
            r = json.loads(out.stdout)
            anon = r["peak"]["RssAnon"] - r["base"]["RssAnon"]
            file = r["peak"]["RssFile"] - r["base"]["RssFile"]
            print(f"  {how:10s}: +{anon:6.0f} MB anonymous ({anon / size_mb:.2f}x the plan), +{file:6.0f} MB "
                  f"file-backed (page cache, reclaimable)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
