#!/usr/bin/env python3
"""`spec-export plan`'s count for a bundle on ONNX Runtime CPU beside the memory the process really holds, with N
sequences' KV slots: after loading, after one request, and with every row of every slot of both caches written
(the most a server of N requests at the full context can hold).

    python tools/dev/plan_rss.py engines/qwen32k [--max-batch 4]

The KV buffers are allocated once at load; their pages become resident only as rows are written, so the last
figure is the one the plan is for. Resident memory is the process's VmRSS (/proc/self/status).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bench.runner import machine_info
from specedge.runtime.manifest import read_manifest
from specedge.runtime.memplan import GiB, plan_for_manifest


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--max-batch", type=int, default=4)
    a = ap.parse_args()
    plan = plan_for_manifest(read_manifest(a.bundle), "ort-cpu", max_batch=a.max_batch)
    info = machine_info()
    print(f"Machine: {info['cpu']} ({info.get('cpu_flags', '')}); {a.bundle}, --max-batch {a.max_batch}")
    print(f"plan: {plan.total / GiB:.2f} GiB (" + ", ".join(
        f"{m.role} KV {m.kv / GiB:.2f} GiB" for m in plan.models) + ")")
    dec = SpecDecoder.load(a.bundle, max_batch=a.max_batch)
    at = {"loaded": rss()}
    dec.generate("def add(a, b):", SamplingParams(max_new_tokens=8))
    at["after a request"] = rss()
    touched = 0
    for runner in (dec.target, getattr(dec, "draft_runner", None)):
        kv = getattr(runner, "kv", None)
        if isinstance(kv, np.ndarray):
            kv.reshape(-1).view(np.uint8)[::4096] = 0  # one byte a page: every page of every slot resident
            touched += kv.nbytes
    at["every KV row written"] = rss()
    print(f"KV buffers written: {touched} bytes")
    for what, n in at.items():
        print(f"| {what} | {n / GiB:.2f} GiB | plan / measured {plan.total / n:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
