"""doctor, deployment presets (--config), the libcudart binding, and the GPU-only checks (skipped without one)."""

from __future__ import annotations

import ctypes.util
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specedge.runtime.config import SECTIONS, list_presets, load_config
from specedge.runtime.doctor import backend_verdicts, format_report, jetson_info, meminfo, report
from specedge.runtime.errors import BackendUnavailableError, SpecEdgeError


def _has_gpu() -> bool:
    try:
        from specedge.runtime.backends.cuda_rt import CudaRuntime

        CudaRuntime()
        return True
    except SpecEdgeError:
        return False


HAS_GPU = _has_gpu()
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU and libcudart (none here)")


# ---------------------------------------------------------------- doctor
def test_doctor_on_this_machine():
    rep = report()
    assert rep["backends"]["ort-cpu"]["ok"]
    assert rep["memory_gib"]["MemTotal"] > 0
    text = format_report(rep)
    for name in ("ort-cpu", "ort-cuda", "ort-trt", "trt"):
        assert name in text
    if importlib.util.find_spec("tensorrt") is None:
        assert not rep["backends"]["trt"]["ok"] and "TensorRT is not installed" in rep["backends"]["trt"]["why"]
    if not HAS_GPU:
        assert not rep["cuda"]["ok"] and rep["cuda"]["why"]
    from specedge.runtime.cpu import int16_pair_saturation

    assert rep["cpu"]["physical_cores"] >= 1 and rep["cpu"]["int16_pair_sums"] is int16_pair_saturation()
    assert ("int gemm    int16 pair sums" in text) is bool(int16_pair_saturation())
    k = rep["specedge_kernels"]  # a C compiler is part of this machine's setup: the kernels build and load
    assert k["ok"] and "scalar" in k["isas"] and "sek kernels built" in text, k


