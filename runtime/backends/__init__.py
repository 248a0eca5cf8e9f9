"""Backends: one module each, one small protocol.

A backend opens a :class:`GraphRunner` per model of a bundle. A runner owns the
model's session and its KV buffers (allocated once, at S_max) and binds its
inputs/outputs once per declared width. ``step`` feeds token ids at a cache
position, writes the new KV rows at that position and returns logits; the cursor
itself lives with the caller, so rollback is just passing a smaller ``past_len``.
Heavy imports (onnxruntime, tensorrt, CUDA) happen inside the backend modules.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from ..errors import BackendUnavailableError, OptionError
from ..manifest import ROWS_KV_MODE, Manifest, ModelEntry, width_shapes
from .requirements import MIN_TENSORRT, tensorrt_version_problem  # noqa: F401 (re-exported: doctor, export)

BACKENDS = ("auto", "ort-cpu", "ort-cuda", "ort-trt", "trt")
TRT_EP_CACHE = "trt-ep-cache"  # inside the bundle: the TensorRT execution provider's engine and timing caches


class GraphRunner(Protocol):
    entry: ModelEntry
    max_context: int
    pads_into_cache: bool  # True: a step writes all T rows (padding too) at past_len, so past_len + T <= S_max
    # Narrowest width a step may run in (fewer tokens are padded), given when the runner opens. A decoder's target
    # gets 2 unless its kernels are exact at width 1 (factory.plain_width): ONNX Runtime CPU computes a width-1 step
    # with other kernels (GEMV; MatMulNBits' M=1 path) than any wider step, while rows of every width >= 2 are
    # bitwise identical — so never running width 1 makes every logits row independent of how its step was batched.
    min_width: int
    has_argmax: bool  # the graph outputs next_ids (Manifest.device_argmax): step(ids_only=True) is available

    def step(self, tokens: Sequence[int], past_len: int, all_logits: bool, ids_only: bool = False) -> np.ndarray:
        """Run len(tokens) new tokens at positions past_len.. and write their KV rows there.

        Returns logits [len(tokens), V] if all_logits else [1, V] for the last token (V: the entry's
        ``logits_width``, a draft's partial head narrower than the vocabulary): a view
        into a buffer the runner owns, valid until the next step. ids_only (runners with has_argmax): the
        int64 argmax of those rows instead, [len(tokens)] or [1] — only the ids leave the device.
        """

    def close(self) -> None: ...


class SlotView:
    """One sequence's view of a row-addressed runner (kv_mode rows): a :class:`GraphRunner` whose steps run in
    slot ``slot`` of its cache pool, for the code that decodes one request at a time."""

    def __init__(self, runner: GraphRunner, slot: int):
        self.runner, self.slot = runner, slot

    def __getattr__(self, name: str):  # noqa: ANN204 - entry, min_width, widths... are the runner's
        return getattr(self.runner, name)

    def step(self, tokens: Sequence[int], past_len: int, all_logits: bool, ids_only: bool = False) -> np.ndarray:
        return self.runner.step(tokens, past_len, all_logits, ids_only, slot=self.slot)  # type: ignore[call-arg]

    def step_tree(self, tokens: Sequence[int], positions: Sequence[int], parents: Sequence[int],
                  ids_only: bool = False) -> np.ndarray:
        return self.runner.step_tree(tokens, positions, parents, ids_only, slot=self.slot)  # type: ignore[attr-defined]

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self.runner.move_rows(src, dst, slot=self.slot)  # type: ignore[attr-defined]


def tree_rows(runner: GraphRunner) -> bool:
    """Whether a runner verifies trees (``step_tree``, ``move_rows``): a row-addressed bundle on the CPU."""
    return bool(getattr(runner, "rows_mode", False)) and getattr(runner, "device", None) == "cpu"


def copies_rows(runner: GraphRunner | None) -> bool:
    """Whether a runner copies cache rows between its slots (``copy_slot_rows``): a pool of its own on the CPU."""
    return tree_rows(runner) and getattr(runner, "kv", None) is not None and getattr(runner, "slots", 1) > 1


def tensorrt_installed() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def available_backends() -> list[str]:
    """Backends whose libraries are importable here, best first (a GPU is checked when a runner opens)."""
    out = ["trt"] if tensorrt_installed() else []
    try:
        import onnxruntime as ort

        providers = ort.get_available_providers()
        if "TensorrtExecutionProvider" in providers:
            out.append("ort-trt")
        if "CUDAExecutionProvider" in providers:
            out.append("ort-cuda")
        out.append("ort-cpu")
    except ImportError:  # pragma: no cover - base dependency
        pass
    return out


def resolve_backend(name: str, manifest: Manifest) -> str:
    """`name`, or for "auto" the best backend this machine and bundle allow: TensorRT where engines are built
    and TensorRT is installed, then ONNX Runtime CUDA, then CPU."""
    if name not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    have = available_backends()
    if name == "auto":
        has_engines = any(v.get("kind") == "trt" for v in manifest.engines.values())
        pick = [b for b in have if b != "ort-trt" and (b != "trt" or has_engines)]
        if not pick:
            raise BackendUnavailableError("no backend available: install onnxruntime")
        return pick[0]
    if name not in have:
        how = {"trt": "install TensorRT (JetPack's python3-libnvinfer, or pip install 'specedge[trt]')",
               "ort-cuda": "install onnxruntime-gpu and a CUDA driver",
               "ort-trt": "install onnxruntime-gpu built with TensorRT, and TensorRT"}.get(name, "")
        raise BackendUnavailableError(
            f"backend {name!r} is not available here (available: {', '.join(have) or 'none'}); {how}; "
            "`spec-export doctor` explains what this machine has")
    return name


def open_runner(backend: str, bundle_dir: Path, manifest: Manifest, role: str, threads: int | None = None,
                precision: str | None = None, shared: dict | None = None, cuda_graphs: bool = True,
                accuracy_level: int | None = None, min_width: int = 1, slots: int = 1,
                weights: dict | None = None, kv_of: GraphRunner | None = None) -> GraphRunner:
    """One model's runner. precision: None/"fp32" runs the fp32 graph on ONNX Runtime; "fp16" runs the bundle's
    fp16 ONNX graphs (``spec-export build --backend onnx``); TensorRT runs the built engines (None: the only
    precision built). shared: per-decoder state the runners of one bundle share (TensorRT: stream, scratch).
    cuda_graphs: TensorRT replays each width's step as a CUDA graph (False: plain execute); other backends
    ignore it. accuracy_level: ONNX Runtime, --quant-form qdq graphs: the fused MatMulNBits' compute precision
    instead of the bundle's (validate: 0). slots: sequences the KV cache holds (row-addressed bundles only).
    weights: the model's tensors read by :func:`.ort.shared_weights` (ort-cpu); kv_of: a self draft's target runner,
    whose cache it shares (ort-cpu)."""
    if (weights or kv_of is not None) and backend != "ort-cpu":
        raise BackendUnavailableError(f"{bundle_dir} has a self draft (the target's own layers, sharing its weights "
                                      f"and KV cache in host memory), which runs on ort-cpu; backend {backend} "
                                      "cannot share them (export a draft model, or --draft prompt-lookup)")
    if slots > 1 and (backend != "ort-cpu" or manifest.kv_mode != ROWS_KV_MODE):
        raise BackendUnavailableError(
            f"max_batch {slots}: decoding several requests together needs row-addressed steps (each row names its "
            f"sequence's KV slot and position), which specedge's CPU attention has (a bundle in the specedge form, "
            f"kv_mode rows, on ort-cpu); this bundle has kv_mode {manifest.kv_mode} on {backend}, whose graphs take "
            "one sequence per step. Use max_batch 1 here, or export in the specedge form for a CPU "
            "(spec-export export --for cpu, --kv-mode rows)")
    if backend == "trt":
        from .trt import TrtRunner

        return TrtRunner(bundle_dir, manifest, role, manifest.engine_set("trt", precision), shared,
                         cuda_graphs=cuda_graphs, min_width=min_width)
    from .ort import OrtRunner

    engines = manifest.engine_set("onnx", precision) if precision not in (None, "fp32") else None
    providers = None
    if backend == "ort-trt":
        providers = [("TensorrtExecutionProvider", trt_ep_options(bundle_dir, manifest, role)),
                     ("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
    return OrtRunner(bundle_dir, manifest, role, device="cpu" if backend == "ort-cpu" else "cuda",
                     threads=threads, engines=engines, providers=providers, accuracy_level=accuracy_level,
                     min_width=min_width, slots=slots, weights=weights, kv_of=kv_of)


def open_runners(backend: str, bundle_dir: Path, manifest: Manifest, threads: int | None = None,
                 precision: str | None = None, cuda_graphs: bool = True, target_min_width: int = 1,
                 target_slots: int = 1) -> tuple[GraphRunner, GraphRunner | None, dict]:
    """A bundle's target runner (its steps at least ``target_min_width`` wide, its cache ``target_slots`` sequences),
    its draft runner (None without a draft
    model) and what they share (close it with :func:`close_shared` after both runners). A failure frees whatever had
    opened."""
    shared: dict = {}
    target = draft = None
    try:
        weights = draft_weights = None
        self_draft = manifest.draft is not None and manifest.draft.is_self
        if self_draft:
            if target_slots > 1:
                raise OptionError(f"max_batch {target_slots}: {bundle_dir}'s self draft drafts in the target's cache "
                                  "of one sequence; load it with max_batch 1, or export a draft model "
                                  "(or --draft prompt-lookup) to decode several requests together")
            if backend != "ort-cpu" or precision not in (None, "fp32"):
                raise BackendUnavailableError(
                    f"{bundle_dir} has a self draft (the target's own layers, sharing its weights and KV cache in "
                    f"host memory), which runs on ort-cpu in fp32; {backend} {precision or ''} cannot share them")
        from .ort import shared_weights

        def read(entry: ModelEntry) -> dict | None:  # the tensors the manifest lists, for the graphs that have them
            if backend != "ort-cpu" or precision not in (None, "fp32") or not entry.tensors:
                return None
            return shared_weights(Path(bundle_dir) / str(entry.weights), entry.tensors)

        # a self draft's tensors are its target's file (a bundle exported before lists them on the draft only)
        weights = read(manifest.target) or (read(manifest.draft) if self_draft else None)
        draft_weights = weights if self_draft else (read(manifest.draft) if manifest.draft else None)
        target = open_runner(backend, bundle_dir, manifest, "target", threads, precision, shared,
                             cuda_graphs=cuda_graphs, min_width=target_min_width, slots=target_slots,
                             weights=weights)
        # a draft model of a row-addressed bundle holds as many sequences as the target: each request decoded
        # together drafts in its own slot, and their draws share one draft step (runtime/batch.py)
        draft = (open_runner(backend, bundle_dir, manifest, "draft", threads, precision, shared,
                             cuda_graphs=cuda_graphs, weights=draft_weights, kv_of=target if self_draft else None,
                             slots=1 if self_draft else target_slots)
                 if manifest.draft else None)
        del weights, draft_weights  # the sessions hold them
    except BaseException:  # device memory is not left to the garbage collector
        for runner in (draft, target):
            if runner is not None:
                runner.close()
        close_shared(shared)
        raise
    return target, draft, shared


def close_shared(shared: dict) -> None:
    """Free what the runners of one bundle share (TensorRT: the scratch and the stream both runners used)."""
    if "scratch" in shared:
        shared["scratch"].close()
        shared["cuda"].stream_destroy(shared["stream"])
    shared.clear()


def trt_ep_options(bundle_dir: Path, manifest: Manifest, role: str) -> dict[str, object]:
    """ONNX Runtime TensorRT execution provider options: engine and timing caches inside the bundle, and ONE
    optimization profile spanning every declared width (min: the narrowest T and L, max: the widest, opt: the
    verify width K+1, what most rounds run). One profile because the EP keeps its execution context on profile
    0: with a profile per width, the first step of another width fails."""
    entry = manifest.models[role]
    shapes = [width_shapes(entry.dims, w, manifest.max_context) for w in entry.widths]
    verify = max((w for w in entry.widths if w.L == w.T), key=lambda w: w.T)
    opt = width_shapes(entry.dims, verify, manifest.max_context)
    lo = {n: tuple(min(s[n][i] for s in shapes) for i in range(len(shape))) for n, shape in opt.items()}
    hi = {n: tuple(max(s[n][i] for s in shapes) for i in range(len(shape))) for n, shape in opt.items()}
    fmt = lambda d: ",".join(f"{name}:{'x'.join(map(str, shape))}" for name, shape in d.items())  # noqa: E731
    cache = str(Path(bundle_dir) / TRT_EP_CACHE)
    return {"device_id": 0, "trt_engine_cache_enable": True, "trt_engine_cache_path": cache,
            "trt_timing_cache_enable": True, "trt_timing_cache_path": cache,
            "trt_profile_min_shapes": fmt(lo), "trt_profile_opt_shapes": fmt(opt), "trt_profile_max_shapes": fmt(hi)}
