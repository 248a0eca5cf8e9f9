"""GPU check without TensorRT: specedge's libcudart binding and the TensorRT backend's KV commit against CuPy.

    python tools/gpu/gpu_check_cuda.py        # needs an NVIDIA GPU, libcudart and CuPy; prints one line per check
    python tools/gpu/gpu_kit.py exec tools/gpu/gpu_check_cuda.py    # the same where specedge is not pip-installed
                                                            # (the GPU kit's `cuda-binding` check runs it so)

Checks: device name / compute capability / memory against CuPy's view of the same GPU; cudaMalloc,
host<->device copies and pinned host memory round-trip bytes exactly; KvLayout.commit (the one strided
cudaMemcpy2DAsync the TensorRT backend does per step) lands every layer's new rows where a CuPy slice
assignment puts them, for several widths, positions and both cache dtypes, on CuPy-owned memory.
Exit status 0 when every check passes.
"""

from __future__ import annotations

import sys
import time

import numpy as np


class Checks:
    """One `ok  ` / `FAIL` line per check (the GPU kit counts them); ``done()`` prints the summary, gives the exit
    status. Shared with tools/gpu/gpu_check_graphs.py."""

    def __init__(self):
        self.failures = 0

    def __call__(self, name: str, ok: bool, detail: str = "") -> None:
        self.failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    def done(self) -> int:
        print("all checks passed" if not self.failures else f"{self.failures} check(s) FAILED")
        return 1 if self.failures else 0


def main() -> int:
    import cupy as cp

    from specedge.runtime.backends.cuda_rt import D2H, H2D, CudaRuntime, host_array
    from specedge.runtime.backends.trt import KvLayout

    check = Checks()

    c = CudaRuntime()
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    check("device name", c.device_name() == name, f"{c.device_name()!r} vs CuPy {name!r}")
    cc = f"{props['major']}.{props['minor']}"
    check("compute capability", c.compute_capability() == cc, f"{c.compute_capability()} vs CuPy {cc}")
    free, total = c.mem_info()
    check("memory info", abs(total - props["totalGlobalMem"]) < 2**20, f"{total / 2**30:.1f} GiB")
    drv, rt = c.versions()
    check("versions", drv > 0 and rt > 0, f"driver {drv}, runtime {rt}, {c.library}")

    # malloc + H2D + D2H through pinned memory
    x = np.random.default_rng(0).integers(0, 2**31, 1 << 20, dtype=np.int64)
    d = c.malloc(x.nbytes)
    hp = c.malloc_host(x.nbytes)
    pinned = host_array(hp, x.shape, np.int64)
    pinned[:] = x
    s = c.stream_create()
    c.memcpy(d, hp, x.nbytes, H2D, s)
    pinned[:] = 0
    c.synchronize(s)
    c.memcpy(hp, d, x.nbytes, D2H, s)
    c.synchronize(s)
    check("pinned round trip", np.array_equal(pinned, x))
    via_cupy = cp.ndarray(x.shape, cp.int64, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(d, x.nbytes, None), 0))
    check("binding memory read by CuPy", bool(cp.array_equal(via_cupy, cp.asarray(x))))
    c.free(d)
    c.free_host(hp)

    # the TensorRT backend's KV commit, on CuPy-owned buffers, against CuPy slicing per tensor
    rng = np.random.default_rng(1)

    def view(base, offset, shape, dtype):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(base + offset, n, None), 0))

    for dtype in (np.float16, np.float32):
        for L, H, D, S, T, n, past in [(30, 3, 64, 2048, 9, 9, 0), (30, 3, 64, 2048, 9, 4, 1500),
                                       (30, 3, 64, 2048, 1, 1, 77), (28, 2, 128, 4096, 64, 37, 4000),
                                       (24, 2, 64, 1024, 5, 5, 10), (2, 2, 16, 64, 1, 1, 63)]:
            lay = KvLayout(L, H, D, S, np.dtype(dtype).itemsize)
            cache_buf = cp.zeros(lay.cache_bytes(), cp.uint8)
            new_buf = cp.zeros(lay.new_bytes(T), cp.uint8)
            cb, nb = cache_buf.data.ptr, new_buf.data.ptr
            caches, wants = [], []
            for i in range(L):
                for j in range(2):
                    cv = view(cb, lay.past_address(0, i, j), (H, S, D), dtype)
                    nv = view(nb, lay.present_address(0, i, j, T), (H, T, D), dtype)
                    cv[...] = cp.asarray(rng.normal(size=(H, S, D)).astype(dtype))
                    nv[...] = cp.asarray(rng.normal(size=(H, T, D)).astype(dtype))
                    want = cv.copy()
                    want[:, past:past + n] = nv[:, :n]
                    caches.append(cv)
                    wants.append(want)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            lay.commit(c, cb, nb, T, past, n, s)
            c.synchronize(s)
            us = (time.perf_counter() - t0) * 1e6
            ok = all(bool(cp.array_equal(a, b)) for a, b in zip(caches, wants))
            aligned = cb % 256 == 0 and all(lay.present_address(nb, i, j, T) % 256 == 0
                                            for i in range(L) for j in range(2))
            check(f"KV commit {np.dtype(dtype).name} L={L} H={H} D={D} S={S} T={T} n={n} past={past}",
                  ok and aligned, f"{lay.copies(T)} cudaMemcpy2DAsync call(s), {us:.0f} us")
    c.stream_destroy(s)
    return check.done()


if __name__ == "__main__":
    sys.exit(main())
