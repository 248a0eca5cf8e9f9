"""TrtRunner's execution contexts and CUDA graphs, driven through stand-ins for `tensorrt` and libcudart (no GPU here).

This checks *our* side of the calls — one execution context per width, bound once (profile, shapes, addresses) at
construction, steps that only pick a context and execute or replay, one shared scratch for every context, a CUDA graph
captured once per width and replayed, a refused capture falling back with its reason — not TensorRT or CUDA
themselves; tools/gpu/gpu_check.sh runs real engines.
"""

from __future__ import annotations

import ctypes
import types
from collections import Counter
from types import SimpleNamespace

import pytest

from specedge.runtime.backends import cuda_rt
from specedge.runtime.backends.cuda_rt import CudaError, CudaRuntime
from specedge.runtime.backends.trt import SharedScratch, TrtRunner
from specedge.runtime.errors import BundleError, SpecEdgeError
from specedge.runtime.manifest import EngineSet, ModelDims, ModelEntry, Width, io_spec, width_shapes

pytestmark = pytest.mark.fast  # torch-free: make test-fast

S_MAX = 64
STREAM = 0x5EED
WIDTHS = {"target": (Width("decode", 1, 1), Width("verify", 2, 2), Width("verify", 5, 5), Width("prefill", 8, 1)),
          "draft": (Width("decode", 1, 1), Width("prefill", 8, 1))}
DIMS = {"target": ModelDims(2, 64, 4, 2, 16, 128, 32), "draft": ModelDims(1, 32, 4, 2, 16, 64, 32)}
SCRATCH = {"target": 4096, "draft": 12288}  # the draft, opened second, needs more: the scratch grows and re-attaches
SETTERS = ("set_optimization_profile_async", "set_input_shape", "set_tensor_address")


