"""The GPU kit's TensorRT measurements: `spec-export build --backend trt` per bundle (the int4-qdq bundle's: weight-only
INT4 engines), engines with one and with all optimization profiles per model (how much each extra profile costs in
build time and engine bytes, next to the weight bytes: TensorRT should not copy the weights per profile — the build
sets extra_memory_target 0), and, on the CPU, the int4-qdq fp16 graphs against TensorRT's ONNX parser rules."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
from collections import Counter
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


def _qdq(ctx: Any, bundle: str) -> bool:
    return ctx.meta["bundles"][bundle].get("quant_form") == "qdq"


def build_plan(ctx: Any, bundle: str, compare: str | None = None) -> dict[str, Any]:
    if _qdq(ctx, bundle):
        what = ("build weight-only INT4 engines from the fp16 graphs, whose matrices are INT4 DequantizeLinear "
                "blocks (TensorRT keeps them INT4), one optimization profile per declared width (min = opt = max), "
                "timed; seconds per profile, engine bytes vs the graph's weight bytes (INT4 blocks + fp16 rest)"
                + (f" and vs the fp16 engines of bundle {compare} (same models)" if compare else ""))
    else:
        what = ("build fp16 engines, one optimization profile per declared width (min = opt = max), timed; "
                "seconds per profile, engine bytes vs the fp16 weight bytes")
    return {"what": what,
            "commands": [f"spec-export build WORK/bundles/{bundle} --backend trt --precision fp16 --workspace-gb 2 "
                         "--timing-cache WORK/trt-timing.cache"]}


def sizes_plan(ctx: Any, bundle: str) -> dict[str, Any]:
    return {"what": "per model: an fp16 engine with 1 profile (the widest verify width) and one with all N; seconds "
                    "and bytes of each, per extra profile, engine / weight bytes",
            "commands": [f"python tools/gpu/gpu_kit.py trt-sizes WORK/bundles/{bundle} WORK/trt-timing.cache"]}


def step_times_plan(ctx: Any, bundle: str, backend: str, precision: str | None) -> dict[str, Any]:
    from gpu_kit_runs import Config

    modes = (False, True) if backend == "trt" else (None,)
    return {"what": "SpecDecoder.time_steps(repeats=20, past_len=64): ms per model and width"
                    + (", with cuda_graphs False and True (where this specedge has the option); runner.graph_status"
                       if backend == "trt" else ""),
            "api": [Config("", backend, precision, "", graphs=g).api(bundle) for g in modes]}


def build(ctx: Any, bundle: str, compare: str | None = None) -> dict[str, Any]:
    """`spec-export build BUNDLE --backend trt --precision fp16` (timed, in its own process), then what the
    manifest recorded: seconds per model and per profile, engine bytes vs the fp16 graph's weight bytes (for the
    int4-qdq bundle: INT4 blocks + fp16 rest, and its engines vs those of bundle `compare`, the same models in
    fp16, where that build passed)."""
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
    qdq = _qdq(ctx, bundle)
    ref = ctx.results.get(f"trt-build/{compare}", {}) if compare else {}
    for role, v in roles.items():
        if qdq and (rv := ctx.results.get(f"trt-parser/{bundle}", {}).get("roles", {}).get(role)):
            v["int4_weight_bytes"] = rv["initializer_bytes"].get("INT4")
        if ref.get("status") == "passed" and role in ref.get("roles", {}):
            v[f"fp16_engine_bytes_{compare}"] = ref["roles"][role]["engine_bytes"]
            v["engine_over_fp16_engine"] = round(v["engine_bytes"] / ref["roles"][role]["engine_bytes"], 3)
    stub = [line for line in p.stderr.splitlines() if "[gpu-kit]" in line]
    label = "the graph's weights (INT4 blocks + fp16)" if qdq else "the fp16 weights"
    summary = "; ".join(f"{r}: {v['profiles']} profiles in {v['seconds']}s ({v['seconds_per_profile']} s/profile), "
                        f"engine {v['engine_bytes'] / 1e6:.2f} MB = {v['engine_over_weights']}x {label}"
                        + (f" ({v['weights_bytes'] / 1e6:.3f} MB" + (f", INT4 {v['int4_weight_bytes'] / 1e6:.3f} MB"
                                                                      if v.get("int4_weight_bytes") else "") + ")"
                           if qdq else "")
                        + (f", {v['engine_over_fp16_engine']}x the fp16 engine of {compare}"
                           if "engine_over_fp16_engine" in v else "")
                        for r, v in roles.items())
    return {"passed": True, "command": ctx.show(cmd), "seconds": wall, "tensorrt": es.get("tensorrt"),
            "gpu": es.get("gpu"), "roles": roles, "notes": stub, "summary": f"TensorRT {es.get('tensorrt')}: {summary}"}


def parser_rules_plan(ctx: Any, bundle: str) -> dict[str, Any]:
    return {"what": "load each model's fp16 graph (the TensorRT build's input) with its external data: "
                    "trt_parser_problems must be empty (scales > 0 constants, zero zero-points, INT4 blocks on one "
                    "axis the block divides, even last dimension), INT4 DequantizeLinear nodes present (counted, "
                    "with their axis / block_size), no 8-bit DequantizeLinear left, only standard ONNX ops; the fp32 "
                    "graphs' problems counted for information (their int8 lm_head blocks: why TensorRT builds from "
                    "the fp16 graphs)",
            "api": [f"onnx.load(WORK/bundles/{bundle}/<role>.fp16.onnx, load_external_data=True)",
                    "specedge.export.engines.trt_parser_problems(model)"]}


def parser_rules(ctx: Any, bundle: str) -> dict[str, Any]:
    """The int4-qdq bundle's fp16 graphs against TensorRT's ONNX parser rules for DequantizeLinear
    (specedge.export.engines.trt_parser_problems), on the CPU, before any GPU time is spent on them."""
    import onnx
    from onnx import TensorProto

    from specedge.export.engines import trt_parser_problems
    from specedge.runtime.manifest import read_manifest

    bdir = ctx.bundle(bundle)
    m = read_manifest(bdir, verify="size")
    es = m.engine_set("onnx", "fp16")
    roles: dict[str, Any] = {}
    for role, e in m.models.items():
        model = onnx.load(str(bdir / es.graphs[role]), load_external_data=True)
        inits = {t.name: t for t in model.graph.initializer}
        dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        kinds = Counter(TensorProto.DataType.Name(inits[n.input[0]].data_type) if n.input[0] in inits
                        else "not an initializer" for n in dqs)
        attrs = Counter(tuple(sorted((a.name, onnx.helper.get_attribute_value(a)) for a in n.attribute
                                     if a.name in ("axis", "block_size"))) for n in dqs)
        nbytes: Counter = Counter()
        for t in model.graph.initializer:
            nbytes[TensorProto.DataType.Name(t.data_type)] += len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes
        fp32_problems = trt_parser_problems(onnx.load(str(bdir / e.graph), load_external_data=True))
        roles[role] = {"graph": es.graphs[role], "problems": trt_parser_problems(model),
                       "int4_dq_nodes": kinds.get("INT4", 0), "dq_nodes_by_input_type": dict(kinds),
                       "dq_axis_block_size": {", ".join(f"{k}={v}" for k, v in a) or "defaults": c
                                              for a, c in attrs.items()},
                       "domains": sorted({n.domain or "ai.onnx" for n in model.graph.node}),
                       "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
                       "initializer_bytes": dict(nbytes),
                       "fp32_graph_problems": len(fp32_problems), "fp32_graph_problem_examples": fp32_problems[:2]}
    bad = {r: [*v["problems"],
               *(["no INT4 DequantizeLinear node"] if not v["int4_dq_nodes"] else []),
               *([f"DequantizeLinear inputs other than INT4: {v['dq_nodes_by_input_type']}"]
                 if set(v["dq_nodes_by_input_type"]) - {"INT4"} else []),
               *([f"non-standard op domains {v['domains']}"] if v["domains"] != ["ai.onnx"] else [])]
           for r, v in roles.items()}
    passed = not any(bad.values())
    summary = ("fp16 graphs: " + ", ".join(f"{r} {v['int4_dq_nodes']} INT4 DequantizeLinear "
                                            f"({'; '.join(v['dq_axis_block_size'])})" for r, v in roles.items())
               + f"; TensorRT parser rules: {sum(len(v['problems']) for v in roles.values())} problems"
               + f"; ops: {sorted({d for v in roles.values() for d in v['domains']})} opset "
               + f"{sorted({v['opset'].get('ai.onnx') for v in roles.values()})}"
               + "; fp32 graphs (not TensorRT's input): "
               + ", ".join(f"{r} {v['fp32_graph_problems']}" for r, v in roles.items()) + " problems"
               + ("" if passed else f"; FAILED: {bad}"))
    return {"passed": passed, "roles": roles, "failures": bad, "summary": summary}


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
