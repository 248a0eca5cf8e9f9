"""The TensorRT build's orchestration, driven through a stand-in `tensorrt` module (no GPU here).

This checks *our* side of the calls — a strongly typed network, one profile per width with
min = opt = max, the workspace cap, the timing cache read and written back, parser errors and the
out-of-memory hint — not TensorRT itself; tools/gpu/gpu_check.sh builds real engines.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from specedge.export.engines import OOM_HINT, BuildError, TrtBuildOptions, _build_one, trt_profiles
from specedge.runtime.manifest import read_manifest


class _Severity:
    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)


class _ILogger:
    Severity = _Severity

    def __init__(self):
        pass


class _IProgressMonitor:
    def __init__(self):
        pass


def fake_trt(parse_ok: bool = True, build_log: tuple = (), plan: bytes | None = b"PLAN",
             version: str = "10.3.0.30") -> types.SimpleNamespace:
    rec: dict = {"profiles": [], "cache_in": None}

    class Profile:
        def __init__(self):
            self.shapes = {}
            self.extra_memory_target = 1.0  # TensorRT's default

        def set_shape(self, name, mn, opt, mx):
            self.shapes[name] = (tuple(mn), tuple(opt), tuple(mx))

    class Cache:
        def __init__(self, data):
            self.data = data

        def serialize(self):
            return memoryview(self.data + b"+new")

    class Config:
        progress_monitor = None
        builder_optimization_level = 3

        def set_memory_pool_limit(self, pool, size):
            rec["workspace"] = (pool, size)

        def create_timing_cache(self, data):
            rec["cache_in"] = bytes(data)
            return Cache(bytes(data))

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache

        def get_timing_cache(self):
            return self.cache

        def add_optimization_profile(self, p):
            rec["profiles"].append(p.shapes)
            rec.setdefault("extra_memory_target", []).append(getattr(p, "extra_memory_target", None))

        def clear_flag(self, flag):
            rec["cleared"] = flag

    class Builder:
        def __init__(self, logger):
            self.logger = logger

        def create_network(self, flags):
            rec["flags"] = flags
            return object()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            rec["monitor"] = config.progress_monitor
            if config.progress_monitor is not None:
                m = config.progress_monitor
                m.phase_start("Building engine", None, 10)
                for i in range(10):
                    assert m.step_complete("Building engine", i)
                m.phase_finish("Building engine")
            for sev, msg in build_log:
                self.logger.log(sev, msg)
            return plan

    class Err:
        def desc(self):
            return "Unsupported ONNX data type: UINT8 (2)"

    class OnnxParser:
        num_errors = 0 if parse_ok else 1

        def __init__(self, network, logger):
            pass

        def parse_from_file(self, path):
            rec["parsed"] = path
            return parse_ok

        def get_error(self, i):
            return Err()

    return types.SimpleNamespace(
        __version__=version, rec=rec, Builder=Builder, BuilderFlag=types.SimpleNamespace(TF32="tf32"),
        OnnxParser=OnnxParser, ILogger=_ILogger,
        IProgressMonitor=_IProgressMonitor, NetworkDefinitionCreationFlag=types.SimpleNamespace(STRONGLY_TYPED=1),
        MemoryPoolType=types.SimpleNamespace(WORKSPACE="workspace"))


@pytest.fixture(scope="module")
def manifest_and_profiles(bundles):
    m = read_manifest(bundles["model"])
    return m, trt_profiles(m, "target")


def test_build_sets_profiles_workspace_and_timing_cache(manifest_and_profiles, tmp_path):
    m, profiles = manifest_and_profiles
    trt = fake_trt()
    cache = tmp_path / "timing.cache"
    cache.write_bytes(b"old")
    said: list[str] = []
    out = tmp_path / "target.engine"
    size = _build_one(trt, Path("target.fp16.onnx"), profiles, TrtBuildOptions(workspace_gb=1.5), cache, said.append,
                      out)
    assert out.read_bytes() == b"PLAN" and size == 4  # written straight to the file
    assert trt.rec["cleared"] == "tf32"
    assert trt.rec["extra_memory_target"][1:] == [0.0] * (len(profiles) - 1)  # no extra copies past profile 0
    r = trt.rec
    assert r["flags"] == 1 << 1  # STRONGLY_TYPED
    assert r["workspace"] == ("workspace", int(1.5 * 2**30))
    assert r["cache_in"] == b"old" and cache.read_bytes() == b"old+new"  # reused, then persisted
    assert len(r["profiles"]) == len(m.target.widths)
    for w, prof in zip(m.target.widths, r["profiles"]):
        assert prof["input_ids"] == ((1, w.T),) * 3 and prof["logits_at"] == ((1, w.L),) * 3
        assert prof["past_key_values.0.key"][0][2] == m.max_context
    assert any("Building engine: 10/10" in s for s in said) and any("done" in s for s in said)


def test_build_failures_are_explained(manifest_and_profiles, tmp_path):
    _, profiles = manifest_and_profiles
    opts = TrtBuildOptions()
    with pytest.raises(BuildError, match="ONNX parser rejected target.onnx: Unsupported ONNX data type"):
        _build_one(fake_trt(parse_ok=False), Path("target.onnx"), profiles, opts, tmp_path / "c", lambda s: None,
                   tmp_path / "e")
    oom = ((_Severity.ERROR, "[optimizer.cpp::computeCosts::3728] Error Code 10: Internal Error (Could not find any "
                             "implementation for node {ForeignNode[...]}.)"),)
    with pytest.raises(BuildError) as e:
        _build_one(fake_trt(build_log=oom, plan=None), Path("t.onnx"), profiles, opts, tmp_path / "c", lambda s: None,
                   tmp_path / "e")
    assert OOM_HINT in str(e.value) and "Could not find any implementation" in str(e.value)
    other = ((_Severity.ERROR, "Network validation failed."),)
    with pytest.raises(BuildError, match="TensorRT said: Network validation failed") as e:
        _build_one(fake_trt(build_log=other, plan=None), Path("t.onnx"), profiles, opts, tmp_path / "c",
                   lambda s: None, tmp_path / "e")
    assert OOM_HINT not in str(e.value)
    assert not (tmp_path / "c").exists()  # a failed build leaves no timing cache behind
    with pytest.raises(BuildError, match=r"TensorRT 8.6.1 is too old: specedge needs TensorRT >= 10.3.*JetPack 6.1"):
        _build_one(fake_trt(version="8.6.1"), Path("t.onnx"), profiles, opts, tmp_path / "c", lambda s: None,
                   tmp_path / "e")