def test_doctor_cli_json():
    import json

    from specedge.export.cli import main

    r = CliRunner().invoke(main, ["doctor", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["backends"]["ort-cpu"]["ok"]


def _fake_jetson(root: Path, release: str, model: str) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc/nv_tegra_release").write_text(release)
    (root / "proc/device-tree").mkdir(parents=True)
    (root / "proc/device-tree/model").write_bytes(model.encode() + b"\0")
    (root / "proc/meminfo").write_text("MemTotal:        7990000 kB\nMemFree: 1 kB\nMemAvailable:    5100000 kB\n"
                                       "SwapTotal:       3995000 kB\n")
    (root / "var/lib/nvpmodel").mkdir(parents=True)
    (root / "var/lib/nvpmodel/status").write_text("pmode:0002 fmode:fanNull")
    return root


def test_doctor_reads_a_jetson(tmp_path):
    root = _fake_jetson(tmp_path, "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64\n",
                        "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super")
    j = jetson_info(root)
    assert j["l4t"] == "36.4.3" and j["jetpack"] == "6.2"
    assert j["model"].startswith("NVIDIA Jetson Orin Nano") and j["power_mode"] == "pmode:0002 fmode:fanNull"
    assert meminfo(root) == {"MemTotal": 7.62, "MemAvailable": 4.86, "SwapTotal": 3.81}
    rep = report(root)
    text = format_report(rep)
    assert "L4T 36.4.3, JetPack 6.2" in text and "(shared with the GPU)" in text
    v = rep["backends"]
    if importlib.util.find_spec("tensorrt") is None:
        assert "python3-libnvinfer" in v["trt"]["why"] or "nvidia-tensorrt" in v["trt"]["why"]
    if not v["ort-cuda"]["ok"] and "no CUDAExecutionProvider" in v["ort-cuda"]["why"]:
        assert "Jetson" in v["ort-cuda"]["why"]
    assert jetson_info(tmp_path / "nothing") is None
    thor = _fake_jetson(tmp_path / "thor", "# R38 (release), REVISION: 2.0\n", "NVIDIA Jetson AGX Thor Developer Kit")
    assert jetson_info(thor)["jetpack"] == "7.0"


def test_backend_verdicts_explain_why():
    rep = {"cuda": {"ok": True}, "ort_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
           "tensorrt": "broken (OSError: libnvinfer.so.10: cannot open shared object file)", "jetson": None,
           "onnxruntime": "1.20.0", "polygraphy": None}
    v = backend_verdicts(rep)
    assert v["ort-cuda"]["ok"] and not v["ort-trt"]["ok"]
    assert not v["trt"]["ok"] and "does not import" in v["trt"]["why"]
    assert not v["validate"]["ok"] and "specedge[validate]" in v["validate"]["why"]


# ---------------------------------------------------------------- presets
def test_every_preset_fits_its_commands():
    """Each preset's tables only name options of the command they configure (so none silently drifts)."""
    from specedge.export.cli import main as export_main
    from specedge.runtime.cli import main as run_main
    from specedge.runtime.memplan import Board

    commands = {"export": export_main.commands["export"], "build": export_main.commands["build"],
                "run": run_main.commands["generate"], "bench": run_main.commands["bench"]}
    names = list_presets()
    assert {"jetson-orin-nano-8gb", "jetson-agx-orin-64gb", "jetson-thor", "datacenter-gpu", "cpu"} <= set(names)
    for name in names:
        cfg = load_config(name)
        assert set(cfg) <= {*SECTIONS, "preset", "board"}
        assert "board" in cfg, name  # every preset says what memory the plan checks against
        Board.from_table(name, cfg["board"])
        for section, table in cfg.items():
            if section in ("preset", "board"):
                continue
            params = {p.name: p for p in commands[section].params}
            assert set(table) <= set(params), (name, section, set(table) - set(params))
            for key, value in table.items():  # values the option accepts
                p = params[key]
                if hasattr(p.type, "choices"):
                    assert value in p.type.choices, (name, key, value)


def test_config_sets_defaults_and_explicit_options_win(bundles, tmp_path):
    from specedge.runtime.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\nbackend = "ort-cpu"\ndrafter = "off"\nmax_new_tokens = 5\n')
    r = CliRunner().invoke(main, [str(bundles["lookup"]), "def fib(n):", "--config", str(cfg), "--stats-json"])
    assert r.exit_code == 0, r.output
    r2 = CliRunner().invoke(main, [str(bundles["lookup"]), "def fib(n):", "--config", str(cfg), "--max-new-tokens",
                                   "3", "--stats-json"])
    assert r2.exit_code == 0, r2.output
    import json

    stats = lambda res: json.loads(res.output[res.output.rindex('{"drafter"'):].splitlines()[0])  # noqa: E731
    s1, s2 = stats(r), stats(r2)
    assert s1["drafter"] == "none" and s1["new_tokens"] == 5 and s2["new_tokens"] == 3
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nwarp_speed = 9\n')
    r3 = CliRunner().invoke(main, [str(bundles["lookup"]), "x", "--config", str(bad)])
    assert r3.exit_code == 2 and "warp_speed" in r3.output
    bad.write_text("[run\n")
    assert "not valid TOML" in CliRunner().invoke(main, [str(bundles["lookup"]), "x", "--config", str(bad)]).output
    r4 = CliRunner().invoke(main, [str(bundles["lookup"]), "x", "--config", "no-such-preset"])
    assert r4.exit_code == 2 and "jetson-orin-nano-8gb" in r4.output


# ---------------------------------------------------------------- CUDA binding
@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_cuda_binding_without_a_gpu_says_so():
    from specedge.runtime.backends.cuda_rt import CudaRuntime

    with pytest.raises(BackendUnavailableError, match="libcudart was not found|sees no GPU"):
        CudaRuntime()


@pytest.mark.skipif(ctypes.util.find_library("cudart") is None and not Path("/usr/local/cuda/lib64").is_dir(),
                    reason="libcudart is not installed here")
def test_cuda_binding_loads_libcudart_and_names_errors():
    from specedge.runtime.backends import cuda_rt

    rt = object.__new__(cuda_rt.CudaRuntime)  # load the library without asking for a device
    for name in cuda_rt._candidates():
        try:
            rt._lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        pytest.skip("no loadable libcudart")
    rt._lib.cudaGetErrorName.restype = rt._lib.cudaGetErrorString.restype = ctypes.c_char_p
    rt._lib.cudaGetErrorName.argtypes = rt._lib.cudaGetErrorString.argtypes = [ctypes.c_int]
    with pytest.raises(cuda_rt.CudaError, match=r"cudaMalloc failed: cudaErrorMemoryAllocation \(out of memory\)"):
        rt._check(2, "cudaMalloc")


@pytest.mark.gpu
@gpu
def test_cuda_binding_strided_kv_copy_on_the_gpu():
    """One cudaMemcpy2D moves the n new rows of every layer into the cache (the TensorRT backend's commit)."""
    from specedge.runtime.backends.cuda_rt import D2D, D2H, H2D, CudaRuntime

    c = CudaRuntime()
    rows, S, T, D, n, past = 12, 64, 9, 16, 5, 20
    kv = np.random.default_rng(0).normal(size=(rows, S, D)).astype(np.float16)
    new = np.random.default_rng(1).normal(size=(rows, T, D)).astype(np.float16)
    d_kv, d_new = c.malloc(kv.nbytes), c.malloc(new.nbytes)
    s = c.stream_create()
    c.memcpy(d_kv, kv.ctypes.data, kv.nbytes, H2D)
    c.memcpy(d_new, new.ctypes.data, new.nbytes, H2D)
    row = D * 2
    c.memcpy2d(d_kv + past * row, S * row, d_new, T * row, n * row, rows, D2D, s)
    c.synchronize(s)
    out = np.empty_like(kv)
    c.memcpy(out.ctypes.data, d_kv, kv.nbytes, D2H)
    want = kv.copy()
    want[:, past:past + n] = new[:, :n]
    np.testing.assert_array_equal(out, want)
    for p in (d_kv, d_new):
        c.free(p)
    c.stream_destroy(s)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None or not HAS_GPU,
                    reason="needs TensorRT and an NVIDIA GPU (run tools/gpu/gpu_check.sh on one)")
def test_trt_engine_greedy_matches_onnx_runtime(bundles, tmp_path):
    import shutil

    from specedge.export.engines import build_trt
    from specedge.runtime import SamplingParams, SpecDecoder

    b = tmp_path / "b"
    shutil.copytree(bundles["model"], b)
    build_trt(b)
    trt_dec = SpecDecoder.load(b, backend="trt")
    ref = SpecDecoder.load(b, backend="ort-cpu", precision="fp16")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = trt_dec.generate("def fib(n):", params, drafter="none").token_ids
    assert trt_dec.generate("def fib(n):", params, drafter="model", k=4).token_ids == plain
    assert len(ref.generate("def fib(n):", params, drafter="none").token_ids) == len(plain)
    trt_dec.close()


# ---------------------------------------------------------------- the TensorRT backend's KV commit
class _HostMemory:
    """memcpy2d over one numpy byte buffer; "pointers" are offsets into it (cudaMemcpy2D's semantics)."""

    def __init__(self, nbytes: int):
        self.mem = np.zeros(nbytes, dtype=np.uint8)
        self.calls = 0

    def memcpy2d(self, dst, dpitch, src, spitch, width, height, kind=3, stream=0):  # defaults as CudaRuntime
        assert width <= dpitch and width <= spitch
        self.calls += 1
        for r in range(height):
            self.mem[dst + r * dpitch:dst + r * dpitch + width] = self.mem[src + r * spitch:src + r * spitch + width]

    def synchronize(self, stream=0):
        pass


@pytest.mark.parametrize("H, T, n, past", [(2, 9, 9, 0), (2, 9, 3, 17), (2, 1, 1, 63), (2, 16, 11, 40),
                                            (3, 1, 1, 10), (3, 9, 4, 50)])
def test_trt_kv_commit(H, T, n, past):
    """The engine writes present.{i}.{key,value} [H, T, D] at present_address(...); commit() must land the
    first n rows of each at positions past.. of cache.{i}.{key,value} [H, S, D] and touch nothing else —
    in one copy where the tensors pack without padding, else one per tensor; every address 256-byte aligned."""
    from specedge.runtime.backends.trt import ALIGN, KvLayout

    L, D, S = 3, 64, 64
    lay = KvLayout(L, H, D, S, itemsize=2)
    cache_base, new_base = 0, lay.cache_bytes()
    mem = _HostMemory(lay.cache_bytes() + lay.new_bytes(16))
    rng = np.random.default_rng(T + n + past)
    cache = {}
    for i in range(L):
        for j in range(2):
            c = rng.normal(size=(H, S, D)).astype(np.float16)
            a = lay.past_address(cache_base, i, j)
            p = rng.normal(size=(H, T, D)).astype(np.float16)
            b = lay.present_address(new_base, i, j, T)
            assert a % ALIGN == 0 and b % ALIGN == 0
            mem.mem[a:a + c.nbytes] = c.view(np.uint8).ravel()
            mem.mem[b:b + p.nbytes] = p.view(np.uint8).ravel()
            cache[i, j] = (c, p)
    lay.commit(mem, cache_base, new_base, T, past, n, stream=0)
    assert mem.calls == lay.copies(T) == (1 if (H * T) % 2 == 0 else 2 * L)  # D=64 fp16: 128-byte rows
    for (i, j), (c, p) in cache.items():
        a = lay.past_address(cache_base, i, j)
        got = mem.mem[a:a + c.nbytes].view(np.float16).reshape(H, S, D)
        want = c.copy()
        want[:, past:past + n] = p[:, :n]
        np.testing.assert_array_equal(got, want)


def test_ort_cuda_commit_copies_the_new_rows_into_each_cache_tensor(bundles):
    """The ort-cuda runner's device commit (one 2-D copy per tensor between OrtValues on the GPU), run against the
    byte-buffer model of cudaMemcpy2D: the call it makes must exist on the binding and land the rows right."""
    import types

    from specedge.runtime.backends.cuda_rt import CudaRuntime
    from specedge.runtime.backends.ort import OrtRunner
    from specedge.runtime.manifest import read_manifest

    m = read_manifest(bundles["model"])
    r = OrtRunner(bundles["model"], m, "target")
    d, S, T, n, past = m.target.dims, m.max_context, 9, 4, 30
    H, D = d.n_kv_heads, d.head_dim
    tensors = 2 * d.n_layers
    cache_bytes, new_bytes = H * S * D * 4, H * T * D * 4
    mem = _HostMemory(tensors * (cache_bytes + new_bytes))
    ptr = lambda off: types.SimpleNamespace(data_ptr=lambda: off)  # noqa: E731  (an OrtValue's device address)
    rng = np.random.default_rng(0)
    caches = [rng.normal(size=(H, S, D)).astype(np.float32) for _ in range(tensors)]
    news = [rng.normal(size=(H, T, D)).astype(np.float32) for _ in range(tensors)]
    for t in range(tensors):
        mem.mem[t * cache_bytes:(t + 1) * cache_bytes] = caches[t].view(np.uint8).ravel()
        o = tensors * cache_bytes + t * new_bytes
        mem.mem[o:o + new_bytes] = news[t].view(np.uint8).ravel()
    assert all(hasattr(CudaRuntime, f) for f in ("memcpy2d", "synchronize"))
    r.device, r._cuda = "cuda", mem
    r._kv_values = [ptr(t * cache_bytes) for t in range(tensors)]
    bound = types.SimpleNamespace(width=next(w for w in m.target.widths if w.T == T),
                                  present=[ptr(tensors * cache_bytes + t * new_bytes) for t in range(tensors)])
    r._commit_rows(bound, past, n)
    assert mem.calls == tensors
    for t in range(tensors):
        got = mem.mem[t * cache_bytes:(t + 1) * cache_bytes].view(np.float32).reshape(H, S, D)
        want = caches[t].copy()
        want[:, past:past + n] = news[t][:, :n]
        np.testing.assert_array_equal(got, want)


def test_int16_pair_saturation_is_read_from_the_cpu_flags(monkeypatch):
    """Which CPUs add uint8 x int8 products in saturating int16 pairs (x86 without VNNI), the condition under which
    an old full-range integer-GEMM bundle is refused."""
    import specedge.runtime.cpu as cpu

    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    for flags, expect in (({"avx2", "fma"}, True), ({"avx2", "avx512f", "avx512bw"}, True),
                          ({"avx2", "avx_vnni"}, False), ({"avx512f", "avx512_vnni"}, False), (None, None)):
        monkeypatch.setattr(cpu, "cpu_features", lambda f=flags: f)
        assert cpu.int16_pair_saturation() is expect, flags
    monkeypatch.setattr(cpu.platform, "machine", lambda: "aarch64")  # Jetson: int32 dot products
    assert cpu.int16_pair_saturation() is False
    assert cpu.physical_cores() >= 1


def test_ort_sessions_stop_spinning_when_a_step_returns(bundles):
    """The draft and the target alternate, each with its own thread pool: a pool still spinning after its step takes a
    core from the other model's step (on 2 cores a draft step ran 1.7x slower and the verify after it 1.6x). Both
    sessions spin within a step and stop when it returns."""
    from specedge.runtime import SpecDecoder

    dec = SpecDecoder.load(bundles["model"], backend="ort-cpu")
    for runner in (dec.target, dec.draft_runner):
        so = runner.session.get_session_options()
        assert so.get_session_config_entry("session.force_spinning_stop") == "1"
        assert so.get_session_config_entry("session.intra_op.allow_spinning") == "1"
