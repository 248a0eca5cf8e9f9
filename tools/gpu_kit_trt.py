"""The GPU kit's TensorRT measurements: `spec-export build --backend trt` per bundle, and engines with one and with
all optimization profiles per model (how much each extra profile costs in build time and engine bytes, next to
the weight bytes: TensorRT should not copy the weights per profile — the build sets extra_memory_target 0)."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def engine_sizes(bundle_dir: Path, timing_cache: Path) -> dict[str, Any]:
    """Per model: build its fp16 engine with 1 profile (the widest verify width) and with every declared width
    (N profiles), with the same warm timing cache; seconds and bytes of each. Runs in its own process
    (`gpu_kit.py trt-sizes`): a TensorRT crash then fails this measurement only."""
    from specedge.export.engines import TrtBuildOptions, _build_one, trt_profiles
    from specedge.runtime.backends.trt import import_tensorrt
    from specedge.runtime.manifest import read_manifest

    trt = import_tensorrt()
    m = read_manifest(bundle_dir, verify="size")
    es = m.engine_set("onnx", "fp16")
    opts = TrtBuildOptions("fp16", timing_cache=str(timing_cache))
    out: dict[str, Any] = {"tensorrt": trt.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        for role, e in m.models.items():
            profiles = trt_profiles(m, role)
            widths = [w.T for w in e.widths]
            verify = max(range(len(widths)), key=lambda i: (e.widths[i].L == e.widths[i].T, widths[i]))
            onnx = bundle_dir / es.graphs[role]
            data = onnx.with_name(onnx.name + ".data")
            weights = onnx.stat().st_size + (data.stat().st_size if data.is_file() else 0)
            row: dict[str, Any] = {"widths": widths, "weights_bytes": weights}
            for label, sel in (("1", [profiles[verify]]), ("N", profiles)):
                t0 = time.perf_counter()
                size = _build_one(trt, onnx, sel, opts, Path(timing_cache), lambda s: None,
                                  Path(tmp) / f"{role}.{label}.engine")
                row[f"profiles_{label}"] = {"profiles": len(sel), "T": [widths[verify]] if label == "1" else widths,
                                            "seconds": round(time.perf_counter() - t0, 2), "engine_bytes": size,
                                            "engine_over_weights": round(size / weights, 2)}
            one, n = row["profiles_1"], row["profiles_N"]
            extra = max(1, n["profiles"] - 1)
            row["seconds_per_extra_profile"] = round((n["seconds"] - one["seconds"]) / extra, 2)
            row["bytes_per_extra_profile"] = (n["engine_bytes"] - one["engine_bytes"]) // extra
            out[role] = row
    return out


def build_plan(ctx: Any, bundle: str) -> dict[str, Any]:
    return {"what": "build fp16 engines, one optimization profile per declared width (min = opt = max), timed; "
                    "seconds per profile, engine bytes vs the fp16 weight bytes",
            "commands": [f"spec-export build WORK/bundles/{bundle} --backend trt --precision fp16 --workspace-gb 2 "
                         "--timing-cache WORK/trt-timing.cache"]}


def sizes_plan(ctx: Any, bundle: str) -> dict[str, Any]:
    return {"what": "per model: an fp16 engine with 1 profile (the widest verify width) and one with all N; seconds "
                    "and bytes of each, per extra profile, engine / weight bytes",
            "commands": [f"python tools/gpu_kit.py trt-sizes WORK/bundles/{bundle} WORK/trt-timing.cache"]}


def step_times_plan(ctx: Any, bundle: str, backend: str, precision: str | None) -> dict[str, Any]:
    from gpu_kit_runs import Config

    modes = (False, True) if backend == "trt" else (None,)
    return {"what": "SpecDecoder.time_steps(repeats=20, past_len=64): ms per model and width"
                    + (", with cuda_graphs False and True (where this specedge has the option); runner.graph_status"
                       if backend == "trt" else ""),
            "api": [Config("", backend, precision, "", graphs=g).api(bundle) for g in modes]}


def build(ctx: Any, bundle: str) -> dict[str, Any]:
    """`spec-export build BUNDLE --backend trt --precision fp16` (timed, in its own process), then what the
    manifest recorded: seconds per model and per profile, engine bytes vs the fp16 weight bytes."""
    bdir = ctx.bundle(bundle)
    cmd = ctx.spec_export("build", bdir, "--backend", "trt", "--precision", "fp16", "--workspace-gb", "2",
                          "--timing-cache", ctx.work / "trt-timing.cache")
    t0 = time.perf_counter()
    p = ctx.sh(cmd, timeout=240)
    wall = round(time.perf_counter() - t0, 1)
    if p.returncode != 0:
        return {"passed": False, "command": ctx.show(cmd), "exit": p.returncode, "seconds": wall,
                "output_tail": (p.stdout + p.stderr)[-3000:], "summary": f"exit {p.returncode}: "
                + ((p.stderr or p.stdout).strip().splitlines() or [""])[-1][:300]}
    man = json.loads((bdir / "manifest.json").read_text())
    es = man["engines"]["trt-fp16"]
    fp16 = man["engines"]["onnx-fp16"]["graphs"]
    roles = {}
    for role, engine in es["graphs"].items():
        weights = sum(man["files"][f]["bytes"] for f in (fp16[role], fp16[role] + ".data") if f in man["files"])
        n = len(es["profiles"][role])
        secs = es["build"]["seconds"][role]
        size = man["files"][engine]["bytes"]
        roles[role] = {"engine": engine, "profiles": n, "T": [t for t, _ in es["profiles"][role]], "seconds": secs,
                       "seconds_per_profile": round(secs / n, 2), "engine_bytes": size, "weights_bytes": weights,
                       "engine_over_weights": round(size / weights, 2)}
    stub = [line for line in p.stderr.splitlines() if "[gpu-kit]" in line]
    summary = "; ".join(f"{r}: {v['profiles']} profiles in {v['seconds']}s ({v['seconds_per_profile']} s/profile), "
                        f"engine {v['engine_bytes'] / 1e6:.2f} MB = {v['engine_over_weights']}x the fp16 weights"
                        for r, v in roles.items())
    return {"passed": True, "command": ctx.show(cmd), "seconds": wall, "tensorrt": es.get("tensorrt"),
            "gpu": es.get("gpu"), "roles": roles, "notes": stub, "summary": f"TensorRT {es.get('tensorrt')}: {summary}"}


def sizes(ctx: Any, bundle: str) -> dict[str, Any]:
    """Engines with 1 and N profiles (gpu_kit.py trt-sizes, its own process)."""
    cmd = ctx.kit_cmd("trt-sizes", ctx.bundle(bundle), ctx.work / "trt-timing.cache")
    p = ctx.sh(cmd, timeout=300)
    if p.returncode != 0:
        return {"passed": False, "command": ctx.show(cmd), "exit": p.returncode,
                "output_tail": (p.stdout + p.stderr)[-3000:], "summary": f"exit {p.returncode}: "
                + ((p.stderr or p.stdout).strip().splitlines() or [""])[-1][:300]}
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    summary = "; ".join(
        f"{r}: 1 profile {v['profiles_1']['engine_bytes'] / 1e6:.2f} MB / {v['profiles_1']['seconds']}s, "
        f"{v['profiles_N']['profiles']} profiles {v['profiles_N']['engine_bytes'] / 1e6:.2f} MB / "
        f"{v['profiles_N']['seconds']}s (per extra profile {v['bytes_per_extra_profile'] / 1e6:+.3f} MB, "
        f"{v['seconds_per_extra_profile']:+}s; weights {v['weights_bytes'] / 1e6:.2f} MB)"
        for r, v in rep.items() if isinstance(v, dict))
    return {"passed": True, "command": ctx.show(cmd), **rep, "summary": summary}


def step_times(ctx: Any, bundle: str, backend: str, precision: str | None) -> dict[str, Any]:
    """Milliseconds of one step per model and width (SpecDecoder.time_steps: fastest of 20 after a warm-up),
    without and (where this specedge has them) with CUDA graphs, and the runners' graph_status."""
    out: dict[str, Any] = {}
    modes = [False, True] if backend == "trt" and ctx.caps["cuda_graphs"] else [None]
    for cg in modes:
        dec = ctx.load_decoder(bundle, backend, precision, cuda_graphs=cg)
        try:
            t = dec.time_steps(repeats=20, past_len=64)
            row = {role: {str(T): round(s * 1e3, 4) for T, s in widths.items()} for role, widths in t.items()}
            status = {r: getattr(run, "graph_status", None) for r, run in (("target", dec.target),
                                                                          ("draft", dec.draft_runner)) if run}
        finally:
            dec.close()
        key = {None: "default", False: "cuda_graphs=False", True: "cuda_graphs=True"}[cg]
        out[key] = {"ms": row, "graph_status": {r: {str(k): v for k, v in s.items()} if isinstance(s, dict) else s
                                                for r, s in status.items()}}
    if "cuda_graphs=True" in out:
        a, b = out["cuda_graphs=False"]["ms"], out["cuda_graphs=True"]["ms"]
        out["speedup_with_graphs"] = {r: {T: round(a[r][T] / b[r][T], 2) for T in a[r] if b[r].get(T)} for r in a}
    elif backend == "trt":
        out["cuda_graphs"] = f"not measured: {ctx.why['cuda_graphs']}"
    out["passed"] = True  # a measurement: it fails only by raising
    parts = []
    for key, v in out.items():
        if isinstance(v, dict) and "ms" in v:
            parts.append(f"{key}: " + ", ".join(f"{r} " + " ".join(f"T{T}={ms:.3g}" for T, ms in w.items())
                                                for r, w in v["ms"].items()) + " ms")
    out["summary"] = "; ".join(parts) + (f"; speedup with graphs {out['speedup_with_graphs']}"
                                         if "speedup_with_graphs" in out else "")
    return out


def run_capture(cmd: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(cmd, 124, out + f"\n[gpu-kit] timed out after {timeout:.0f}s", "")
