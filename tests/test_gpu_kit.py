"""The GPU smoke kit (tools/gpu/gpu_kit.py) on this CPU machine: `prepare` makes a small, complete kit; `check
--dry-run` passes every CPU check and reports every GPU check as skipped with its reason and plan; a tampered
golden fails the CPU parity check (so the goldens and the check code are what the GPU run relies on); the
TensorRT size and build bookkeeping (the int4-qdq bundle's weight-only INT4 engines included) runs against the
stand-in TensorRT of tests/export/test_trt_build_fake.py."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
KIT_PY = [sys.executable, str(ROOT / "tools" / "gpu" / "gpu_kit.py")]
QDQ_GPU_CHECKS = {  # the int4-qdq bundle on a GPU: weight-only INT4 engines, its fp16 graph on ort-cuda
    "trt-build/int4-qdq", "parity/trt/int4/int4-qdq", "greedy/trt/int4/int4-qdq",
    "parity/ort-cuda/int4-fp16/int4-qdq", "greedy/ort-cuda/int4-fp16/int4-qdq",
}
QDQ_CPU_CHECKS = {"parity/ort-cpu/int4/int4-qdq", "parity/ort-cpu/int4-fp16/int4-qdq", "greedy/ort-cpu/int4/int4-qdq",
                  "trt-parser/int4-qdq"}
GPU_CHECKS = {  # every GPU check the kit declares for its four bundles
    "cuda-binding", "trt-runner-graphs", "nan-cache/ort-cuda/fp32/model", "nan-cache/ort-cuda/fp16/model",
    "parity/ort-cuda/fp32/model", "parity/ort-cuda/fp32/lookup", "parity/ort-cuda/tf32/model",
    "parity/ort-cuda/fp16/model", "parity/ort-cuda/fp16/lookup", "parity/ort-cuda/int4/int4",
    "greedy/ort-cuda/tf32/model", "greedy/ort-cuda/tf32/lookup", "greedy/ort-cuda/fp16/model",
    "greedy/ort-cuda/int4/int4", "validate/ort-cuda-fp16/model",
    "trt-build/model", "trt-build/lookup", "trt-build/int4",
    "parity/trt/fp16/model", "parity/trt-graphs/fp16/model", "greedy/trt/fp16/model", "validate/trt/model",
    "parity/trt/fp16/lookup", "parity/trt-graphs/fp16/lookup", "greedy/trt/fp16/lookup", "validate/trt/lookup",
    "greedy/trt-graphs/fp16/model", "step-times/trt/model", "step-times/ort-cuda/model", "trt-profiles/model",
    "parity/ort-trt/fp32/model", "parity/ort-trt/fp32/lookup", "greedy/ort-trt/fp32/model",
    *QDQ_GPU_CHECKS,
}
CPU_CHECKS = {
    "environment", "kit-integrity", "parity/ort-cpu/fp32/model", "parity/ort-cpu/fp32/lookup",
    "parity/ort-cpu/int4/int4", "parity/ort-cpu/fp16/model", "parity/ort-cpu/fp16/lookup",
    "greedy/ort-cpu/fp32/model", "greedy/ort-cpu/fp32/lookup", "greedy/ort-cpu/int4/int4",
    "validate/ort-fp16/model", "validate/ort-fp16/lookup", *QDQ_CPU_CHECKS,
}


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-kit") / "kit"
    p = subprocess.run([*KIT_PY, "prepare", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


def check(kit: Path, tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    report = tmp / "report.json"
    p = subprocess.run([*KIT_PY, "check", str(kit), "--dry-run", "--report", str(report), "--work", str(tmp / "work"),
                        *args], capture_output=True, text=True, timeout=600)
    return p, json.loads(report.read_text())


def test_prepare_makes_a_small_complete_kit(kit):
    meta = json.loads((kit / "kit.json").read_text())
    assert meta["bytes"] < 20e6  # carried to the GPU machine with the working tree
    assert set(meta["bundles"]) == {"model", "lookup", "int4", "int4-qdq"}
    for name, b in meta["bundles"].items():
        man = json.loads((kit / b["dir"] / "manifest.json").read_text())
        assert ("onnx-fp16" in man["engines"]) == (name != "int4"), name  # int4-qdq: TensorRT's fp16 input
        assert man["target"]["precision"] == b["weights"] and man["kv_mode"] == "portable"
        z = np.load(kit / b["goldens"])
        ops = json.loads(bytes(z["meta"]).decode())["ops"]
        assert {o["part"] for o in ops} == {"past_len 0", "past_len P", "rollback", "padded prefill"}
        assert {o["past_len"] for o in ops if o["part"] == "past_len P"} == {0, 16}
        for role in ("target", "draft") if b["drafter"] == "model" else ("target",):  # every width at past_len 0
            widths = {w["T"] for w in man[role]["widths"]}
            assert {len(o["tokens"]) for o in ops if o["role"] == role and o["part"] == "past_len 0"} == widths
    for role in ("target", "draft"):  # int4 as standard ONNX, fp32 compute (accuracy level 0) like the int4 bundle
        q = json.loads((kit / "bundles" / "int4-qdq" / "manifest.json").read_text())[role]["quant"]
        assert q["format"] == "DequantizeLinear+MatMul" and q["bits"] == 4 and q["block"] == 32
        assert q["accuracy_level"] == 0
    assert "--quant-form qdq --kv-mode portable" in meta["bundles"]["int4-qdq"]["commands"][0]
    assert meta["bundles"]["int4-qdq"]["reduced_precision_on_cpu"]["fp16"]["max_reldiff_vs_int4_on_cpu"] < \
        meta["tolerances"]["int4-fp16"]["rel"]
    greedy = json.loads((kit / "goldens" / "greedy.json").read_text())
    assert all(len(g["prompts"]) == 3 and all(len(p["tokens"]) == 24 for p in g["prompts"]) for g in greedy.values())
    assert (kit / "goldens" / "validate-model.npz").is_file() and (kit / "pylib.tar.gz").is_file()


def test_dry_run_passes_the_cpu_checks_and_skips_every_gpu_check_with_its_plan(kit, tmp_path):
    p, rep = check(kit, tmp_path)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert rep["mode"] == "dry-run" and rep["complete"] and rep["passed"]
    by = {c["id"]: c for c in rep["checks"]}
    assert {i for i, c in by.items() if c["kind"] == "cpu"} == CPU_CHECKS
    assert {i for i, c in by.items() if c["kind"] == "gpu"} == GPU_CHECKS
    for i in CPU_CHECKS:
        assert by[i]["status"] == "passed", (i, by[i].get("summary"))
    for i in GPU_CHECKS:
        c = by[i]
        assert c["status"] == "skipped" and c["reason"], i
        if i == "trt-build/int4":  # MatMulNBits: pointed at the int4-qdq bundle's TensorRT checks
            assert "trt-build/int4-qdq" in c["reason"] and "parity/trt/int4/int4-qdq" in c["reason"], c["reason"]
        else:
            assert c["reason"].startswith("no GPU"), (i, c["reason"])
        assert c["plan"].get("what"), i
    for i in (i for i in GPU_CHECKS if i.startswith("parity/")):  # widths and tolerance spelled out
        plan = by[i]["plan"]
        even = "/int4" in i or "/int8" in i  # int8/int4 targets declare even verify widths (manifest.model_widths)
        assert plan["widths"]["target"] == ([1, 2, 4, 6, 16] if even else [1, 2, 3, 4, 5, 16]), i
        assert "max|d| <=" in plan["tolerance"], i
        assert any("SpecDecoder.load" in a or "OrtRunner(" in a for a in plan["api"]), i
    assert "spec-export build" in by["trt-build/model"]["plan"]["commands"][0]
    assert "spec-export build WORK/bundles/int4-qdq --backend trt" in by["trt-build/int4-qdq"]["plan"]["commands"][0]
    assert "INT4" in by["trt-build/int4-qdq"]["plan"]["what"]
    for i in ("parity/trt/int4/int4-qdq", "parity/ort-cuda/int4-fp16/int4-qdq"):  # the stated int4-on-GPU bound
        assert by[i]["plan"]["tolerance"].startswith("int4-fp16: max|d| <= 0.03 x max|ref| + 0.02"), i
        assert "precision='fp16'" in by[i]["plan"]["api"][0], i
    parser = by["trt-parser/int4-qdq"]  # the fp16 graphs TensorRT builds: INT4 DequantizeLinear, parser rules hold
    for role in ("target", "draft"):
        r = parser["roles"][role]
        assert r["problems"] == [] and r["int4_dq_nodes"] > 0 and set(r["dq_nodes_by_input_type"]) == {"INT4"}
        assert r["dq_axis_block_size"] == {"axis=0, block_size=32": r["int4_dq_nodes"]} and r["domains"] == ["ai.onnx"]
        # the target's int8 lm_head blocks in the fp32 graph are not TensorRT's input; an int4 draft's head is int4
        assert (r["fp32_graph_problems"] >= 1) if role == "target" else (r["fp32_graph_problems"] == 0), role
    assert "INT4 DequantizeLinear" in parser["summary"] and "0 problems" in parser["summary"]
    assert by["parity/ort-cpu/int4-fp16/int4-qdq"]["steps_passed"] == by["parity/ort-cpu/int4-fp16/int4-qdq"]["steps"]
    assert "--goldens" in by["validate/trt/model"]["plan"]["commands"][0]
    assert by["parity/ort-cpu/fp32/model"]["steps_passed"] == by["parity/ort-cpu/fp32/model"]["steps"] > 40
    assert "skipped: no GPU" in p.stdout


def _rewrite(kit: Path, rel: str, rehash: bool) -> None:
    g = kit / rel
    z = dict(np.load(g))
    z["op5"] = z["op5"] + np.float32(0.05)  # one step's logits, off by 10 x the fp32 tolerance
    np.savez_compressed(g, **z)
    if rehash:
        meta = json.loads((kit / "kit.json").read_text())
        meta["files"][rel] = {"sha256": hashlib.sha256(g.read_bytes()).hexdigest(), "bytes": g.stat().st_size}
        (kit / "kit.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("rehash", [False, True])
def test_a_tampered_golden_fails_the_cpu_parity_check(kit, tmp_path, rehash):
    bad = tmp_path / "kit"
    shutil.copytree(kit, bad)
    _rewrite(bad, "goldens/model.npz", rehash)
    p, rep = check(bad, tmp_path, "--only", "parity/ort-cpu/fp32/model")
    assert p.returncode == 1 and not rep["passed"]
    by = {c["id"]: c for c in rep["checks"]}
    assert by["kit-integrity"]["status"] == ("passed" if rehash else "failed")  # kit.json hashes catch it too
    par = by["parity/ort-cpu/fp32/model"]
    assert par["status"] == "failed" and par["steps_passed"] == par["steps"] - 1
    assert par["first_failure"]["step"] == 5 and par["first_failure"]["max_absdiff"] == pytest.approx(0.05, rel=1e-3)
    assert by["parity/ort-cpu/fp32/lookup"]["status"] == "skipped"  # --only


def test_trt_size_bookkeeping_with_a_stand_in_tensorrt(kit, tmp_path, monkeypatch):
    """The 1-vs-N-profile measurement's own arithmetic (TensorRT itself is checked on a GPU machine)."""
    import specedge.runtime.backends.trt as trt_backend
    from tests.export.test_trt_build_fake import fake_trt

    monkeypatch.syspath_prepend(str(ROOT / "tools" / "gpu"))
    import gpu_kit_trt

    trt = fake_trt()
    monkeypatch.setattr(trt_backend, "import_tensorrt", lambda: trt)
    bundle = tmp_path / "model"
    shutil.copytree(kit / "bundles" / "model", bundle)
    rep = gpu_kit_trt.engine_sizes(bundle, tmp_path / "timing.cache")
    assert rep["tensorrt"] == trt.__version__
    t = rep["target"]
    assert t["profiles_1"]["profiles"] == 1 and t["profiles_1"]["T"] == [5]  # the widest verify width
    assert t["profiles_N"]["profiles"] == 6 and t["profiles_N"]["T"] == [1, 2, 3, 4, 5, 16]
    assert rep["draft"]["profiles_N"]["T"] == [1, 2, 4, 8, 16]  # decode, the catch-up widths, prefill P
    assert t["weights_bytes"] == sum((bundle / f).stat().st_size for f in ("target.fp16.onnx", "target.fp16.onnx.data"))
    assert t["profiles_N"]["engine_bytes"] == 4 and t["bytes_per_extra_profile"] == 0  # the stand-in's b"PLAN"
    assert len(trt.rec["profiles"]) == (1 + 6) + (1 + 5)  # four builds: target and draft, 1 and N profiles


