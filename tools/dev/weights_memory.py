#!/usr/bin/env python3
"""What each way of loading the weights costs: ONNX Runtime mapping the weights file, ONNX Runtime copying the
file's contents, and the runtime reading each tensor once.

    python tools/dev/weights_memory.py BUNDLE [--rounds 3] [--max-new-tokens 128]

``read`` is the runtime's way for a bundle whose manifest lists its tensors (the specedge form): each tensor is read
from ``<graph>.onnx.data`` into an array that ONNX Runtime takes as an initializer, and the file is never mapped.
``copied`` is its way for other bundles: ONNX Runtime is handed the file's contents and copies what it needs while
the session is made (the file's pages and the copies resident at once). ``mapped`` is ONNX Runtime's own: only the
pages a step touches are resident, and a file truncated or rewritten under the process can crash it (SIGBUS), which
is why the runtime does not do it. A bundle without a self draft. Each mode runs in its own process, alternated round
by round: load seconds, resident memory after a generation, peak resident memory, and plain decoding's tok/s (the
best of 4 generations, a fresh prefill each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import specedge.runtime.backends.ort as ortb
if sys.argv[2] in ("mapped", "copied"):
    ortb.shared_weights = lambda path, tensors: None  # the manifest's tensors ignored
if sys.argv[2] == "mapped":
    ortb.open_session = lambda ort, path, so, providers, given=None: ort.InferenceSession(str(path), so,
                                                                                          providers=providers)
from specedge.runtime import SamplingParams, SpecDecoder
t0 = time.perf_counter()
dec = SpecDecoder.load(sys.argv[1], threads=2)
load = time.perf_counter() - t0
params = SamplingParams(max_new_tokens=int(sys.argv[3]), ignore_eos=True)
prompt = "Write a short story about a robot who learns to paint."
speeds = []
for _ in range(4):
    r = dec.generate(prompt, params, drafter="none", reuse_prefix=False)
    speeds.append(r.stats.new_tokens / r.stats.decode_s)
rss = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"load_s": load, "rss_mb": rss, "peak_mb": peak, "tok_s": max(speeds)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    modes = ("mapped", "copied", "read")
    got: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(a.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHILD, a.bundle, mode,
                                  str(a.max_new_tokens)], capture_output=True, text=True, check=True)
            got[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'mode':8} {'load s':>7} {'RSS MB':>7} {'peak MB':>8} {'plain tok/s (median of best)':>30}")
    for mode, runs in got.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        speeds = ", ".join(f"{x['tok_s']:.1f}" for x in runs)
        print(f"{mode:8} {med['load_s']:7.2f} {med['rss_mb']:7.0f} {med['peak_mb']:8.0f} {med['tok_s']:10.1f} "
              f"({speeds})")


if __name__ == "__main__":
    main()
