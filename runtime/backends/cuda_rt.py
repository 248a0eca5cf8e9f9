"""A lean CUDA binding: ctypes over libcudart, only what the GPU backends need.

Chosen over cuda-python/cupy/torch because JetPack 6 ships libcudart with every
CUDA install (no extra wheel to match to Python 3.10 + CUDA 12.6), and two
functions are all the runtime needs. Untested here (no GPU on the CI machine).
"""

from __future__ import annotations

import ctypes
import ctypes.util

from ..errors import BackendUnavailableError

_D2D = 3  # cudaMemcpyDeviceToDevice


class CudaRuntime:
    def __init__(self) -> None:
        names = [ctypes.util.find_library("cudart"), "libcudart.so", "libcudart.so.12", "libcudart.so.13"]
        for n in filter(None, names):
            try:
                self._lib = ctypes.CDLL(n)
                break
            except OSError:
                continue
        else:
            raise BackendUnavailableError("libcudart was not found; install the CUDA runtime")
        self._lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                                ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with cudaError {rc}")

    def memcpy2d_d2d(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int,
                     stream: int = 0) -> None:
        self._check(self._lib.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, _D2D, stream),
                    "cudaMemcpy2DAsync")

    def synchronize(self, stream: int = 0) -> None:
        self._check(self._lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