def test_trt_build_bookkeeping_of_the_int4_qdq_bundle(kit, tmp_path, monkeypatch):
    """The int4-qdq build check's own arithmetic — engine bytes vs the fp16 graph's weights and its INT4 blocks, vs
    the same models' fp16 engines — on engines that the stand-in TensorRT built in-process."""
    import specedge.export.engines as engines
    import specedge.runtime.backends.cuda_rt as cuda_rt
    from tests.export.test_trt_build_fake import fake_trt

    monkeypatch.syspath_prepend(str(ROOT / "tools" / "gpu"))
    import gpu_kit_trt as kt

    class Cuda:
        def compute_capability(self) -> str:
            return "8.7"

        def device_name(self) -> str:
            return "stand-in GPU"

        def mem_info(self) -> tuple[int, int]:
            return 6 << 30, 8 << 30

    monkeypatch.setattr(cuda_rt, "CudaRuntime", Cuda)
    meta = json.loads((kit / "kit.json").read_text())
    ctx = types.SimpleNamespace(meta=meta, results={}, work=tmp_path, bundle=lambda b: tmp_path / "bundles" / b,
                                spec_export=lambda *a: [sys.executable, "gpu_kit.py", "spec-export", *map(str, a)],
                                show=lambda cmd: " ".join(cmd),
                                sh=lambda cmd, timeout: subprocess.CompletedProcess(cmd, 0, "", ""))
    for name, plan in (("model", b"PLAN" * 100), ("int4-qdq", b"PLAN" * 30)):
        shutil.copytree(kit / "bundles" / name, ctx.bundle(name))
        monkeypatch.setattr(engines, "import_tensorrt", lambda plan=plan: fake_trt(plan=plan))
        engines.build_trt(ctx.bundle(name), engines.TrtBuildOptions(timing_cache=str(tmp_path / "timing.cache")))
    ctx.results["trt-parser/int4-qdq"] = {"status": "passed", **kt.parser_rules(ctx, "int4-qdq")}
    ctx.results["trt-build/model"] = {"status": "passed", **kt.build(ctx, "model")}
    rep = kt.build(ctx, "int4-qdq", "model")
    assert rep["passed"], rep
    t = rep["roles"]["target"]
    graph = ctx.bundle("int4-qdq") / "target.fp16.onnx"
    assert t["engine_bytes"] == 120 and t["profiles"] == 5 and t["T"] == [1, 2, 4, 6, 16]  # int4: even widths
    assert t["weights_bytes"] == graph.stat().st_size + graph.with_name(graph.name + ".data").stat().st_size
    assert 0 < t["int4_weight_bytes"] < t["weights_bytes"]
    assert t["fp16_engine_bytes_model"] == 400 and t["engine_over_fp16_engine"] == 0.3
    assert "INT4" in rep["summary"] and "0.3x the fp16 engine of model" in rep["summary"]
    assert "the fp16 weights" in ctx.results["trt-build/model"]["summary"]
