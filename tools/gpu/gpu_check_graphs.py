"""GPU check without TensorRT: the TensorRT runner's step loop and CUDA graphs on a real GPU.

    python tools/gpu/gpu_check_graphs.py            # needs an NVIDIA GPU, libcudart and CuPy; one line per check
    python tools/gpu/gpu_kit.py exec tools/gpu/gpu_check_graphs.py    # the same where specedge is not pip-installed

TrtRunner is driven exactly as SpecDecoder drives it (target and draft on one stream and one shared scratch, widths
alternating, rollbacks, all-rows and last-row logits, device argmax), with real libcudart through specedge's binding
and real CUDA graphs — only the engine is a stand-in: a `tensorrt` module whose execution context, on
execute_async_v3(stream), launches CuPy kernels on that stream that read the bound inputs (input_ids, past_len,
logits_at, every layer's cache) and write the bound outputs (every layer's new rows, logits, next_ids) by a rule a
numpy model replays. What this proves on the GPU: the per-width contexts' bindings, the input upload, the capture
sequence (plain execute, synchronize, thread-local capture, instantiate with flags) and graph replay reading the
*new* inputs each step, re-capture after the shared scratch moved, the KV commit (one 2-D copy and one per tensor),
the logits / next_ids readback — every output equal bit for bit to the model, with and without graphs.
Not proven: TensorRT itself (tools/gpu/gpu_check.sh with TensorRT installed). Exit status 0 when every check passes.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

S_MAX = 64
# target: H_kv 2, D 64 fp16 -> every tensor a whole number of 256-byte rows: the commit is one 2-D copy;
# draft: H_kv 1, D 16 -> padded tensors: one 2-D copy per tensor
DIMS = {"target": (3, 2, 64, 257), "draft": (2, 1, 16, 257)}  # layers, kv heads, head dim, vocab
WIDTHS = {"target": (("decode", 1, 1), ("verify", 2, 2), ("verify", 5, 5), ("prefill", 8, 1)),
          "draft": (("decode", 1, 1), ("verify", 3, 3), ("prefill", 8, 1))}
SCRATCH = {"target": 1 << 16, "draft": 1 << 18}  # the draft opens second and needs more: the scratch moves

_SRC = r"""
#include <cuda_fp16.h>
extern "C" __global__ void present(const long long* ids, const long long* past_len, unsigned long long* outs,
                                   int T, int H, int D, int layers) {
    // outs[2*layer + kind] -> [H, T, D] half; value = ((id*31 + pos*7 + layer*5 + kind*3 + h*2 + d) % 97) / 8
    long long n = (long long)layers * 2 * H * T * D;
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        int d = i % D, t = (i / D) % T, h = (i / D / T) % H, k = (i / D / T / H) % 2, l = i / D / T / H / 2;
        long long pos = past_len[0] + t;
        long long v = (ids[t] * 31 + pos * 7 + l * 5 + k * 3 + h * 2 + d) % 97;
        ((__half*)outs[2 * l + k])[((long long)h * T + t) * D + d] = __float2half((float)v / 8.0f);
    }
}
extern "C" __global__ void logits(const long long* ids, const long long* past_len, const long long* at,
                                  const __half* cache0, const __half* present0, float* out,
                                  int T, int L, int V, int S, int D) {
    // out[l, v] = sum(cache layer 0 key, head 0, dim 0, positions < past_len) + present row at[l] (same slot)
    //             + ((v * 13 + ids[at[l]] * 3) % 101) / 4
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= L * V) return;
    int l = i / V, v = i % V;
    long long r = at[l];
    float s = 0.0f;
    for (long long p = 0; p < past_len[0]; ++p) s += __half2float(cache0[p * D]);
    s += __half2float(present0[r * D]);
    out[i] = s + (float)((v * 13 + ids[r] * 3) % 101) / 4.0f;
}
extern "C" __global__ void argmax(const float* x, long long* out, int L, int V) {
    int l = blockIdx.x * blockDim.x + threadIdx.x;
    if (l >= L) return;
    int best = 0;
    for (int v = 1; v < V; ++v) if (x[(long long)l * V + v] > x[(long long)l * V + best]) best = v;
    out[l] = best;
}
"""


class Model:
    """The stand-in engine's rule in numpy, with the cache the runner should hold."""

    def __init__(self, layers: int, H: int, D: int, V: int):
        self.layers, self.H, self.D, self.V = layers, H, D, V
        self.cache = np.zeros((layers, 2, H, S_MAX, D), np.float16)

    def step(self, ids: np.ndarray, past: int, at: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        T = len(ids)
        l_, k, h, t, d = np.ogrid[:self.layers, :2, :self.H, :T, :self.D]
        new = ((ids[t] * 31 + (past + t) * 7 + l_ * 5 + k * 3 + h * 2 + d) % 97 / 8).astype(np.float16)
        s = np.float32(0)
        for p in range(past):  # the kernel's order: exact anyway (multiples of 1/8 far below 2**21)
            s += np.float32(self.cache[0, 0, 0, p, 0])
        rows = (s + new[0, 0, 0, at, 0].astype(np.float32))[:, None]
        v = np.arange(self.V)[None, :]
        logits = rows + ((v * 13 + ids[at][:, None] * 3) % 101 / 4).astype(np.float32)
        self.cache[:, :, :, past:past + n] = new[:, :, :, :n]
        return logits.astype(np.float32), logits.argmax(axis=1)


def fake_tensorrt(cp, kernels):
    """A `tensorrt` module whose engines follow specedge's I/O contract and compute with the kernels above."""
    from specedge.runtime.manifest import ModelDims, Width, io_spec, width_shapes

    class Context:
        def __init__(self, engine):
            self.engine, self.addr, self.shapes, self.profile, self.memory = engine, {}, {}, None, None
            self.ptr_table = None

        def set_device_memory(self, ptr, size):
            self.memory = (ptr, size)

        def set_optimization_profile_async(self, index, stream):
            self.profile = index
            return True

        def set_input_shape(self, name, shape):
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name, ptr):
            self.addr[name] = ptr
            return True

        def execute_async_v3(self, stream):
            e, a = self.engine, self.addr
            layers, H, D, V = e.shape
            T, L = self.shapes["input_ids"][1], self.shapes["logits_at"][1]
            if self.ptr_table is None:  # first (plain) execute: never under capture
                self.ptr_table = cp.asarray(np.array([a[f"present.{i}.{k}"] for i in range(layers)
                                                      for k in ("key", "value")], np.uint64))
                cp.cuda.Device().synchronize()
            with cp.cuda.ExternalStream(stream):
                i32, p = np.int32, {k: np.uint64(v) for k, v in a.items()}  # device pointers as 8-byte args
                kernels["present"]((64,), (128,), (p["input_ids"], p["past_len"], self.ptr_table, i32(T), i32(H),
                                                  i32(D), i32(layers)))
                kernels["logits"](((L * V + 127) // 128,), (128,),
                                  (p["input_ids"], p["past_len"], p["logits_at"], p["past_key_values.0.key"],
                                   p["present.0.key"], p["logits"], i32(T), i32(L), i32(V), i32(S_MAX), i32(D)))
                if "next_ids" in p:
                    kernels["argmax"]((1,), (32,), (p["logits"], p["next_ids"], i32(L), i32(V)))
            return True

    class Engine:
        def __init__(self, role):
            self.role, self.shape = role, DIMS[role]
            layers, H, D, V = self.shape
            self.dims = ModelDims(layers, H * D, H, H, D, 4 * H * D, V)
            self.widths = [Width(*w) for w in WIDTHS[role]]
            ins, outs = io_spec(self.dims, "portable", "float16", True)
            self.tensors = {s.name: ("in", s.dtype) for s in ins} | {s.name: ("out", s.dtype) for s in outs}
            self.names = list(self.tensors)
            self.num_io_tensors = len(self.names)
            self.num_optimization_profiles = len(self.widths)
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
            return [width_shapes(self.dims, self.widths[p], S_MAX)[name]] * 3

        def create_execution_context(self, strategy):
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

    return SimpleNamespace(
        __version__="10.3.0.30", Logger=Logger, Runtime=Runtime,
        ExecutionContextAllocationStrategy=SimpleNamespace(USER_MANAGED="user-managed"),
        TensorIOMode=SimpleNamespace(INPUT="in", OUTPUT="out"),
        float32="float32", float16="float16", int64="int64", int32="int32", bool="bool")


def main() -> int:
    import cupy as cp
    from gpu_check_cuda import Checks  # tools/ is on sys.path: run directly or through gpu_kit.py exec

    from specedge.runtime.backends import trt as trt_backend
    from specedge.runtime.backends.cuda_rt import CudaRuntime
    from specedge.runtime.manifest import EngineSet, ModelEntry

    check = Checks()

    module = cp.RawModule(code=_SRC, options=("-std=c++14",))
    kernels = {k: module.get_function(k) for k in ("present", "logits", "argmax")}
    fake = fake_tensorrt(cp, kernels)
    trt_backend.import_tensorrt = lambda: fake

    cuda = CudaRuntime()
    tmp = Path(tempfile.mkdtemp(prefix="specedge-graphs-"))
    for role in DIMS:
        (tmp / f"{role}.engine").write_text(role)
    models = {}
    for role in DIMS:
        e = fake.Runtime(None).deserialize_cuda_engine(role.encode())
        models[role] = ModelEntry("llama", e.dims, f"{role}.onnx", None, "fp16", tuple(e.widths))
    manifest = SimpleNamespace(models=models, max_context=S_MAX, device_argmax=True)
    engines = EngineSet("trt", "fp16", "float16", {r: f"{r}.engine" for r in DIMS}, {r: "x" for r in DIMS},
                        tensorrt="10.3.0.30", gpu={"name": cuda.device_name(),
                                                   "compute_capability": cuda.compute_capability()})

    rng = np.random.default_rng(0)
    script = []  # (role, tokens, all_logits, ids_only, rollback, restart) - the same for both modes
    for _ in range(120):
        role = ("target", "draft")[int(rng.integers(2))]
        all_logits = bool(rng.integers(2))
        n_max = 5 if all_logits and role == "target" else 3 if all_logits else 8
        tokens = [int(x) for x in rng.integers(0, DIMS[role][3], int(rng.integers(1, n_max + 1)))]
        script.append((role, tokens, all_logits, bool(rng.integers(2)), int(rng.integers(0, 4)),
                       int(rng.integers(0, 8))))

    outputs = {}
    for graphs in (False, True):
        shared = {"cuda": cuda, "stream": cuda.stream_create()}
        shared["scratch"] = trt_backend.SharedScratch(cuda)
        runners = {r: trt_backend.TrtRunner(tmp, manifest, r, engines, shared, cuda_graphs=graphs) for r in DIMS}
        ref = {r: Model(*DIMS[r]) for r in DIMS}
        past = {r: 0 for r in DIMS}
        got, bad, t0 = [], [], time.perf_counter()
        for i, (role, tokens, all_logits, ids_only, rollback, restart) in enumerate(script):
            n = len(tokens)
            if past[role] + n > S_MAX - 1:
                past[role] = restart  # start over, as a new request would
            r, m = runners[role], ref[role]
            w = r._pick(n, all_logits).width
            ids = np.array(tokens + [tokens[-1]] * (w.T - n), np.int64)
            at = np.arange(w.T) if w.L == w.T else np.array([n - 1])
            want_logits, want_ids = m.step(ids, past[role], at, n)
            rows = slice(0, n) if all_logits else slice(n - 1, n) if w.L == w.T else slice(0, 1)
            out = np.array(r.step(tokens, past[role], all_logits, ids_only=ids_only))
            want = want_ids[rows] if ids_only else want_logits[rows]
            if out.shape != want.shape or not np.array_equal(out, want):
                bad.append(f"step {i} ({role} n={n} T={w.T} past={past[role]} "
                           f"{'ids' if ids_only else 'logits'}): {out.ravel()[:4]} vs {want.ravel()[:4]}")
            got.append(out)
            past[role] = max(0, past[role] + n - rollback)  # rejected rows are overwritten by the next step
        cuda.synchronize(shared["stream"])
        ms = (time.perf_counter() - t0) * 1e3
        mode = "CUDA graphs" if graphs else "plain execute"
        check(f"{mode}: {len(script)} steps, target and draft interleaved, equal to the model bit for bit",
              not bad, f"{len(bad)} differ, first: {bad[0]}" if bad else f"{ms:.0f} ms")
        for role, r in runners.items():
            cache = np.empty((DIMS[role][0], 2, DIMS[role][1], S_MAX, DIMS[role][2]), np.float16)
            lay = r.layout
            for li in range(DIMS[role][0]):
                for k in range(2):
                    nb = cache[li, k].nbytes
                    buf = cp.ndarray((nb,), cp.uint8, cp.cuda.MemoryPointer(
                        cp.cuda.UnownedMemory(lay.past_address(r.kv, li, k), nb, None), 0))
                    cache[li, k] = cp.asnumpy(buf).view(np.float16).reshape(cache[li, k].shape)
            p = past[role]
            copies = ", ".join(f"T={w.T}: {lay.copies(w.T)}" for w in r.entry.widths)
            check(f"{mode}: {role} cache rows 0..{p} equal to the model's (2-D copies per commit: {copies})",
                  np.array_equal(cache[..., :p, :], ref[role].cache[..., :p, :]))
            if graphs:
                status = r.graph_status
                check(f"CUDA graphs: every {role} width captured", len(status) == len(r.entry.widths)
                      and all(s == "captured" for s in status.values()), str(status))
        outputs[graphs] = got
        for r in runners.values():
            r.close()
        shared["scratch"].close()
        cuda.stream_destroy(shared["stream"])
    same = all(np.array_equal(a, b) for a, b in zip(outputs[False], outputs[True]))
    check("graph replay == plain execute, every step", same)
    return check.done()


if __name__ == "__main__":
    sys.exit(main())
