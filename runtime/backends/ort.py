"""ONNX Runtime backend: CPU (tested) and CUDA (IOBinding on device; untested here, no GPU).

Buffer ownership (all allocated once, when the runner opens):

* ``kv`` — the runner's KV cache, one block [n_layers, 2, B, H_kv, S_max, D] with per-layer
  views bound as ``past_key_values.{i}.key|value`` for every width. Rows [0, past_len) are
  valid; the caller owns the cursor. Rows at and beyond the cursor are overwritten by later steps.
* per width: ``input_ids`` [B, T], ``past_len`` [B], ``logits_at`` [B, L] (host), ``logits``
  [B, L, V] and ``present.{i}.*`` [B, H_kv, T, D] outputs — rewritten by every step at that width.

A step fills ids and past_len, runs the bound graph, and copies the first n present rows into
the cache at past_len (a numpy slice on CPU; one strided cudaMemcpy2D per tensor on GPU).

In the ``ort-inplace`` KV mode the ``present.{i}.*`` outputs are bound to the cache tensors
themselves: GroupQueryAttention writes all T rows (padding included) at past_len, so nothing is
copied, and a width is usable only where past_len + T <= S_max (:attr:`pads_into_cache`).

In the ``rows`` KV mode (row-addressed steps) the cache is a pool of ``slots`` sequences,
[n_layers, 2, slots, H_kv, S_max, D], bound in place as in ort-inplace; ``past_len`` is replaced by
``row_slot`` [T] and ``row_pos`` [T]: each row's slot and position (-1: a padding row, never written).
``step`` runs one sequence's tokens in one slot; ``step_rows`` runs rows of several.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..cpu import INT16_MAX, int16_pair_saturation, physical_cores
from ..errors import BackendUnavailableError, BundleError, OutOfMemoryError
from ..manifest import (
    GRAPH_POSITIONS_KEY,
    INTGEMM_FORMAT,
    QDQ_FORMAT,
    ROLE_PREFILL,
    ROLE_VERIFY,
    ROWS_KV_MODE,
    SEK_FORMAT,
    EngineSet,
    Manifest,
    Width,
    io_spec,
    kv_row_width,
)


@dataclass
class _Bound:
    width: Width
    binding: Any  # onnxruntime.IOBinding
    input_ids: np.ndarray  # [1, T] int64, host
    past_len: np.ndarray  # [1] int64, host (rows mode: row_slot [T])
    logits_at: np.ndarray  # [1, L] int64, host
    logits: np.ndarray | None  # [1, L, V] float32 host (CPU) ...
    logits_dev: Any  # ... or a device OrtValue (CUDA)
    present: list[Any]  # per layer*2: host arrays (CPU) or device OrtValues (CUDA)
    ids: Any = None  # next_ids [1, L] int64: a host array (CPU) or a device OrtValue (CUDA); None without argmax
    row_pos: np.ndarray | None = None  # rows mode: [T] int64, host
    row_parent: np.ndarray | None = None  # rows mode: [T] int64, host (-1: no parent)


def open_session(ort: Any, path: Path, so: Any, providers: list, given: dict[str, np.ndarray] | None = None) -> Any:
    """An InferenceSession whose weights were read, not mapped. Left to itself ONNX Runtime maps the external data
    file ``<graph>.onnx.data`` and reads the weights from the mapping for as long as the session lives: a file
    truncated under a running process (``cp`` over it) then kills that process with SIGBUS, and one zeroed in place
    silently changes its answers. Handed the file's contents, it copies what it needs while the session is made,
    and the file is never touched again (a changed file is found by :class:`..bundle_files.FileWatch`). That copy
    is made while the mapping is also resident: a load's peak memory is about twice the weights. ``given``: the
    file's tensors, already read and added to ``so`` as initializers (:func:`shared_weights`): when they are all of
    it (a manifest's ``ModelEntry.tensors``), the session is made without the file, and the load's peak is the weights
    once (a tensor missing from ``given`` would be mapped by ONNX Runtime)."""
    data = path.with_name(path.name + ".data")
    names = {p if isinstance(p, str) else p[0] for p in providers}
    # ONNX Runtime's TensorRT execution provider parses the model from its file itself (ort-trt): left as it was
    # (empty: no mmap; ``given``: ONNX Runtime reads nothing of the file)
    if not data.is_file() or not data.stat().st_size or "TensorrtExecutionProvider" in names or given:
        return ort.InferenceSession(str(path), so, providers=providers)
    with open(data, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        so.add_external_initializers_from_files_in_memory([data.name], [view], [len(view)])
        return ort.InferenceSession(str(path), so, providers=providers)


ONNX_NUMPY = {1: np.float32, 2: np.uint8, 3: np.int8, 5: np.int16, 6: np.int32, 7: np.int64, 10: np.float16}


def shared_weights(path: Path, tensors: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """A weights file's tensors (``ModelEntry.tensors``: name -> (offset, length, ONNX type, *dims)), read once
    into arrays that sessions use as their initializers (``SessionOptions.add_initializer``: ONNX Runtime keeps the
    caller's buffer and copies nothing; a self draft's session and its target's use the same arrays). Read, not
    mapped, for the reason :func:`open_session` gives."""
    out = {}
    size = path.stat().st_size
    with open(path, "rb") as f:
        for name, (offset, length, onnx_type, *dims) in tensors.items():
            dtype = ONNX_NUMPY.get(onnx_type)
            count = int(np.prod(dims, dtype=np.int64))
            if dtype is None or count * np.dtype(dtype).itemsize != length or offset + length > size:
                raise BundleError(f"{path.name}: the shared tensor {name} (offset {offset}, {length} bytes, ONNX type "
                                  f"{onnx_type}, dims {dims}) does not fit the file ({size} bytes) or its type")
            buf = np.empty(count, dtype=dtype)
            f.seek(offset)
            if f.readinto(memoryview(buf).cast("B")) != length:
                raise BundleError(f"{path.name}: the shared tensor {name} was cut short")
            out[name] = buf.reshape(dims)
    return out


def zero_device_cache(cuda: Any, values: list, nbytes: int) -> None:
    """Zero every cache tensor once. ONNX Runtime's device allocations are uninitialized, and the portable
    attention multiplies masked probabilities (exactly 0) by every cache row: 0 * NaN = NaN, so garbage in rows
    past the cursor would poison every logit."""
    for v in values:
        cuda.memset(v.data_ptr(), 0, nbytes)
    cuda.synchronize()


def check_graph_io(session: Any, spec: tuple[list, list], what: str) -> None:
    """The graph's declared inputs/outputs must be the manifest's (names, element types, fixed dims): a bundle
    whose manifest and graph disagree is refused here, naming both, not deep inside ONNX Runtime."""
    for kind, declared, want in (("input", session.get_inputs(), spec[0]), ("output", session.get_outputs(), spec[1])):
        have = {a.name: a for a in declared}
        missing = [t.name for t in want if t.name not in have]
        extra = sorted(set(have) - {t.name for t in want})
        if missing or extra:
            raise BundleError(f"{what}: graph {kind}s differ from the manifest's contract: missing {missing[:4]}, "
                              f"unexpected {extra[:4]} (the manifest's n_layers/kv_mode do not match this graph?)")
        for t in want:
            shape = have[t.name].shape
            # fixed dims must agree; named dims too where the graph names them (T vs S_max tells kv_mode apart)
            fixed = [(i, d, shape[i]) for i, d in enumerate(t.shape) if len(shape) == len(t.shape)
                     and type(d) is type(shape[i]) and shape[i] != d]
            if len(shape) != len(t.shape) or fixed:
                raise BundleError(f"{what}: {kind} {t.name} has shape {shape} in the graph, the manifest implies "
                                  f"{list(t.shape)} (dims n_kv_heads/head_dim/vocab or kv_mode disagree)")


QDQ_MIN_ORT = (1, 25)  # int4 blocks fuse from 1.20, 8-bit blocks (Q8_0, Q6_K, the int8 lm_head) from 1.25


def qdq_runtime_check(version: str) -> None:
    """QDQ int4/int8 graphs are only fast where ONNX Runtime fuses blocked DequantizeLinear + MatMul into
    MatMulNBits at load; an older one would dequantize every matrix at every step (and hold fp32 copies)."""
    try:
        have = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        return
    if have < QDQ_MIN_ORT:
        raise BackendUnavailableError(
            f"this bundle's quantized graphs are DequantizeLinear + MatMul (--quant-form qdq), which ONNX Runtime "
            f">= {'.'.join(map(str, QDQ_MIN_ORT))} fuses into MatMulNBits; onnxruntime {version} would dequantize "
            "every weight at every step. Upgrade onnxruntime, or re-export with --quant-form matmulnbits")


def intgemm_runtime_check(quant: dict, what: str, saturates: bool | None) -> None:
    """Integer-GEMM bundles record the largest pair sum |a1 w1 + a2 w2| their ranges allow (``pair_sum_bound``,
    export/quant.py quantize_channels). Above INT16_MAX — ``--intgemm-full-range``, or a bundle from before the
    bound was recorded (full ranges) — ONNX Runtime's int16 pair sums on x86 CPUs without VNNI can saturate: rows
    then depend on the kernel, i.e. on the step's width, and speculative output could differ from plain. Refused
    there, with the way out; exact on VNNI and Arm CPUs, and nothing is refused where the CPU flags cannot be
    read."""
    if INTGEMM_FORMAT not in (quant.get("format") or "") or not saturates:
        return
    bound = quant.get("pair_sum_bound")
    if bound is not None and bound <= INT16_MAX:
        return
    raise BundleError(
        f"{what}: its integer-GEMM matrices hold full-range int8 weights and activations (products summed in pairs "
        f"reach {bound or 65280}), which this CPU's integer kernel (no VNNI: saturating int16 pair sums) can "
        "saturate, so speculative output could differ from plain. Re-export the bundle with this specedge and "
        "without --intgemm-full-range (its default ranges are exact on every CPU), or run it on a CPU with "
        "AVX512-VNNI / AVX-VNNI, or on Arm.")


class OrtRunner:
    """One model of a bundle on ONNX Runtime, buffers bound once per width."""

    def __init__(self, bundle_dir: Path, manifest: Manifest, role: str, device: str = "cpu",
                 threads: int | None = None, engines: EngineSet | None = None, providers: list | None = None,
                 accuracy_level: int | None = None, min_width: int = 1, slots: int = 1,
                 weights: dict[str, np.ndarray] | None = None, kv_of: OrtRunner | None = None):
        """engines: a reduced-precision ("onnx") engine set to run instead of the fp32 graph.
        providers: ONNX Runtime execution providers (default: CUDA for device "cuda", else CPU).
        accuracy_level: for --quant-form qdq graphs, the fused MatMulNBits' compute precision instead of the
        bundle's (validate runs 0, fp32 compute: what a weight-only INT4 engine computes).
        slots: sequences the KV cache holds (a row-addressed bundle, kv_mode rows; 1 otherwise).
        weights: initializers handed to the session instead of read from the graph's data (a self draft's and its
        target's shared tensors, :func:`shared_weights`). kv_of (a self draft): the target runner whose cache rows
        of the layers ``entry.layers`` are this model's cache (CPU)."""
        import onnxruntime as ort

        self.entry = manifest.models[role]
        graph = self.entry.graph
        self.kv_dtype = np.dtype(manifest.kv_dtype)
        if engines is not None:
            if engines.kind != "onnx" or engines.kv_dtype != "float16":
                raise BackendUnavailableError(
                    f"ONNX Runtime runs the fp32 graphs and fp16 ONNX engine sets; {engines.key} needs TensorRT")
            graph, self.kv_dtype = engines.graphs[role], np.dtype(np.float16)
        self.max_context = manifest.max_context
        self.device = device
        self.pads_into_cache = manifest.kv_mode == "ort-inplace"  # a step writes all T rows at past_len
        self.rows_mode = manifest.kv_mode == ROWS_KV_MODE  # row-addressed steps over a pool of slots
        if slots != 1 and not self.rows_mode:
            raise BundleError(f"{bundle_dir} ({role}) has kv_mode {manifest.kv_mode}: its cache holds one sequence, "
                              f"and {slots} were asked for; row-addressed steps need kv_mode rows (spec-export "
                              "export in the specedge form: --kv-mode rows, the CPU profile's default)")
        self.slots = slots
        self.min_width = min_width  # narrowest width a step runs in (GraphRunner.min_width)
        self.has_argmax = manifest.device_argmax
        d = self.entry.dims
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = threads or physical_cores()
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "1")
        # Spin inside a step (the per-operator hand-offs depend on it), but stop when the step returns: the draft and
        # the target each have a thread pool, and a pool left spinning after its step takes a core from the other
        # model's next step. On 2 cores, without this, a 0.5B draft step ran 1.7x and the verify after it 1.6x
        # their own speed, and draft-model decoding (k=3) 15 tok/s where it now runs 24-26 (docs/benchmarks.md).
        so.add_session_config_entry("session.force_spinning_stop", "1")
        quant = self.entry.quant or {}
        if device == "cpu":
            intgemm_runtime_check(quant, f"{bundle_dir} ({role})", int16_pair_saturation())
        if quant.get("format") == SEK_FORMAT:  # specedge's own kernel: a CPU custom op, built on first use
            if device != "cpu":
                raise BackendUnavailableError(
                    f"{bundle_dir} ({role}) runs specedge's CPU kernels (--quant-form specedge); on a GPU re-export "
                    "it with --quant-form qdq (TensorRT) or matmulnbits")
            from ..kernels import register

            register(so)
        if quant.get("format") == QDQ_FORMAT:
            qdq_runtime_check(ort.__version__)
            # the fused MatMulNBits' compute precision: the bundle's, not ONNX Runtime's default (4, int8)
            level = accuracy_level if accuracy_level is not None else quant.get("accuracy_level", 4)
            so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
        if device == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise BackendUnavailableError("ort-cuda needs onnxruntime-gpu with a working CUDA install")
            providers = providers or [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
        else:
            providers = providers or ["CPUExecutionProvider"]
        self._weights = []  # the shared initializers' OrtValues: they must outlive the session
        for name, arr in (weights or {}).items():
            value = ort.OrtValue.ortvalue_from_numpy(arr)
            so.add_initializer(name, value)
            self._weights.append(value)
        path = Path(bundle_dir) / graph
        if not path.is_file():
            raise BundleError(f"{role} graph {path} is missing")
        try:
            self.session = open_session(ort, path, so, providers, given=weights)
        except Exception as e:  # ONNX Runtime's own exception types (InvalidGraph, Fail, ...)
            raise BundleError(f"ONNX Runtime cannot load the {role} graph {graph}: {str(e).splitlines()[0][:300]}") \
                from None
        check_graph_io(self.session, io_spec(self.entry.dims, manifest.kv_mode, self.kv_dtype.name, self.has_argmax,
                                                 self.entry.logits_width),
                       f"{role} {graph}")
        self._ort = ort
        positions = self.session.get_modelmeta().custom_metadata_map.get(GRAPH_POSITIONS_KEY, "")
        if positions.isdigit() and int(positions) < self.max_context:  # (graphs exported before it say nothing)
            raise BundleError(f"the {role} graph {graph} holds positions up to {positions}, and the manifest's "
                              f"max_context is S_max={self.max_context}: the manifest was changed; export again "
                              f"with --max-context {self.max_context}")
        kv_shape = (d.n_layers, 2, slots, d.n_kv_heads, self.max_context, kv_row_width(d.head_dim, self.kv_dtype.name))
        self.kv_of = kv_of
        if kv_of is not None:  # a self draft: the target's cache of the layers it runs, the same memory
            if device != "cpu" or kv_of.slots != slots or kv_of.kv_dtype != self.kv_dtype:
                raise BackendUnavailableError(f"{bundle_dir} ({role}): a self draft shares its target's cache on "
                                              "the CPU, with as many slots and the same dtype")
            self.kv = None
            self._kv_values = [kv_of._kv_values[2 * i + j] for i in self.entry.layers for j in range(2)]
        elif device == "cpu":
            try:
                self.kv = np.zeros(kv_shape, dtype=self.kv_dtype)  # owned here; see module docstring
            except MemoryError:
                need = int(np.prod(kv_shape)) * self.kv_dtype.itemsize
                raise OutOfMemoryError(f"the {role} model's KV cache at S_max={self.max_context}"
                                       + (f" for {slots} sequences" if slots > 1 else "") + " needs "
                                       f"{need / 2 ** 30:.1f} GiB, which this machine cannot allocate; export with "
                                       f"a smaller --max-context (`spec-export plan` sizes a bundle for a memory "
                                       f"budget)") from None
            self._kv_values = [ort.OrtValue.ortvalue_from_numpy(self.kv[i, j]) for i in range(d.n_layers)
                               for j in range(2)]
        else:
            from .cuda_rt import CudaRuntime

            self._cuda = CudaRuntime()
            self._kv_values = [ort.OrtValue.ortvalue_from_shape_and_type(kv_shape[2:], self.kv_dtype, "cuda", 0)
                               for _ in range(d.n_layers * 2)]
            zero_device_cache(self._cuda, self._kv_values, int(np.prod(kv_shape[2:])) * self.kv_dtype.itemsize)
        self._arange = np.arange(max(w.T for w in self.entry.widths), dtype=np.int64)  # rows mode: row_pos offsets
        self._bound = {w.T: self._bind(w) for w in self.entry.widths}
        # On the CPU every width that computes each row's logits also runs with its last row's alone (the graph takes
        # any number of logits rows): a prompt's last chunk then runs the lm_head once, not for every row of its width
        # (Qwen2.5-Coder-1.5B, 48 rows on 2 EPYC cores: 256 ms against 299). Steps that ask for every row's logits
        # never use these; which logits a prompt's last step may take from them is feed_plan's ``lone_last``.
        self._lone = ({w.T: self._bind(Width(ROLE_PREFILL, w.T, 1)) for w in self.entry.widths
                       if w.L == w.T > 1} if device == "cpu" else {})
        # what a step picks from, made once: every declared width; with a last-row-only step, their lone twins too
        self._picks = {True: list(self._bound.values()), False: [*self._bound.values(), *self._lone.values()]}
        self._by_rows: dict[tuple[int, int], _Bound] = {}  # (T, L): step_rows with logits_rows (made as asked)
        self._rows_logits: np.ndarray | None = None  # their one logits buffer

    # ------------------------------------------------------------------ binding
    def _bind(self, w: Width, logits_into: np.ndarray | None = None) -> _Bound:
        """Buffers for one width, bound once; ``logits_into`` (CPU): a [1, >= L, V] buffer whose leading rows take
        the logits, shared with other bindings."""
        ort, d = self._ort, self.entry.dims
        io = self.session.io_binding()
        ids = np.zeros((1, w.T), dtype=np.int64)
        at = np.arange(w.L, dtype=np.int64)[None] if w.L == w.T else np.zeros((1, w.L), dtype=np.int64)
        row_pos = row_parent = None
        if self.rows_mode:
            past, row_pos = np.full((w.T,), -1, dtype=np.int64), np.zeros((w.T,), dtype=np.int64)
            row_parent = np.full((w.T,), -1, dtype=np.int64)
            host_inputs = {"input_ids": ids, "row_slot": past, "row_pos": row_pos, "row_parent": row_parent,
                           "logits_at": at}
        else:
            past = np.zeros((1,), dtype=np.int64)
            host_inputs = {"input_ids": ids, "past_len": past, "logits_at": at}
        for name, arr in host_inputs.items():
            io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        names = [f"{i}.{k}" for i in range(d.n_layers) for k in ("key", "value")]
        for name, val in zip(names, self._kv_values):
            io.bind_ortvalue_input(f"past_key_values.{name}", val)
        if self.device == "cpu":
            logits = (np.zeros((1, w.L, self.entry.logits_width), dtype=np.float32) if logits_into is None
                      else logits_into[:, : w.L])
            io.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
            logits_dev = None
        else:
            logits = None
            logits_dev = ort.OrtValue.ortvalue_from_shape_and_type((1, w.L, self.entry.logits_width), np.float32,
                                                                   "cuda", 0)
            io.bind_ortvalue_output("logits", logits_dev)
        pshape = (1, d.n_kv_heads, w.T, d.head_dim)
        if self.pads_into_cache or self.rows_mode:  # present IS the cache: the same OrtValues as the past inputs
            present_values, present = self._kv_values, []
        elif self.device == "cpu":
            present = [np.zeros(pshape, dtype=self.kv_dtype) for _ in names]
            present_values = [ort.OrtValue.ortvalue_from_numpy(arr) for arr in present]
        else:
            present = [ort.OrtValue.ortvalue_from_shape_and_type(pshape, self.kv_dtype, "cuda", 0) for _ in names]
            present_values = present
        for name, val in zip(names, present_values):
            io.bind_ortvalue_output(f"present.{name}", val)
        next_ids = None
        if self.has_argmax:
            next_ids = (np.zeros((1, w.L), dtype=np.int64) if self.device == "cpu"
                        else ort.OrtValue.ortvalue_from_shape_and_type((1, w.L), np.int64, "cuda", 0))
            io.bind_ortvalue_output("next_ids", ort.OrtValue.ortvalue_from_numpy(next_ids) if self.device == "cpu"
                                    else next_ids)
        # Keep the host arrays alive: the OrtValues above only borrow their memory.
        self._keepalive = getattr(self, "_keepalive", []) + [host_inputs]
        return _Bound(w, io, ids, past, at, logits, logits_dev, present, next_ids, row_pos, row_parent)

    def _pick(self, n: int, all_logits: bool, past_len: int, lone: bool = True) -> _Bound:
        """The binding a step of n tokens runs in: the smallest width that holds them (with every row's logits if
        asked; else, with ``lone``, preferring the width's last-row-only twin)."""
        fits = [b for b in self._picks[all_logits or not lone] if b.width.T >= max(n, self.min_width)
                and (not all_logits or b.width.L == b.width.T)
                and (not self.pads_into_cache or past_len + b.width.T <= self.max_context)]
        if not fits:
            raise ValueError(f"no width of {self.entry.graph} takes {n} tokens at position {past_len} with "
                             f"{'all' if all_logits else 'last'} logits; widths {[w.T for w in self.entry.widths]}, "
                             f"S_max {self.max_context}")
        return min(fits, key=lambda b: (b.width.T, b.width.L))

    # --------------------------------------------------------------------- step
    def feed(self, tokens: Sequence[int], past_len: int, all_logits: bool) -> dict[str, np.ndarray]:
        """The exact inputs (copies) the next ``step(tokens, past_len, all_logits)`` will run with: what
        validation records as a graph's real input (CPU only)."""
        if self.device != "cpu" or self.kv is None:
            raise ValueError("feed() reads the cache from host memory: CPU runners of their own cache only")
        n = len(tokens)
        w = self._pick(n, all_logits, past_len, lone=False).width  # a declared width: what an engine is built for
        ids = np.full((1, w.T), tokens[-1], dtype=np.int64)
        ids[0, :n] = tokens
        at = np.arange(w.T, dtype=np.int64)[None] if w.L == w.T else np.array([[n - 1]], dtype=np.int64)
        out = {"input_ids": ids, "past_len": np.array([past_len], dtype=np.int64), "logits_at": at}
        if self.rows_mode:
            del out["past_len"]
            out["row_slot"] = np.where(np.arange(w.T) < n, 0, -1).astype(np.int64)
            out["row_pos"] = past_len + np.arange(w.T, dtype=np.int64)
            out["row_parent"] = np.full(w.T, -1, dtype=np.int64)
        for i in range(self.entry.dims.n_layers):
            out[f"past_key_values.{i}.key"] = self.kv[i, 0].copy()
            out[f"past_key_values.{i}.value"] = self.kv[i, 1].copy()
        return out

    def step(self, tokens: Sequence[int], past_len: int, all_logits: bool, ids_only: bool = False,
             slot: int = 0) -> np.ndarray:
        """GraphRunner.step; ``slot``: the sequence of the pool (rows mode) whose cache the tokens extend."""
        n = len(tokens)
        if ids_only and not self.has_argmax:
            raise ValueError(f"{self.entry.graph} has no next_ids output (export with --device-argmax)")
        assert 0 < n and past_len + n <= self.max_context, (n, past_len, self.max_context)
        assert 0 <= slot < self.slots, (slot, self.slots)
        b = self._pick(n, all_logits, past_len)
        b.input_ids[0, :n] = tokens
        b.input_ids[0, n:] = tokens[-1]  # padding: computed, never committed
        if self.rows_mode:
            assert b.row_pos is not None
            b.past_len[:n], b.past_len[n:] = slot, -1  # row_slot: padding rows are -1, never written
            np.add(self._arange[:n], past_len, out=b.row_pos[:n])  # no allocation per step
            b.row_pos[n:] = 0
            b.row_parent[:] = -1  # type: ignore[index]  # (a tree step at this width may have set parents)
        else:
            b.past_len[0] = past_len
        if b.width.L != b.width.T:
            b.logits_at[0, 0] = n - 1
        if self.device == "cuda":
            b.binding.synchronize_inputs()
        self.session.run_with_iobinding(b.binding)
        self._commit_rows(b, past_len, n)
        last = n - 1 if b.width.L == b.width.T else 0  # a width with every row's logits: the last real row
        if ids_only:  # only the ids cross from the device
            ids = b.ids if self.device == "cpu" else b.ids.numpy()
            return ids[0, :n] if all_logits else ids[0, last:last + 1]
        logits = b.logits if self.device == "cpu" else b.logits_dev.numpy()
        if all_logits:
            return logits[0, :n]
        return logits[0, last:last + 1]

    def step_rows(self, tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int],
                  ids_only: bool = False, parents: Sequence[int] | None = None,
                  logits_rows: Sequence[int] | None = None) -> np.ndarray:
        """Row-addressed step (rows mode): row i is token ``tokens[i]`` of the sequence in slot ``slots[i]`` at
        position ``positions[i]``; it attends to its slot's rows 0..positions[i], the step's own rows included
        (every row's K/V is written first). Returns logits [n, V] (a view valid until the next step), or with
        ``ids_only`` their argmax ids [n]; with ``logits_rows``, those rows' only. Each row's result is bitwise what
        the same row computes in any other step of width >= 2 (the kernels are row-invariant there), whatever else
        the step holds.

        ``parents`` (tree rows): row i's token follows row ``parents[i]``'s (an earlier row of its slot at a lower
        position; -1: none). Such a row writes cache row ``positions[i]`` but is the token at its root's position plus
        its depth, and attends to its root's rows and its ancestors' only: its logits are those of the same tokens
        decoded as a chain. :meth:`move_rows` then puts an accepted path's rows where the chain would have them.

        ``logits_rows`` (CPU): the rows whose logits (or ids) the step returns, in that order, and the only rows it
        runs the lm_head for: a prompt's rows in a step with other requests' decoding rows need their last row's at
        most. Each is bitwise the row's logits in a step that computes every row's (the kernels compute a row the
        same whatever else the lm_head's step holds, a lone row included)."""
        n = len(tokens)
        if not self.rows_mode:
            raise ValueError(f"{self.entry.graph} is not row-addressed (kv_mode rows)")
        if ids_only and not self.has_argmax:
            raise ValueError(f"{self.entry.graph} has no next_ids output (export with --device-argmax)")
        assert 0 < n == len(slots) == len(positions), (n, len(slots), len(positions))
        b = self._pick(n, True, 0) if logits_rows is None else self._rows_binding(n, logits_rows)
        assert b.row_pos is not None
        b.input_ids[0, :n], b.input_ids[0, n:] = tokens, tokens[-1]
        b.past_len[:n], b.past_len[n:] = slots, -1
        b.row_pos[:n], b.row_pos[n:] = positions, 0
        assert b.row_parent is not None
        if parents is None:
            b.row_parent[:] = -1
        else:
            b.row_parent[:n], b.row_parent[n:] = parents, -1
        if self.device == "cuda":
            b.binding.synchronize_inputs()
        self.session.run_with_iobinding(b.binding)
        m = n if logits_rows is None else b.width.L
        if ids_only:
            ids = b.ids if self.device == "cpu" else b.ids.numpy()
            return ids[0, :m]
        logits = b.logits if self.device == "cpu" else b.logits_dev.numpy()
        return logits[0, :m]

    def _rows_binding(self, n: int, rows: Sequence[int]) -> _Bound:
        """The binding of a step of n rows that returns the logits of ``rows`` only: the smallest declared width that
        holds n rows, with as many logits rows as asked for (made at first use; every such binding writes its logits
        into one buffer of the widest width's, a view valid until the next step, as every step's logits are)."""
        if self.device != "cpu":
            raise ValueError(f"{self.entry.graph}: logits_rows needs the CPU (its bindings are made as steps ask)")
        if not len(rows) or min(rows) < 0 or max(rows) >= n:
            raise ValueError(f"logits_rows {list(rows)} must name rows of the step's {n}, at least one")
        T = min((w.T for w in self.entry.widths if w.T >= max(n, self.min_width)), default=None)
        if T is None:
            raise ValueError(f"no width of {self.entry.graph} takes {n} rows; widths "
                             f"{[w.T for w in self.entry.widths]}")
        key = (T, len(rows))
        b = self._by_rows.get(key)
        if b is None:
            if self._rows_logits is None:
                widest = max(w.T for w in self.entry.widths)
                self._rows_logits = np.zeros((1, widest, self.entry.logits_width), dtype=np.float32)
            b = self._by_rows[key] = self._bind(Width(ROLE_VERIFY, T, len(rows)), logits_into=self._rows_logits)
        b.logits_at[0, :] = rows
        return b

    def step_tree(self, tokens: Sequence[int], positions: Sequence[int], parents: Sequence[int],
                  ids_only: bool = False, slot: int = 0) -> np.ndarray:
        """One sequence's tree rows in one step (:meth:`step_rows` with ``parents``, every row in ``slot``)."""
        return self.step_rows(tokens, [slot] * len(tokens), positions, ids_only, parents)

    def move_rows(self, src: Sequence[int], dst: Sequence[int], slot: int = 0) -> None:
        """Copy every layer's K/V cache rows ``src`` of a slot to rows ``dst`` (rows mode, CPU): a tree's accepted
        path, written where its nodes lay in the step, moved to the positions its tokens now hold. Every source row
        is read before any is written."""
        if not self.rows_mode or self.device != "cpu" or self.kv is None:
            raise ValueError(f"{self.entry.graph}: moving cache rows needs a row-addressed bundle on the CPU, "
                             "its own cache")
        if len(src):
            self.kv[:, :, slot, :, list(dst)] = self.kv[:, :, slot, :, list(src)]

    def copy_slot_rows(self, src: int, dst: int, start: int, stop: int) -> None:
        """Copy every layer's K/V cache rows ``start .. stop - 1`` of slot ``src`` into slot ``dst`` (rows mode, CPU,
        the runner's own cache): a sequence's rows for tokens another slot holds already (a shared system prompt)."""
        if not self.rows_mode or self.device != "cpu" or self.kv is None:
            raise ValueError(f"{self.entry.graph}: copying cache rows between slots needs a row-addressed bundle on "
                             "the CPU, its own cache")
        if not (0 <= src < self.slots and 0 <= dst < self.slots and 0 <= start <= stop <= self.max_context):
            raise ValueError(f"{self.entry.graph}: rows {start}..{stop} of slots {src} -> {dst} are outside the "
                             f"cache ({self.slots} slots of {self.max_context} rows)")
        self.kv[:, :, dst, :, start:stop] = self.kv[:, :, src, :, start:stop]

    def _commit_rows(self, b: _Bound, past_len: int, n: int) -> None:
        if self.pads_into_cache or self.rows_mode:
            return  # written in place by the graph
        if self.device == "cpu":
            kv = self.kv.reshape(-1, *self.kv.shape[2:])  # [n_layers*2, 1, H_kv, S_max, D] view
            for j, present in enumerate(b.present):
                kv[j, :, :, past_len:past_len + n] = present[:, :, :n]
            return
        d = self.entry.dims
        row = d.head_dim * self.kv_dtype.itemsize
        for dst, src in zip(self._kv_values, b.present):
            # [H_kv] rows of n*D floats: src pitch T*D, dst pitch S_max*D, offset past_len*D.
            self._cuda.memcpy2d(dst.data_ptr() + past_len * row, self.max_context * row,
                                src.data_ptr(), b.width.T * row, n * row, d.n_kv_heads)
        self._cuda.synchronize()

    def close(self) -> None:
        self._bound.clear()
        self._lone.clear()
        self._picks.clear()
        self._by_rows.clear()
        self.session = None  # type: ignore[assignment]
