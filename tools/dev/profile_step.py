"""Where one target step spends its time, per operator, with ONNX Runtime's profiler (CPU).

    python tools/dev/profile_step.py BUNDLE [--width 2,5] [--steps 20] [--past 128] [--role target] [--top 12]

Loads the role's graph exactly as the runtime does (OrtRunner: same session options, bound buffers), runs
`--steps` steps at each width at past_len `--past` after 3 warm-up steps, and prints per width: wall ms per step,
the sum of kernel time per operator type, and the slowest nodes. Widths are profiled in separate sessions (the
profiler's file is per session), one after another: never run this beside a benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def profile(bundle: Path, role: str, T: int, steps: int, past: int, threads: int | None) -> dict:
    import onnxruntime as ort

    from specedge.runtime.backends.ort import OrtRunner
    from specedge.runtime.manifest import read_manifest

    manifest = read_manifest(bundle, verify="size")
    prefix = Path(tempfile.mkdtemp(prefix="specedge-prof-")) / f"T{T}"
    real = ort.SessionOptions

    def with_profiler():  # the runner's own options, plus the profiler
        so = real()
        so.enable_profiling = True
        so.profile_file_prefix = str(prefix)
        return so

    ort.SessionOptions = with_profiler
    try:
        runner = OrtRunner(bundle, manifest, role, threads=threads)
    finally:
        ort.SessionOptions = real
    widths = [w.T for w in runner.entry.widths]
    if T not in widths:
        raise SystemExit(f"width {T} is not one of the {role} graph's widths {widths}")
    runner.min_width = T
    w = next(w for w in runner.entry.widths if w.T == T)
    all_logits = w.L == w.T
    tokens = list(range(100, 100 + T))
    for _ in range(3):
        runner.step(tokens, past, all_logits)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.step(tokens, past, all_logits)
        walls.append((time.perf_counter() - t0) * 1e3)
    path = runner.session.end_profiling()
    events = json.loads(Path(path).read_text())
    os.unlink(path)
    t_start_us = None
    by_type: dict[str, float] = defaultdict(float)
    by_node: dict[str, float] = defaultdict(float)
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    if len(runs) >= steps:
        t_start_us = runs[-steps]["ts"]
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if t_start_us is not None and e["ts"] < t_start_us:
            continue  # warm-up steps
        args = e.get("args", {})
        by_type[args.get("op_name", "?")] += e["dur"] / 1e3 / steps
        by_node[e["name"][:-len("_kernel_time")]] += e["dur"] / 1e3 / steps
    return {"T": T, "wall_ms": statistics.median(walls), "by_type": dict(by_type), "by_node": dict(by_node)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--width", default="2,5", help="comma-separated widths T of the graph (default 2,5)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--past", type=int, default=128, help="past_len of every profiled step")
    ap.add_argument("--role", default="target", choices=("target", "draft"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--top", type=int, default=12, help="slowest nodes to list per width")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    out = []
    for T in [int(x) for x in a.width.split(",")]:
        r = profile(a.bundle, a.role, T, a.steps, a.past, a.threads)
        out.append(r)
        kernel = sum(r["by_type"].values())
        print(f"\n== {a.bundle.name} {a.role} T={T}: {r['wall_ms']:.1f} ms/step wall, {kernel:.1f} ms in kernels")
        for op, ms in sorted(r["by_type"].items(), key=lambda x: -x[1]):
            if ms >= 0.05:
                print(f"  {op:<28} {ms:8.2f} ms  {100 * ms / kernel:5.1f} %")
        print("  slowest nodes:")
        for name, ms in sorted(r["by_node"].items(), key=lambda x: -x[1])[:a.top]:
            print(f"    {name[:60]:<60} {ms:7.2f} ms")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
