"""TensorRT backend: serialized engines from ``spec-export build``, no torch, no CuPy.

Written against the TensorRT 10 Python API (JetPack 6 ships 10.3) and libcudart through
:mod:`.cuda_rt`. Per model, everything is created once, when the runner opens:

* the engine, deserialized once, and **one execution context per width** (= optimization profile,
  min = opt = max). Each context selects its profile (``set_optimization_profile_async``), its input
  shapes (``set_input_shape``) and every tensor address (``set_tensor_address``) once, at open: a step
  never switches a profile — a switch makes TensorRT update resources on the next enqueue, and adaptive k
  changes the width almost every round. The contexts' scratch ("device memory") is user-managed and
  shared by every context of both models of the bundle (all run one after the other on one stream),
  see :class:`SharedScratch`;
* one device block for the KV cache, ``[n_layers, 2, H_kv, S_max, D]`` in the engine's cache
  dtype, and one for the new rows, ``[n_layers, 2, H_kv, T, D]`` laid out at each width's
  T (sized for the widest); per layer ``past_key_values.{i}.*`` and ``present.{i}.*`` point into
  them. Because both blocks list their rows in the same order, the new rows of **every layer**
  go into the cache with one strided copy (``cudaMemcpy2DAsync``: 2·L·H_kv rows of n·D
  elements, source pitch T·D, destination pitch S_max·D, destination offset past_len·D) —
  or one per tensor where 256-byte alignment of the tensor addresses needs padding between
  them (:class:`KvLayout`);
* ``logits`` on the device, ``[L_max, V]`` float32, and a pinned host buffer of the same size:
  only the rows the sampler needs (n for a verify, 1 otherwise) are copied back;
* the int64 inputs (ids, past_len, logits_at) in one pinned host block and one device block,
  sent with one copy per step;
* with ``cuda_graphs=True`` (the default; ``SpecDecoder.load(cuda_graphs=False)``, ``spec-run
  --no-cuda-graphs`` turn it off), per width a CUDA graph of its ``execute_async_v3``, captured at the
  first step at that width and replayed after: addresses are fixed per context and every per-step value
  (ids, past_len, logits_at) is read from device memory. The KV commit and the logits copy stay outside
  the graph (their offsets and sizes change per step). Where TensorRT cannot run under stream capture the
  width keeps plain ``execute_async_v3``; ``TrtRunner.graph_status`` says, per width, which and why.

A step: fill the pinned inputs, one host-to-device copy, the width's graph launch (or
``execute_async_v3``) on the stream, one device copy of the new KV rows, one device-to-host copy of
the needed logits, one stream synchronize. The engine is checked at load against the manifest
(TensorRT version, GPU compute capability, tensor names, dtypes and every profile's shapes); a
mismatch is refused with the command that rebuilds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError, BundleError
from ..manifest import EngineSet, Manifest, ModelDims, Width, io_spec, width_shapes
from .cuda_rt import D2D, D2H, H2D, CudaError, CudaRuntime, host_array
from .requirements import tensorrt_version_problem

_NP_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}


def rebuild_hint(bundle_dir: Path | str, precision: str) -> str:
    return f"spec-export build {bundle_dir} --backend trt --precision {precision}"


def deserialize_mapped(runtime: Any, path: Path) -> Any:
    """Deserialize an engine from a read-only memory map: the plan is never copied into a Python bytes object,
    so loading holds one copy of the weights (TensorRT's), not two - on a Jetson host and GPU share memory."""
    import mmap

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        return runtime.deserialize_cuda_engine(mm)


def compat_problems(es: EngineSet, trt_version: str, compute_capability: str, gpu_name: str) -> list[str]:
    """Why engines built as `es` cannot be loaded here (empty: they can).

    TensorRT engines are specific to the TensorRT version (major.minor.patch; the build number
    may differ) and the GPU's compute capability; the GPU name is reported, not required
    (two boards of one compute capability share engines, though the tuning may differ).
    """
    out = []
    want = ".".join(es.tensorrt.split(".")[:3]) if es.tensorrt else "?"
    have = ".".join(trt_version.split(".")[:3])
    if want != have:
        out.append(f"the engines were built with TensorRT {es.tensorrt}, this machine has TensorRT {trt_version}")
    cc = es.gpu.get("compute_capability")
    if cc != compute_capability:
        out.append(f"the engines were built for compute capability {cc} ({es.gpu.get('name', '?')}), this GPU is "
                   f"{gpu_name} with compute capability {compute_capability}")
    return out


def io_problems(desc: dict[str, Any], dims: ModelDims, widths: Sequence[Width], max_context: int,
                kv_dtype: str, argmax: bool = False, logits_width: int | None = None) -> list[str]:
    """Differences between an engine's tensors/profiles (:func:`describe_engine`) and the bundle's contract.

    desc: {"tensors": {name: {"mode": "input"|"output", "dtype": str, "shape": [..., -1 dynamic]}},
           "profiles": [{input name: [min, opt, max]}, ...]}.
    """
    out = []
    inputs, outputs = io_spec(dims, "portable", kv_dtype, argmax, logits_width)
    want = {s.name: ("input", s.dtype) for s in inputs} | {s.name: ("output", s.dtype) for s in outputs}
    tensors = desc["tensors"]
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing:
        out.append(f"tensors missing from the engine: {', '.join(missing[:6])}{' …' if len(missing) > 6 else ''}")
    if extra:
        out.append(f"tensors the bundle does not declare: {', '.join(extra[:6])}{' …' if len(extra) > 6 else ''}")
    for name, (mode, dtype) in want.items():
        t = tensors.get(name)
        if t is None:
            continue
        if t["mode"] != mode or t["dtype"] != dtype:
            out.append(f"{name} is {t['mode']} {t['dtype']} in the engine, the bundle declares {mode} {dtype}")
    profiles = desc["profiles"]
    if len(profiles) != len(widths):
        out.append(f"the engine has {len(profiles)} optimization profiles, the bundle declares {len(widths)} widths "
                   f"({', '.join(f'T={w.T}' for w in widths)})")
        return out
    for p, (w, prof) in enumerate(zip(widths, profiles)):
        for name, shape in width_shapes(dims, w, max_context).items():
            got = prof.get(name)
            if got is None:
                continue  # reported above as a missing tensor
            if any(list(s) != list(shape) for s in got):
                out.append(f"profile {p} ({w.role} T={w.T}): {name} is {got} (min, opt, max) in the engine, the "
                           f"bundle needs {list(shape)} (S_max {max_context})")
    return out


def describe_engine(engine: Any, trt: Any) -> dict[str, Any]:
    """An engine's tensors and profile shapes as plain data, for :func:`io_problems`."""
    dt = {trt.float32: "float32", trt.float16: "float16", trt.int64: "int64", trt.int32: "int32", trt.bool: "bool"}
    if hasattr(trt, "bfloat16"):
        dt[trt.bfloat16] = "bfloat16"
    tensors, inputs = {}, []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        is_in = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        tensors[name] = {"mode": "input" if is_in else "output", "dtype": dt.get(engine.get_tensor_dtype(name), "?"),
                         "shape": list(engine.get_tensor_shape(name))}
        if is_in:
            inputs.append(name)
    profiles = [{n: [list(s) for s in engine.get_tensor_profile_shape(n, p)] for n in inputs}
                for p in range(engine.num_optimization_profiles)]
    return {"tensors": tensors, "profiles": profiles}


def import_tensorrt() -> Any:
    try:
        import tensorrt as trt
    except ImportError as e:
        raise BackendUnavailableError(
            "TensorRT is not installed here (import tensorrt failed: "
            f"{e}); on a Jetson use JetPack's python3-libnvinfer in a venv made with --system-site-packages, "
            "elsewhere pip install 'specedge[trt]'; `spec-export doctor` shows what this machine has") from e
    return trt


class SharedScratch:
    """One device allocation for the scratch memory of every execution context of a decoder: one context per
    width of the target and of the draft.

    Sharing is safe only because every one of those contexts runs serialized on one stream (the decoder's):
    TensorRT uses a context's scratch from its enqueue until that work completes, and the next enqueue on the
    stream starts after it. Never run two of these contexts on different streams. The allocation grows to the
    largest context attached and every context is re-pointed at it (a CUDA graph captured before a move is
    re-captured, see ``TrtRunner._execute``).
    """

    def __init__(self, cuda: CudaRuntime):
        self.cuda, self.ptr, self.size, self._contexts = cuda, 0, 0, []

    def attach(self, context: Any, size: int) -> None:
        self._contexts.append(context)
        if size > self.size:
            old = self.ptr
            self.ptr, self.size = self.cuda.malloc(size), size
            self.cuda.free(old)
        for c in self._contexts:
            if hasattr(c, "set_device_memory"):  # TensorRT >= 10.1
                c.set_device_memory(self.ptr, self.size)
            else:  # TensorRT 10.0
                c.device_memory = self.ptr

    def close(self) -> None:
        self.cuda.free(self.ptr)
        self.ptr = self.size = 0


ALIGN = 256  # bytes: every tensor address handed to TensorRT starts on this boundary (cudaMalloc's guarantee)


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class KvLayout:
    """Where each layer's cache and new rows live, and the copy that commits them.

    cache block: per (layer, key|value) one tensor [H_kv, S_max, D]; new-rows block: per (layer,
    key|value) one tensor [H_kv, T, D] at the current width T. Tensors follow each other in io_spec
    order, each starting on a 256-byte boundary. When no padding is needed between tensors (H_kv·T·D
    and H_kv·S_max·D elements are whole multiples of 256 bytes, e.g. any even H_kv with D = 64 in fp16),
    both blocks are uniform grids of 2·n_layers·H_kv rows, and moving the first n new positions of every
    row to positions past_len.. of the cache is a single 2-D copy; otherwise one 2-D copy per tensor.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_context: int
    itemsize: int

    @property
    def rows(self) -> int:
        return self.n_layers * 2 * self.n_kv_heads

    @property
    def row_bytes(self) -> int:  # one position of one head
        return self.head_dim * self.itemsize

    def _cache_stride(self) -> int:
        return _align(self.n_kv_heads * self.max_context * self.row_bytes)

    def _new_stride(self, T: int) -> int:
        return _align(self.n_kv_heads * T * self.row_bytes)

    def cache_bytes(self) -> int:
        return 2 * self.n_layers * self._cache_stride()

    def new_bytes(self, t_max: int) -> int:
        return 2 * self.n_layers * self._new_stride(t_max)  # the stride only grows with T

    def past_address(self, base: int, layer: int, kind: int) -> int:
        return base + (2 * layer + kind) * self._cache_stride()

    def present_address(self, base: int, layer: int, kind: int, T: int) -> int:
        return base + (2 * layer + kind) * self._new_stride(T)

    def copies(self, T: int) -> int:
        """2-D copies one commit at width T takes: 1, or one per tensor where tensors are padded apart."""
        r, H = self.row_bytes, self.n_kv_heads
        uniform = self._cache_stride() == H * self.max_context * r and self._new_stride(T) == H * T * r
        return 1 if uniform else 2 * self.n_layers

    def commit(self, cuda: Any, cache: int, new: int, T: int, past_len: int, n: int, stream: int) -> None:
        """Copy the first n of T new rows of every layer and head into the cache at past_len."""
        r, S = self.row_bytes, self.max_context
        if self.copies(T) == 1:
            cuda.memcpy2d(cache + past_len * r, S * r, new, T * r, n * r, self.rows, D2D, stream)
            return
        for t in range(2 * self.n_layers):
            cuda.memcpy2d(cache + t * self._cache_stride() + past_len * r, S * r, new + t * self._new_stride(T),
                          T * r, n * r, self.n_kv_heads, D2D, stream)


@dataclass
class _Profile:
    """One width: its optimization profile, the execution context bound to it and, once captured, its CUDA graph."""

    index: int
    width: Width
    context: Any
    graph: int = 0  # cudaGraphExec_t; 0: not captured (yet, or capture failed: see TrtRunner.graph_status)
    graph_scratch: int = 0  # the shared scratch's address when the graph was captured (the graph holds it)


class TrtRunner:
    """One model of a bundle on TensorRT. See the module docstring for the buffers and the step.

    cuda_graphs: capture each width's execute_async_v3 into a CUDA graph at its first step and replay it after
    (False: always execute_async_v3). graph_status: per width T, "captured" or "plain execute: <why>", filled
    as widths are first run (at open when cuda_graphs is False).
    """

    pads_into_cache = False  # portable graphs: only the n real rows are copied into the cache

    def __init__(self, bundle_dir: Path, manifest: Manifest, role: str, engines: EngineSet,
                 shared: dict[str, Any] | None = None, cuda_graphs: bool = True, min_width: int = 1):
        trt = import_tensorrt()
        shared = shared if shared is not None else {}
        if "cuda" not in shared:
            shared["cuda"] = CudaRuntime()
            shared["stream"] = shared["cuda"].stream_create()
            shared["scratch"] = SharedScratch(shared["cuda"])
        self.cuda: CudaRuntime = shared["cuda"]
        self.stream: int = shared["stream"]
        self._scratch: SharedScratch = shared["scratch"]
        self.entry = manifest.models[role]
        self.max_context = manifest.max_context
        self.min_width = min_width  # narrowest width a step runs in (GraphRunner.min_width)
        bundle_dir = Path(bundle_dir)
        if (why := tensorrt_version_problem(trt.__version__)) is not None:
            raise BackendUnavailableError(why)
        problems = compat_problems(engines, trt.__version__, self.cuda.compute_capability(), self.cuda.device_name())
        if problems:
            raise BackendUnavailableError(f"the {role} engine of {bundle_dir} cannot run here: {'; '.join(problems)}. "
                                          f"Rebuild it on this machine: {rebuild_hint(bundle_dir, engines.precision)}")
        self._bufs: list[int] = []
        self._host_ptrs: list[int] = []
        self._profiles: list[_Profile] = []
        self.engine = None
        try:
            self._open(trt, bundle_dir, manifest, role, engines, cuda_graphs)
        except BaseException:  # free what was allocated (on an 8 GB Jetson a retry in this process needs it)
            self.close()
            raise

    def _open(self, trt: Any, bundle_dir: Path, manifest: Manifest, role: str, engines: EngineSet,
              cuda_graphs: bool) -> None:
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        path = bundle_dir / engines.graphs[role]
        self.engine = deserialize_mapped(self._runtime, path)
        if self.engine is None:
            raise BundleError(f"TensorRT could not deserialize {path} (see the TensorRT log above); "
                              f"rebuild it: {rebuild_hint(bundle_dir, engines.precision)}")
        d, widths = self.entry.dims, self.entry.widths
        self.has_argmax = manifest.device_argmax
        problems = io_problems(describe_engine(self.engine, trt), d, widths, self.max_context, engines.kv_dtype,
                               self.has_argmax, self.entry.logits_width)
        if problems:
            raise BundleError(f"{path} does not match the bundle's manifest: {'; '.join(problems)}. "
                              f"Rebuild it: {rebuild_hint(bundle_dir, engines.precision)}")

        self.layout = KvLayout(d.n_layers, d.n_kv_heads, d.head_dim, self.max_context,
                               _NP_ITEMSIZE[engines.kv_dtype])
        t_max = max(w.T for w in widths)
        self._l_max = max(w.L for w in widths)
        c = self.cuda
        self.kv = self._alloc(self.layout.cache_bytes())
        c.memset(self.kv, 0, self.layout.cache_bytes(), self.stream)
        self.present = self._alloc(self.layout.new_bytes(t_max))
        self.logits_dev = self._alloc(self._l_max * self.entry.logits_width * 4)
        self.ids_dev = self._alloc(self._l_max * 8) if self.has_argmax else 0  # next_ids [l_max] int64
        # int64 inputs in one block, each on a 256-byte boundary: ids [t_max] | past_len [1] | logits_at [l_max]
        self._io_off = (0, _align(t_max * 8), _align(t_max * 8) + ALIGN)
        self._io_n = (self._io_off[2] + _align(self._l_max * 8)) // 8
        self._io_idx = tuple(o // 8 for o in self._io_off)  # the same offsets in int64 elements
        self._arange = np.arange(self._l_max, dtype=np.int64)  # logits_at of the all-rows widths
        self.io_dev = self._alloc(self._io_n * 8)
        for nbytes in (self._io_n * 8, self._l_max * self.entry.logits_width * 4, self._l_max * 8):
            self._host_ptrs.append(c.malloc_host(nbytes))  # one at a time: close() frees what a failure left
        self.io_host = host_array(self._host_ptrs[0], (self._io_n,), np.int64)
        self.logits_host = host_array(self._host_ptrs[1], (self._l_max, self.entry.logits_width), np.float32)
        self.ids_host = host_array(self._host_ptrs[2], (self._l_max,), np.int64)
        self.io_host[:] = 0
        self.graph_status: dict[int, str] = {} if cuda_graphs else {
            w.T: "plain execute: cuda_graphs=False" for w in widths}
        strategy = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        # device_memory_size_v2 from TensorRT 10.1 (device_memory_size is gone in 11): 0 is a size, not "absent"
        v2 = getattr(self.engine, "device_memory_size_v2", None)
        scratch = v2 if v2 is not None else self.engine.device_memory_size
        for p, w in enumerate(widths):
            self._profiles.append(self._profile(p, w, strategy, scratch))
        # one synchronize for all the asynchronous profile selections (and the cache's zeroing): the header asks
        # for the stream that selected a profile to be synchronized with the one that enqueues - here both are one
        c.synchronize(self.stream)

    def _alloc(self, nbytes: int) -> int:
        ptr = self.cuda.malloc(nbytes)
        self._bufs.append(ptr)
        return ptr

    def _profile(self, index: int, w: Width, strategy: Any, scratch_bytes: int) -> _Profile:
        """Width w's own execution context, bound once: shared scratch, profile, input shapes, tensor addresses."""
        d, o = self.entry.dims, self._io_off
        ctx = self.engine.create_execution_context(strategy)
        self._scratch.attach(ctx, scratch_bytes)  # shared by every context of both models: safe only on one stream
        try:  # the binding raises RuntimeError where the C++ call returns false
            ok = ctx.set_optimization_profile_async(index, self.stream)
        except RuntimeError as e:
            raise BundleError(f"TensorRT refused optimization profile {index} (T={w.T}): {e}") from None
        if not ok:
            raise BundleError(f"TensorRT refused optimization profile {index} (T={w.T})")
        for name, shape in width_shapes(d, w, self.max_context).items():
            if not ctx.set_input_shape(name, shape):
                raise BundleError(f"TensorRT refused shape {shape} for {name} (profile {index}, T={w.T})")
        addr = {"input_ids": self.io_dev + o[0], "past_len": self.io_dev + o[1], "logits_at": self.io_dev + o[2],
                "logits": self.logits_dev}
        if self.has_argmax:
            addr["next_ids"] = self.ids_dev
        for i in range(d.n_layers):
            for j, kind in enumerate(("key", "value")):
                addr[f"past_key_values.{i}.{kind}"] = self.layout.past_address(self.kv, i, j)
                addr[f"present.{i}.{kind}"] = self.layout.present_address(self.present, i, j, w.T)
        for name, ptr in addr.items():
            if not ctx.set_tensor_address(name, ptr):
                raise BundleError(f"TensorRT refused the address of {name} (profile {index}, T={w.T})")
        return _Profile(index, w, ctx)

    def _pick(self, n: int, all_logits: bool) -> _Profile:
        fits = [p for p in self._profiles if p.width.T >= max(n, self.min_width)
                and (not all_logits or p.width.L == p.width.T)]
        if not fits:
            raise ValueError(f"no profile of this engine takes {n} tokens with {'all' if all_logits else 'last'} "
                             f"logits; widths {[w.T for w in self.entry.widths]}")
        return min(fits, key=lambda p: p.width.T)

    def _execute(self, p: _Profile) -> None:
        """Run width p's context on the stream: replay its CUDA graph, or execute_async_v3 and, at the first step
        at this width, capture a graph for the next ones."""
        s, T = self.stream, p.width.T
        if p.graph and p.graph_scratch != self._scratch.ptr:  # a larger context moved the shared scratch since
            self.cuda.graph_exec_destroy(p.graph)
            p.graph = 0
            del self.graph_status[T]
        if p.graph:
            self.cuda.graph_launch(p.graph, s)
            return
        if not p.context.execute_async_v3(s):
            raise RuntimeError(f"TensorRT execute_async_v3 failed for {self.entry.graph} at width T={T}")
        if T not in self.graph_status:
            self._capture(p)

    def _capture(self, p: _Profile) -> None:
        """Capture width p's execute_async_v3 into a CUDA graph, as trtexec --useCudaGraph does: after a plain
        execute at this width (TensorRT does its deferred allocations and shape updates there, not under capture)
        and a synchronize, in thread-local capture mode. What TensorRT cannot enqueue under capture (data-dependent
        shapes, a plugin that synchronizes or allocates) makes execute return False or invalidates the capture:
        the width then keeps plain execute, and graph_status[T] says why."""
        c, s = self.cuda, self.stream
        c.synchronize(s)
        graph, why = 0, ""
        try:
            c.begin_capture(s)
            try:
                ok = p.context.execute_async_v3(s)  # recorded, not run: the plain one made this step's output
            finally:
                graph = c.end_capture(s)  # always: a failed capture must not leave the stream capturing
            if ok:
                p.graph, p.graph_scratch = c.graph_instantiate(graph), self._scratch.ptr
            else:
                why = "execute_async_v3 returned False under stream capture"
        except CudaError as e:
            why = str(e)
        finally:
            c.graph_destroy(graph)  # the executable graph does not need it
        self.graph_status[p.width.T] = "captured" if p.graph else f"plain execute: {why}"

    def step(self, tokens: Sequence[int], past_len: int, all_logits: bool, ids_only: bool = False) -> np.ndarray:
        n = len(tokens)
        assert 0 < n and past_len + n <= self.max_context, (n, past_len, self.max_context)
        if ids_only and not self.has_argmax:
            raise ValueError(f"{self.entry.graph} has no next_ids output (export with --device-argmax)")
        p = self._pick(n, all_logits)
        T, L, c, s = p.width.T, p.width.L, self.cuda, self.stream
        io, (o_ids, o_past, o_at) = self.io_host, self._io_idx
        io[o_ids:o_ids + n] = tokens
        io[o_ids + n:o_ids + T] = tokens[-1]  # padding: computed, never committed
        io[o_past] = past_len
        at = io[o_at:o_at + L]
        if L == T:
            at[:] = self._arange[:T]
        else:
            at[0] = n - 1
        c.memcpy(self.io_dev, self._host_ptrs[0], self._io_n * 8, H2D, s)
        self._execute(p)
        self.layout.commit(c, self.kv, self.present, T, past_len, n, s)  # every layer's new rows (1 copy or 2L)
        rows = n if all_logits else 1
        first = n - 1 if not all_logits and L == T else 0  # every row computed: the last real one is n-1
        if ids_only:  # rows x 8 bytes instead of rows x V x 4
            c.memcpy(self._host_ptrs[2], self.ids_dev + first * 8, rows * 8, D2H, s)
            c.synchronize(s)
            return self.ids_host[:rows]
        V = self.entry.logits_width
        c.memcpy(self._host_ptrs[1], self.logits_dev + first * V * 4, rows * V * 4, D2H, s)
        c.synchronize(s)
        return self.logits_host[:rows]

    def close(self) -> None:
        """Destroy the CUDA graphs and free the buffers; the shared scratch and stream are the decoder's to close."""
        c = self.cuda
        if self._bufs or self._host_ptrs or self._profiles:
            c.synchronize(self.stream)
        for p in self._profiles:
            c.graph_exec_destroy(p.graph)
        for ptr in self._bufs:
            c.free(ptr)
        for ptr in self._host_ptrs:
            c.free_host(ptr)
        self._bufs, self._host_ptrs, self._profiles = [], [], []
        self.engine = None
