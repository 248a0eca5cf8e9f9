"""Backends: one module each, one small protocol.

A backend opens a :class:`GraphRunner` per model of a bundle. A runner owns the
model's session and its KV buffers (allocated once, at S_max) and binds its
inputs/outputs once per declared width. ``step`` feeds token ids at a cache
position, writes the new KV rows at that position and returns logits; the cursor
itself lives with the caller, so rollback is just passing a smaller ``past_len``.
Heavy imports (onnxruntime, tensorrt, CUDA) happen inside the backend modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from ..errors import BackendUnavailableError
from ..manifest import Manifest, ModelEntry

BACKENDS = ("auto", "ort-cpu", "ort-cuda", "trt")


class GraphRunner(Protocol):
    entry: ModelEntry
    max_context: int
    pads_into_cache: bool  # True: a step writes all T rows (padding too) at past_len, so past_len + T <= S_max

    def step(self, tokens: Sequence[int], past_len: int, all_logits: bool) -> np.ndarray:
        """Run len(tokens) new tokens at positions past_len.. and write their KV rows there.

        Returns logits [len(tokens), V] if all_logits else [1, V] for the last token: a view
        into a buffer the runner owns, valid until the next step.
        """

    def close(self) -> None: ...


def available_backends() -> list[str]:
    """Backends usable here, best first."""
    out = []
    try:
        import onnxruntime as ort

        if "CUDAExecutionProvider" in ort.get_available_providers():
            out.append("ort-cuda")
        out.append("ort-cpu")
    except ImportError:  # pragma: no cover - base dependency
        pass
    return out


def resolve_backend(name: str, manifest: Manifest) -> str:
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    have = available_backends()
    if name == "auto":
        # trt is preferred once engines are built for the bundle; the TensorRT backend is its own issue.
        if not have:
            raise BackendUnavailableError("no backend available: install onnxruntime")
        return have[0]
    if name == "trt":
        raise BackendUnavailableError(
            "the TensorRT backend is not implemented yet (tracked in the TensorRT issue); use ort-cpu or ort-cuda")
    if name not in have:
        raise BackendUnavailableError(
            f"backend {name!r} is not available here (available: {', '.join(have) or 'none'}); "
            + ("install onnxruntime-gpu and a CUDA driver" if name == "ort-cuda" else ""))
    return name


def open_runner(backend: str, bundle_dir: Path, manifest: Manifest, role: str,
                threads: int | None = None) -> GraphRunner:
    from .ort import OrtRunner

    return OrtRunner(bundle_dir, manifest, role, device="cuda" if backend == "ort-cuda" else "cpu",
                     threads=threads)