class FakeCuda:
    """CudaRuntime's surface as the runner uses it; device pointers are fake, pinned host memory is real."""

    def __init__(self, log: list, capture_error: str | None = None):
        self.log, self.capture_error = log, capture_error
        self.live: dict[int, int] = {}  # device pointer -> bytes
        self.host: dict[int, ctypes.Array] = {}
        self.graphs: set[int] = set()
        self.execs: set[int] = set()
        self.capturing = False
        self.copies: list[tuple[int, int, int, int]] = []  # (dst, src, bytes, kind) of every memcpy
        self._next = 1 << 20

    def _handle(self, nbytes: int = 256) -> int:
        p, self._next = self._next, self._next + -(-nbytes // 256) * 256 + 256
        return p

    def compute_capability(self):
        return "8.7"

    def device_name(self):
        return "Fake Orin"

    def malloc(self, nbytes):
        p = self._handle(nbytes)
        self.live[p] = nbytes
        return p

    def free(self, ptr):
        if ptr:
            del self.live[ptr]

    def malloc_host(self, nbytes):
        buf = ctypes.create_string_buffer(nbytes)
        self.host[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free_host(self, ptr):
        del self.host[ptr]

    def _enqueue(self, what, stream):
        assert stream == STREAM and not self.capturing, f"{what} under capture"  # only TensorRT's work is captured
        self.log.append((what,))

    def memcpy(self, dst, src, nbytes, kind, stream=None):
        self._enqueue("memcpy", stream)
        self.copies.append((dst, src, nbytes, kind))

    def memcpy2d(self, dst, dpitch, src, spitch, width, height, kind, stream):
        self._enqueue("memcpy2d", stream)

    def memset(self, ptr, value, nbytes, stream=0):
        self._enqueue("memset", stream)

    def synchronize(self, stream=0):
        self._enqueue("sync", stream)

    def begin_capture(self, stream):
        assert stream == STREAM and not self.capturing
        self.capturing = True
        self.log.append(("begin_capture",))

    def end_capture(self, stream):
        assert self.capturing
        self.capturing = False
        self.log.append(("end_capture",))
        if self.capture_error:
            raise CudaError(f"cudaStreamEndCapture failed: {self.capture_error}")
        g = self._handle()
        self.graphs.add(g)
        return g

    def graph_instantiate(self, graph):
        assert graph in self.graphs
        e = self._handle()
        self.execs.add(e)
        self.log.append(("instantiate", e))
        return e

    def graph_launch(self, graph_exec, stream):
        assert graph_exec in self.execs
        self._enqueue("launch", stream)
        self.log[-1] = ("launch", graph_exec)

    def graph_exec_destroy(self, graph_exec):
        if graph_exec:
            self.execs.remove(graph_exec)

    def graph_destroy(self, graph):
        if graph:
            self.graphs.remove(graph)


def fake_trt(cuda: FakeCuda, refuse: str | None = None, capture_ok: bool = True,
             argmax: bool = False) -> types.SimpleNamespace:
    """A `tensorrt` module whose engines match the test manifest; refuse: "profile" | "shape" | "address" makes the
    matching setter return False (TensorRT's way to say no); capture_ok False: execute_async_v3 fails under capture."""
    log = cuda.log

    class Context:
        def __init__(self, engine):
            self.engine, self.id, self.memory = engine, len(engine.contexts), None
            engine.contexts.append(self)

        def _call(self, what, *args):
            log.append((what, self.engine.role, self.id, *args))

        def set_device_memory(self, ptr, size):
            self.memory = (ptr, size)

        def set_optimization_profile_async(self, index, stream):
            assert stream == STREAM
            self._call("set_optimization_profile_async", index)
            if refuse == "profile-raises":  # what TensorRT's binding does (PY_ASSERT_RUNTIME_ERROR on a false)
                raise RuntimeError("setOptimizationProfileAsync failed")
            return refuse != "profile"

        def set_input_shape(self, name, shape):
            self._call("set_input_shape", name, tuple(shape))
            return not (refuse == "shape" and name == "input_ids")

        def set_tensor_address(self, name, ptr):
            self._call("set_tensor_address", name, ptr)
            return not (refuse == "address" and name == "logits")

        def execute_async_v3(self, stream):
            assert stream == STREAM and self.memory is not None
            self._call("execute", cuda.capturing)
            return capture_ok or not cuda.capturing

    class Engine:
        def __init__(self, role):
            self.role, self.contexts = role, []
            ins, outs = io_spec(DIMS[role], "portable", "float16", argmax)
            self.tensors = {s.name: ("in", s.dtype) for s in ins} | {s.name: ("out", s.dtype) for s in outs}
            self.names = list(self.tensors)
            self.num_io_tensors = len(self.names)
            self.num_optimization_profiles = len(WIDTHS[role])
            self.device_memory_size_v2 = SCRATCH[role]

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_mode(self, name):
            return self.tensors[name][0]

        def get_tensor_dtype(self, name):
            return self.tensors[name][1]

        def get_tensor_shape(self, name):
            return [-1]

        def get_tensor_profile_shape(self, name, p):
            return [width_shapes(DIMS[self.role], WIDTHS[self.role][p], S_MAX)[name]] * 3

        def create_execution_context(self, strategy):
            assert strategy == "user-managed"
            return Context(self)

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, buf):
            return Engine(bytes(buf[:]).decode())

    class Logger:
        WARNING = 2

        def __init__(self, severity):
            pass

    return types.SimpleNamespace(
        __version__="10.3.0.30", Logger=Logger, Runtime=Runtime,
        ExecutionContextAllocationStrategy=SimpleNamespace(USER_MANAGED="user-managed"),
        TensorIOMode=SimpleNamespace(INPUT="in", OUTPUT="out"),
        float32="float32", float16="float16", int64="int64", int32="int32", bool="bool")


@pytest.fixture
def bundle(tmp_path):
    for role in WIDTHS:
        (tmp_path / f"{role}.engine").write_text(role)  # what the fake runtime "deserializes"
    models = {role: ModelEntry("llama", DIMS[role], f"{role}.onnx", None, "fp16", WIDTHS[role]) for role in WIDTHS}
    manifest = SimpleNamespace(models=models, max_context=S_MAX, device_argmax=False)
    engines = EngineSet("trt", "fp16", "float16", {r: f"{r}.engine" for r in WIDTHS}, {r: "x" for r in WIDTHS},
                        tensorrt="10.3.0.30", gpu={"name": "Fake Orin", "compute_capability": "8.7"})
    return tmp_path, manifest, engines


def open_pair(monkeypatch, bundle, cuda_graphs=True, **fake):
    """Target and draft of one bundle on one shared dict, as SpecDecoder.load opens them."""
    log: list = []
    cuda = FakeCuda(log, fake.pop("capture_error", None))
    trt = fake_trt(cuda, **fake)
    monkeypatch.setattr("specedge.runtime.backends.trt.import_tensorrt", lambda: trt)
    shared = {"cuda": cuda, "stream": STREAM, "scratch": SharedScratch(cuda)}
    d, m, es = bundle
    runners = {role: TrtRunner(d, m, role, es, shared, cuda_graphs=cuda_graphs) for role in WIDTHS}
    return runners, shared, cuda, log


def contexts(runner) -> list:
    return runner.engine.contexts


# (role, tokens, all_logits, the width it must run at): target and draft interleaved, widths alternating
ROUNDS = [("target", 3, True, 5), ("draft", 1, False, 1), ("target", 8, False, 8), ("draft", 6, False, 8),
          ("target", 2, True, 2), ("draft", 1, False, 1), ("target", 1, False, 1), ("target", 5, True, 5)]


def run_rounds(runners, times=3):
    for _ in range(times):
        for role, n, all_logits, _T in ROUNDS:
            runners[role].step(list(range(3, 3 + n)), 10, all_logits)


def test_one_context_per_width_each_bound_once_at_construction(monkeypatch, bundle):
    runners, shared, cuda, log = open_pair(monkeypatch, bundle, cuda_graphs=False)
    for role, r in runners.items():
        ctxs = contexts(r)
        assert len(ctxs) == len(WIDTHS[role])  # one context per width = per optimization profile
        names = set(r.engine.names)
        for p, (ctx, w) in enumerate(zip(ctxs, WIDTHS[role])):
            calls = [c for c in log if c[1:3] == (role, ctx.id)]
            assert [c[3] for c in calls if c[0] == "set_optimization_profile_async"] == [p]  # its own profile, once
            shapes = Counter(c[3] for c in calls if c[0] == "set_input_shape")
            assert shapes == Counter(set(width_shapes(DIMS[role], w, S_MAX)))  # every input once
            assert dict(c[3:5] for c in calls if c[0] == "set_input_shape") == width_shapes(DIMS[role], w, S_MAX)
            addrs = Counter(c[3] for c in calls if c[0] == "set_tensor_address")
            assert addrs == Counter(names)  # every tensor once
    last_select = max(i for i, c in enumerate(log) if c[0] == "set_optimization_profile_async")
    assert ("sync",) in log[last_select:]  # the asynchronous profile selections are done before any step

    del log[:]
    run_rounds(runners)
    assert not [c for c in log if c[0] in SETTERS]  # a step binds nothing: no profile switch, shape or address
    runs = [c for c in log if c[0] in ("execute", "launch")]
    assert len(runs) == 3 * len(ROUNDS)
    for (role, _n, _a, T), c in zip(ROUNDS * 3, runs):  # each step ran the context of its width, and only it
        assert c[1] == role and WIDTHS[role][c[2]].T == T
    assert all(v.startswith("plain execute") and "cuda_graphs=False" in v
               for r in runners.values() for v in r.graph_status.values())
    assert not [c for c in log if c[0] == "begin_capture"]


def test_every_context_shares_one_scratch_of_the_largest_size(monkeypatch, bundle):
    runners, shared, cuda, log = open_pair(monkeypatch, bundle)
    scratch = shared["scratch"]
    assert scratch.size == max(SCRATCH.values()) and scratch.ptr in cuda.live
    every = [ctx for r in runners.values() for ctx in contexts(r)]
    assert len(every) == sum(len(w) for w in WIDTHS.values())
    assert all(ctx.memory == (scratch.ptr, scratch.size) for ctx in every)  # re-pointed when the draft grew it
    assert sum(1 for n in cuda.live.values() if n in SCRATCH.values()) == 1  # the smaller first allocation is gone


@pytest.mark.parametrize("refuse, message", [
    ("profile", r"TensorRT refused optimization profile 0 \(T=1\)"),
    ("shape", r"TensorRT refused shape \(1, 1\) for input_ids \(profile 0, T=1\)"),
    ("address", r"TensorRT refused the address of logits \(profile 0, T=1\)"),
    ("profile-raises", r"TensorRT refused optimization profile 0 \(T=1\): setOptimizationProfileAsync failed"),
    ("oom", r"cudaMalloc failed")])
def test_a_refused_binding_is_a_bundle_error_and_frees_what_was_allocated(monkeypatch, bundle, refuse, message):
    """Every failure while a runner opens frees its device and pinned memory (a RuntimeError from TensorRT and an
    out-of-memory cudaMalloc escaped without it, until review found it)."""
    from specedge.runtime.backends.cuda_rt import CudaError

    log: list = []
    cuda = FakeCuda(log)
    trt = fake_trt(cuda, refuse=None if refuse == "oom" else refuse)
    monkeypatch.setattr("specedge.runtime.backends.trt.import_tensorrt", lambda: trt)
    shared = {"cuda": cuda, "stream": STREAM, "scratch": SharedScratch(cuda)}
    if refuse == "oom":  # the fourth device buffer does not fit
        real, n = cuda.malloc, [0]

        def malloc(nbytes):
            n[0] += 1
            if n[0] == 4:
                raise CudaError("cudaMalloc failed: cudaErrorMemoryAllocation (out of memory)")
            return real(nbytes)
        cuda.malloc = malloc
    with pytest.raises((BundleError, CudaError), match=message):
        TrtRunner(bundle[0], bundle[1], "target", bundle[2], shared)
    assert set(cuda.live) <= {shared["scratch"].ptr} and not cuda.host  # only the decoder's scratch is left


def test_cuda_graph_captured_once_per_width_then_replayed(monkeypatch, bundle):
    runners, shared, cuda, log = open_pair(monkeypatch, bundle)
    del log[:]
    run_rounds(runners, times=1)
    for role, r in runners.items():  # every width met once: captured after a plain execute at that width
        assert r.graph_status == {w.T: "captured" for w in WIDTHS[role] if any(
            x[0] == role and x[3] == w.T for x in ROUNDS)}
    first = log[:log.index(("end_capture",)) + 2]
    assert [c[0] for c in first] == ["memcpy", "execute", "sync", "begin_capture", "execute", "end_capture",
                                     "instantiate"]  # warm-up execute, then capture on a synchronized stream
    assert [c[-1] for c in first if c[0] == "execute"] == [False, True]  # the second one under capture
    widths_met = {(role, T) for role, _n, _a, T in ROUNDS}
    assert sum(c[0] == "begin_capture" for c in log) == len(cuda.execs) == len(widths_met)
    assert not cuda.graphs  # graph templates are destroyed once instantiated

    del log[:]
    run_rounds(runners, times=2)
    assert not [c for c in log if c[0] in ("execute", "begin_capture", *SETTERS)]  # replays only
    launches = Counter(c[1] for c in log if c[0] == "launch")
    assert set(launches) == cuda.execs and sum(launches.values()) == 2 * len(ROUNDS)
    for role, r in runners.items():
        for T in r.graph_status:
            steps = 2 * sum(1 for x in ROUNDS if x[0] == role and x[3] == T)
            exe = next(p.graph for p in r._profiles if p.width.T == T)
            assert launches[exe] == steps

    for r in runners.values():
        r.close()
    assert not cuda.execs and not cuda.graphs and not cuda.host  # graphs destroyed, buffers freed
    shared["scratch"].close()  # what SpecDecoder.close does after closing its runners
    assert not cuda.live


@pytest.mark.parametrize("fake, why", [
    ({"capture_ok": False}, "execute_async_v3 returned False under stream capture"),
    ({"capture_error": "cudaErrorStreamCaptureInvalidated (operation failed due to a previous error during capture)"},
     "cudaErrorStreamCaptureInvalidated")])
def test_refused_capture_falls_back_to_plain_execute_and_says_why(monkeypatch, bundle, fake, why):
    runners, shared, cuda, log = open_pair(monkeypatch, bundle, **fake)
    t = runners["target"]
    for _ in range(3):
        t.step([1, 2, 3], 0, True)
    assert t.graph_status[5].startswith("plain execute") and why in t.graph_status[5]
    assert sum(c[0] == "begin_capture" for c in log) == 1  # tried once, not at every step
    assert [c[-1] for c in log if c[0] == "execute"] == [False, True, False, False]  # then plain executes
    assert not cuda.capturing and not cuda.graphs and not cuda.execs  # nothing left behind by the failed capture
    t.close()


def test_graph_is_recaptured_when_the_shared_scratch_moves(monkeypatch, bundle):
    runners, shared, cuda, log = open_pair(monkeypatch, bundle)
    t = runners["target"]
    t.step([1, 2], 0, True)
    old = next(p.graph for p in t._profiles if p.width.T == 2)
    shared["scratch"].attach(SimpleNamespace(), 2 * max(SCRATCH.values()))  # a later, larger context: the scratch moves
    del log[:]
    t.step([1, 2], 0, True)
    assert old not in cuda.execs and sum(c[0] == "begin_capture" for c in log) == 1 and t.graph_status[2] == "captured"
    assert [c[0] for c in log].count("execute") == 2  # the plain warm-up on the new scratch, then the capture


def test_cuda_graphs_flag_reaches_the_runner(monkeypatch, bundle):
    from specedge.runtime import decoder
    from specedge.runtime.backends import open_runner

    seen = []
    monkeypatch.setattr("specedge.runtime.backends.trt.TrtRunner",
                        lambda *a, **kw: seen.append(kw.get("cuda_graphs", a[5] if len(a) > 5 else None)))
    m = SimpleNamespace(engine_set=lambda kind, precision: bundle[2])
    open_runner("trt", bundle[0], m, "target", shared={}, cuda_graphs=False)
    open_runner("trt", bundle[0], m, "target")
    assert seen == [False, True]

    class Stop(Exception):
        pass

    def fake_open(*a, **kw):
        seen.append(kw.get("cuda_graphs"))
        raise Stop

    monkeypatch.setattr(decoder, "read_manifest", lambda *a, **kw: SimpleNamespace(target=SimpleNamespace(quant=None),
                                                                               draft=None, files={}))
    monkeypatch.setattr(decoder, "resolve_backend", lambda name, m: "trt")
    import specedge.runtime.backends as backends

    monkeypatch.setattr(backends, "open_runner", fake_open)  # what SpecDecoder.load's open_runners calls
    with pytest.raises(Stop):
        decoder.SpecDecoder.load(bundle[0], backend="trt", cuda_graphs=False)
    assert seen[-1] is False


def check_cuda_graphs_flag(monkeypatch, args: list[str]) -> None:
    """--cuda-graphs/--no-cuda-graphs of a spec-run command reaches SpecDecoder.load."""
    from click.testing import CliRunner

    from specedge.runtime.cli import main
    from specedge.runtime.decoder import SpecDecoder

    seen = []

    def load(cls, bundle, **kw):
        seen.append(kw.get("cuda_graphs"))
        raise SpecEdgeError("stop here")

    monkeypatch.setattr(SpecDecoder, "load", classmethod(load))
    for flag, want in (([], True), (["--no-cuda-graphs"], False), (["--cuda-graphs"], True)):
        r = CliRunner().invoke(main, [*args, *flag], input="")
        assert r.exit_code == 2 and "stop here" in r.output, r.output
        assert seen.pop() is want


@pytest.mark.parametrize("command", [["generate", "B", "hi"], ["chat", "B"]])
def test_cli_no_cuda_graphs(monkeypatch, command):
    """(bench checks its prompts against a real bundle before loading: tests/runtime/test_bench.py.)"""
    check_cuda_graphs_flag(monkeypatch, command)


def test_cuda_graph_binding(monkeypatch):
    """The libcudart declarations: CUDA 12's 3-argument instantiate, a failed capture cleaned up and reported."""
    calls = []

    class Fn:
        def __init__(self, name, impl=None):
            self.name, self.impl = name, impl

        def __call__(self, *args):
            calls.append((self.name, args))
            return self.impl(*args) if self.impl else 0

    def out(ref, value):  # write through a ctypes.byref(...) argument
        ref._obj.value = value
        return 0

    lib = SimpleNamespace()
    impls = {"cudaGetDeviceCount": lambda n: out(n, 1),
             "cudaGetErrorName": lambda rc: b"cudaErrorStreamCaptureInvalidated",
             "cudaGetErrorString": lambda rc: b"capture invalidated",
             "cudaStreamEndCapture": lambda s, g: 901,  # no graph, cudaErrorStreamCaptureInvalidated
             "cudaGraphInstantiateWithFlags": lambda e, g, flags: out(e, 0xE0)}
    monkeypatch.setattr(ctypes, "CDLL", lambda name: lib)
    monkeypatch.setattr(cuda_rt, "_candidates", lambda: ["libcudart.so.12"])
    names = ("cudaGetDeviceCount cudaSetDevice cudaDriverGetVersion cudaRuntimeGetVersion cudaDeviceGetAttribute "
             "cudaMemGetInfo cudaMalloc cudaFree cudaMallocHost cudaFreeHost cudaMemcpy cudaMemcpyAsync "
             "cudaMemcpy2DAsync cudaMemsetAsync cudaStreamCreateWithFlags cudaStreamDestroy cudaStreamSynchronize "
             "cudaDeviceSynchronize cudaGetErrorName cudaGetErrorString cudaGetLastError cudaStreamBeginCapture "
             "cudaStreamEndCapture cudaGraphInstantiateWithFlags cudaGraphLaunch cudaGraphExecDestroy "
             "cudaGraphDestroy").split()
    for n in names:
        setattr(lib, n, Fn(n, impls.get(n)))
    c = CudaRuntime()
    assert lib.cudaGraphInstantiateWithFlags.argtypes == [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                                          ctypes.c_ulonglong]
    assert lib.cudaStreamBeginCapture.argtypes == [ctypes.c_void_p, ctypes.c_int]
    del calls[:]
    c.stream_create()
    assert calls[0][0] == "cudaStreamCreateWithFlags" and calls[0][1][1] == 1  # cudaStreamNonBlocking
    del calls[:]
    c.begin_capture(7)
    assert calls == [("cudaStreamBeginCapture", (7, 1))]  # cudaStreamCaptureModeThreadLocal
    with pytest.raises(CudaError, match="cudaStreamEndCapture failed: cudaErrorStreamCaptureInvalidated"):
        c.end_capture(7)
    assert "cudaGetLastError" in [n for n, _ in calls]  # the capture's error is cleared for the calls after it
    assert c.graph_instantiate(0xA0) == 0xE0
    assert calls[-1][0] == "cudaGraphInstantiateWithFlags" and calls[-1][1][1:] == (0xA0, 0)
    del calls[:]
    c.graph_launch(0xE0, 7)
    c.graph_exec_destroy(0xE0)
    c.graph_destroy(0xA0)
    c.graph_exec_destroy(0)
    c.graph_destroy(0)
    assert [n for n, _ in calls] == ["cudaGraphLaunch", "cudaGraphExecDestroy", "cudaGraphDestroy"]


def test_device_argmax_copies_ids_not_logits(monkeypatch, bundle):
    """next_ids is bound once per context like every tensor; a greedy step copies rows x 8 bytes of ids back,
    not rows x V x 4 of logits; an engine without next_ids refuses ids_only."""
    from specedge.runtime.backends.cuda_rt import D2H

    d, m, es = bundle
    argmax_bundle = (d, SimpleNamespace(**{**vars(m), "device_argmax": True}), es)
    runners, _, cuda, log = open_pair(monkeypatch, argmax_bundle, argmax=True)
    t = runners["target"]
    assert t.has_argmax
    bound = [c for c in log if c[0] == "set_tensor_address" and c[3] == "next_ids"]
    assert len(bound) == len(WIDTHS["target"]) + len(WIDTHS["draft"])
    t.ids_host[:3] = [7, 8, 9]  # what the device "computed"
    cuda.copies.clear()
    out = t.step([3, 4, 5], 10, all_logits=True, ids_only=True)
    back = [c for c in cuda.copies if c[3] == D2H]
    assert [c[2] for c in back] == [3 * 8] and back[0][0] == t._host_ptrs[2] and back[0][1] == t.ids_dev
    assert out.dtype.name == "int64" and list(out) == [7, 8, 9]
    cuda.copies.clear()
    t.step([3, 4, 5], 10, all_logits=True)  # sampling still gets the logits
    assert [c[2] for c in cuda.copies if c[3] == D2H] == [3 * DIMS["target"].vocab * 4]
    plain, _, _, _ = open_pair(monkeypatch, bundle)
    with pytest.raises(ValueError, match="--device-argmax"):
        plain["target"].step([3, 4], 10, all_logits=True, ids_only=True)
