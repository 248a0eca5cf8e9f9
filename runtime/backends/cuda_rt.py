"""A lean CUDA binding: ctypes over libcudart, only what the GPU backends need.

Why ctypes over libcudart and not cuda-python, CuPy, torch or polygraphy's wrapper: a Jetson on
JetPack 6 has libcudart from its CUDA 12.6 install and Python 3.10; cuda-python and CuPy wheels
must match both (and CuPy's aarch64 wheels lag), torch is what the runtime must not need, and
polygraphy's ``cuda`` module is itself a ctypes wrapper that is a *build/validate* dependency,
not a runtime one. The runtime needs a few dozen functions (allocate, free, pinned host memory,
async copies, one stream, device properties, CUDA graphs captured from that stream); they are declared
here with their C signatures.

Every call is checked; a failure raises :class:`CudaError` with the function name, the error
name and its description from ``cudaGetErrorString``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os

from ..errors import BackendUnavailableError, SpecEdgeError

H2D, D2H, D2D = 1, 2, 3  # cudaMemcpyKind
_ATTR_CC_MAJOR, _ATTR_CC_MINOR, _ATTR_INTEGRATED = 75, 76, 18  # cudaDeviceAttr
_CAPTURE_THREAD_LOCAL = 1  # cudaStreamCaptureMode: Global 0, ThreadLocal 1, Relaxed 2


class CudaError(SpecEdgeError):
    """A CUDA runtime call failed."""


def _candidates() -> list[str]:
    names = [os.environ.get("SPECEDGE_CUDART", ""), ctypes.util.find_library("cudart") or ""]
    names += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    import sys

    # pip's CUDA wheels (nvidia-cuda-runtime-cu12/-cu13) put it in site-packages/nvidia/cuda_runtime/lib
    pip_roots = [f"{p}/nvidia/cuda_runtime/lib" for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    for root in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/aarch64-linux/lib",
                 "/usr/local/cuda/targets/x86_64-linux/lib", *pip_roots):
        names += sorted(glob.glob(f"{root}/libcudart.so*"), reverse=True)
    return [n for n in dict.fromkeys(names) if n and not n.endswith(".a")]


class CudaRuntime:
    """The few libcudart calls the runtime makes. Pointers are Python ints."""

    def __init__(self, device: int = 0) -> None:
        for name in _candidates():
            try:
                self._lib = ctypes.CDLL(name)
                self.library = name
                break
            except OSError:
                continue
        else:
            raise BackendUnavailableError(
                "libcudart was not found (looked for libcudart.so via ldconfig and in /usr/local/cuda); install the "
                "CUDA runtime, or point SPECEDGE_CUDART at libcudart.so")
        L, vp, sz, i = self._lib, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        sigs = {
            "cudaGetDeviceCount": [ctypes.POINTER(i)],
            "cudaSetDevice": [i],
            "cudaDriverGetVersion": [ctypes.POINTER(i)],
            "cudaRuntimeGetVersion": [ctypes.POINTER(i)],
            "cudaDeviceGetAttribute": [ctypes.POINTER(i), i, i],
            "cudaMemGetInfo": [ctypes.POINTER(sz), ctypes.POINTER(sz)],
            "cudaMalloc": [ctypes.POINTER(vp), sz],
            "cudaFree": [vp],
            "cudaMallocHost": [ctypes.POINTER(vp), sz],
            "cudaFreeHost": [vp],
            "cudaMemcpy": [vp, vp, sz, i],
            "cudaMemcpyAsync": [vp, vp, sz, i, vp],
            "cudaMemcpy2DAsync": [vp, sz, vp, sz, sz, sz, i, vp],
            "cudaMemsetAsync": [vp, i, sz, vp],
            "cudaStreamCreateWithFlags": [ctypes.POINTER(vp), ctypes.c_uint],
            "cudaStreamDestroy": [vp],
            "cudaStreamSynchronize": [vp],
            "cudaDeviceSynchronize": [],
            "cudaGetLastError": [],
            "cudaStreamBeginCapture": [vp, i],
            "cudaStreamEndCapture": [vp, ctypes.POINTER(vp)],
            # cudaGraphInstantiate changed in CUDA 12: (exec*, graph, errNode*, logBuf, bufSize) before, (exec*,
            # graph, unsigned long long flags) since. cudaGraphInstantiateWithFlags has had the 3-argument form since
            # CUDA 11.4, so this one declaration is right for every libcudart TensorRT 10 runs with (11.8, 12, 13).
            "cudaGraphInstantiateWithFlags": [ctypes.POINTER(vp), vp, ctypes.c_ulonglong],
            "cudaGraphLaunch": [vp, vp],
            "cudaGraphExecDestroy": [vp],
            "cudaGraphDestroy": [vp],
        }
        for fn, args in sigs.items():
            f = getattr(L, fn)
            f.argtypes, f.restype = args, i
        L.cudaGetErrorName.argtypes = L.cudaGetErrorString.argtypes = [i]
        L.cudaGetErrorName.restype = L.cudaGetErrorString.restype = ctypes.c_char_p
        self.device = device
        n = self.device_count()
        if n == 0:
            raise BackendUnavailableError("the CUDA runtime loaded but sees no GPU")
        if not 0 <= device < n:
            raise BackendUnavailableError(f"GPU {device} asked for; this machine has {n}")
        self._check(L.cudaSetDevice(device), "cudaSetDevice")

    # ------------------------------------------------------------------ errors
    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = self._lib.cudaGetErrorName(rc)
            text = self._lib.cudaGetErrorString(rc)
            raise CudaError(f"{what} failed: {name.decode() if name else rc} "
                            f"({text.decode() if text else 'unknown error'})")

    # ------------------------------------------------------------------ device
    def device_count(self) -> int:
        """GPUs visible; 0 where the driver is missing or sees none (not an error)."""
        n = ctypes.c_int(0)
        rc = self._lib.cudaGetDeviceCount(ctypes.byref(n))
        if rc in (35, 100):  # cudaErrorInsufficientDriver, cudaErrorNoDevice
            return 0
        self._check(rc, "cudaGetDeviceCount")
        return n.value

    def _attr(self, attr: int) -> int:
        v = ctypes.c_int(0)
        self._check(self._lib.cudaDeviceGetAttribute(ctypes.byref(v), attr, self.device), "cudaDeviceGetAttribute")
        return v.value

    def compute_capability(self) -> str:
        return f"{self._attr(_ATTR_CC_MAJOR)}.{self._attr(_ATTR_CC_MINOR)}"

    def device_name(self) -> str:
        """The GPU's name: the first field (char[256]) of cudaDeviceProp, read into a buffer larger than any
        version of the struct (1 KiB in CUDA 12)."""
        buf = ctypes.create_string_buffer(8192)
        fn = getattr(self._lib, "cudaGetDeviceProperties_v2", None) or self._lib.cudaGetDeviceProperties
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
        self._check(fn(buf, self.device), "cudaGetDeviceProperties")
        return buf.raw[:256].split(b"\0", 1)[0].decode(errors="replace")

    def integrated(self) -> bool:
        """True on Jetson (the GPU shares the system's memory)."""
        return bool(self._attr(_ATTR_INTEGRATED))

    def versions(self) -> tuple[int, int]:
        """(driver, runtime) as CUDA encodes them, e.g. 12060 for 12.6."""
        d, r = ctypes.c_int(0), ctypes.c_int(0)
        self._check(self._lib.cudaDriverGetVersion(ctypes.byref(d)), "cudaDriverGetVersion")
        self._check(self._lib.cudaRuntimeGetVersion(ctypes.byref(r)), "cudaRuntimeGetVersion")
        return d.value, r.value

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._check(self._lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
        return free.value, total.value

    # ------------------------------------------------------------------ memory
    def malloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        self._check(self._lib.cudaMalloc(ctypes.byref(p), max(1, nbytes)),
                    f"cudaMalloc({nbytes / 2**20:.1f} MiB)")
        return p.value or 0

    def free(self, ptr: int) -> None:
        if ptr:
            self._check(self._lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def malloc_host(self, nbytes: int) -> int:
        """Page-locked host memory (fast, asynchronous device-to-host copies)."""
        p = ctypes.c_void_p()
        self._check(self._lib.cudaMallocHost(ctypes.byref(p), max(1, nbytes)), "cudaMallocHost")
        return p.value or 0

    def free_host(self, ptr: int) -> None:
        if ptr:
            self._check(self._lib.cudaFreeHost(ctypes.c_void_p(ptr)), "cudaFreeHost")

    def memcpy(self, dst: int, src: int, nbytes: int, kind: int, stream: int | None = None) -> None:
        """Asynchronous on `stream`, or synchronous with stream None."""
        if stream is None:
            self._check(self._lib.cudaMemcpy(dst, src, nbytes, kind), "cudaMemcpy")
        else:
            self._check(self._lib.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")

    def memcpy2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, kind: int = D2D,
                 stream: int = 0) -> None:
        """`height` rows of `width` bytes, rows `spitch` apart in the source and `dpitch` in the destination."""
        self._check(self._lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream),
                    "cudaMemcpy2DAsync")

    def memset(self, ptr: int, value: int, nbytes: int, stream: int = 0) -> None:
        self._check(self._lib.cudaMemsetAsync(ptr, value, nbytes, stream), "cudaMemsetAsync")

    # ------------------------------------------------------------------ streams
    def stream_create(self) -> int:
        s = ctypes.c_void_p()
        # cudaStreamNonBlocking (1): no implicit synchronization with the legacy default stream, whose use by another
        # thread during a graph capture on this stream would otherwise invalidate the capture
        self._check(self._lib.cudaStreamCreateWithFlags(ctypes.byref(s), 1), "cudaStreamCreateWithFlags")
        return s.value or 0

    def stream_destroy(self, stream: int) -> None:
        if stream:
            self._check(self._lib.cudaStreamDestroy(stream), "cudaStreamDestroy")

    def synchronize(self, stream: int = 0) -> None:
        self._check(self._lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    # ------------------------------------------------------------------ graphs
    def begin_capture(self, stream: int) -> None:
        """Record, instead of run, the work enqueued on `stream` until :meth:`end_capture`. Thread-local mode (as
        trtexec captures TensorRT): calls unsafe under capture are refused on this thread only."""
        self._check(self._lib.cudaStreamBeginCapture(stream, _CAPTURE_THREAD_LOCAL), "cudaStreamBeginCapture")

    def end_capture(self, stream: int) -> int:
        """End the capture on `stream` (it runs work again either way) and return the graph. A capture invalidated
        by a call not allowed under capture raises; its error is cleared first (cudaGetLastError), so the calls
        after it do not report it again."""
        g = ctypes.c_void_p()
        rc = self._lib.cudaStreamEndCapture(stream, ctypes.byref(g))
        if rc != 0:
            self.graph_destroy(g.value or 0)
            self._lib.cudaGetLastError()
            self._check(rc, "cudaStreamEndCapture")
        return g.value or 0

    def graph_instantiate(self, graph: int) -> int:
        """An executable graph (cudaGraphExec_t) of `graph`, independent of it: the graph may be destroyed after."""
        e = ctypes.c_void_p()
        self._check(self._lib.cudaGraphInstantiateWithFlags(ctypes.byref(e), graph, 0), "cudaGraphInstantiateWithFlags")
        return e.value or 0

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        self._check(self._lib.cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch")

    def graph_exec_destroy(self, graph_exec: int) -> None:
        if graph_exec:
            self._check(self._lib.cudaGraphExecDestroy(graph_exec), "cudaGraphExecDestroy")

    def graph_destroy(self, graph: int) -> None:
        if graph:
            self._check(self._lib.cudaGraphDestroy(graph), "cudaGraphDestroy")


def host_array(ptr: int, shape: tuple[int, ...], dtype):
    """A numpy view of `shape` elements of `dtype` at host address `ptr` (pinned memory)."""
    import numpy as np

    dtype = np.dtype(dtype)
    n = int(np.prod(shape)) * dtype.itemsize
    buf = (ctypes.c_char * n).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)
