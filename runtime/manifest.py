"""The bundle manifest and the graph IO contract — defined once, here.

Everything else is derived from these dataclasses: the export stage writes ONNX
inputs/outputs named by :func:`io_spec`, the runtime allocates buffers from the
same spec, and validation feeds the same names.

Vocabulary: B batch, T new tokens per call, L logit rows per call, S_max KV
buffer length, H_kv kv heads, D head dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .bundle_files import hex64, verify_files
from .errors import BundleError

# Shortest suffix match a prompt-lookup draft needs (bundles that record no ngram_min). One-token matches are
# left to the decoder's free guess, which rides in the width-2 step a plain round runs anyway: as K-token
# drafts they widened the verify step for little (fixed-k lookup on Qwen int4, one run per suite: 0.73-0.88x
# plain with them, 0.95-1.05x without on code, chat and JSON; docs/benchmarks.md).
DEFAULT_NGRAM_MIN = 2
# Longest context a match is compared over (bundles that record no ngram_max; drafters.PromptLookupDrafter says why).
DEFAULT_NGRAM_MAX = 32

if TYPE_CHECKING:
    import numpy as np

SCHEMA = "specedge.bundle/1"
MANIFEST_NAME = "manifest.json"
VERIFY_MODES = ("sha256", "size", "none")  # how read_manifest checks the bundle's files
INTGEMM_FORMAT = "MatMulInteger"  # --quant-form intgemm: 8-bit matrices (int4 models: "MatMulNBits+MatMulInteger")
SEK_FORMAT = "SekMatMul"  # --quant-form specedge: every quantized matrix through specedge's kernel (runtime/kernels.py)
SEK_DOMAIN = "ai.specedge"  # its ONNX domain
SEK_ATTENTION = "SekAttention"  # ModelEntry.quant["attention"]: specedge's attention (ort-inplace): width 1 invariant
QDQ_FORMAT = "DequantizeLinear+MatMul"  # ModelEntry.quant["format"] of --quant-form qdq graphs (else MatMulNBits)
MAX_DIM = 1 << 22  # no model dimension (layers, heads, hidden, vocab) comes near this
# the graphs' KV cache element types: fp32, or fp16 (specedge's attention, which rounds each new row once and reads
# the rows exactly: every row is still the one a plain step writes)
KV_DTYPES = ("float32", "float16", "int8")
KV_DTYPE_SHORT = {"float32": "fp32", "float16": "fp16", "int8": "int8"}  # spec-export's --kv-dtype names
KV_INT8_SCALE_BYTES = 4  # an int8 cache row: head_dim int8 values, then the row's fp32 scale (runtime/csrc/sek.h)


def kv_row_width(head_dim: int, kv_dtype: str) -> int:
    """The cache tensors' last dimension: a head's row of head_dim elements, or (int8) its values and its scale."""
    return head_dim + KV_INT8_SCALE_BYTES if kv_dtype == "int8" else head_dim


def kv_row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one head's cache row of kv_dtype."""
    return kv_row_width(head_dim, kv_dtype) * {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}[kv_dtype]
MAX_CONTEXT = 1 << 20  # S_max: the KV buffers are allocated at this length up front
GRAPH_POSITIONS_KEY = "specedge.max_positions"  # a graph's metadata: the positions its RoPE tables hold
GRAPH_RESIDUALS_KEY = "specedge.residuals"  # a graph's metadata: its residual stream's names between layers (JSON)
ONNX_OPSET = 17  # TensorRT 10.3 (JetPack 6) parses opsets up to 20; 17 has everything we use.

# Graph roles and how many logit rows each needs (DESIGN.md, graph contract).
ROLE_PREFILL = "prefill"  # T = P, logits only at the last real position
ROLE_VERIFY = "verify"  # T = K+1, logits at every position
ROLE_DECODE = "decode"  # T = 1
DRAFTER_KINDS = ("model", "prompt-lookup", "none")
# Row-addressed steps (the specedge form): a step's rows each name a KV slot of a pool and a position, so rows of
# several sequences share one step (SpecDecoder.load(max_batch=N): N slots). The specedge form's default.
ROWS_KV_MODE = "rows"
KV_MODES = ("portable", "ort-inplace", ROWS_KV_MODE)  # see specedge.export.attention
# The row budgets of a row-addressed target besides its verify widths: a round of several requests packs every
# request's last token and draft into one step of the smallest of these that holds them (logits at its rows). Every
# width up to 8 rows: a padding row costs what a real one does (Qwen2.5-Coder-1.5B on 2 EPYC Zen 4 cores: 4 users'
# rows 41-45 ms at width 4, 51 ms at width 5), and a chain of k tokens then runs in k + 1 rows too.
BATCH_WIDTHS = (2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48)


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output. `shape` mixes ints and symbolic dim names."""

    name: str
    dtype: str  # numpy dtype name
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class ModelDims:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int  # rows of the embedding / logits width V

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= MAX_DIM:
                raise BundleError(f"model dimension {f.name} must be an int in 1..{MAX_DIM}, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise BundleError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")


@dataclass(frozen=True)
class Width:
    """A fixed call shape the graph is run at: T new tokens, L logit rows."""

    role: str
    T: int
    L: int

    def __post_init__(self) -> None:
        if self.role not in (ROLE_PREFILL, ROLE_VERIFY, ROLE_DECODE):
            raise BundleError(f"width role {self.role!r} unknown; roles: {ROLE_PREFILL}, {ROLE_VERIFY}, {ROLE_DECODE}")
        if not 1 <= self.L <= self.T:
            raise BundleError(f"width {self.role} needs 1 <= L <= T, got T={self.T}, L={self.L}")


@dataclass(frozen=True)
class HeadRows:
    """A draft's lm_head over part of the vocabulary: logits column j is token ``ids()[j]`` — the ids
    0..first-1 (a byte-level BPE vocabulary is in merge order, most frequent first), then ``extra`` (the
    tokenizer's special tokens above them), ascending. The draft proposes only these tokens; acceptance
    is unchanged (a draft's distribution may put zero mass anywhere), so the output stays exact."""

    first: int
    extra: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.first, bool) or not isinstance(self.first, int) or not 1 <= self.first <= MAX_DIM:
            raise BundleError(f"head.first must be an int in 1..{MAX_DIM}, got {self.first!r}")
        if list(self.extra) != sorted(set(self.extra)) or (self.extra and self.extra[0] < self.first):
            raise BundleError(f"head.extra must be ascending, distinct ids >= head.first={self.first}, "
                              f"got {list(self.extra)[:8]}")

    @property
    def width(self) -> int:
        return self.first + len(self.extra)

    def ids(self) -> np.ndarray:
        import numpy as np

        return np.concatenate([np.arange(self.first, dtype=np.int64), np.asarray(self.extra, dtype=np.int64)])


@dataclass(frozen=True)
class ModelEntry:
    """One model of the bundle (target or draft) and its single ONNX graph."""

    family: str
    dims: ModelDims
    graph: str  # file name inside the bundle
    weights: str | None  # external-data file name, or None if embedded
    precision: str
    widths: tuple[Width, ...]
    source: dict[str, Any] = field(default_factory=dict)
    quant: dict[str, Any] = field(default_factory=dict)  # int8/int4: MatMulNBits settings and weight error
    head: HeadRows | None = None  # draft only: its lm_head covers these ids (None: the whole vocabulary)
    # a self draft (draft only): the target layers it runs, its weights the target's file, its KV cache the target's
    # for those layers
    layers: tuple[int, ...] = ()
    # every tensor of the weights file, name -> (offset, length, ONNX type, *dims): on ONNX Runtime CPU the runtime
    # reads them once and hands them to the session as initializers (to both, for a self draft), so the file is
    # never mapped and a load holds the weights once. Empty (other forms, bundles exported before): ONNX Runtime is
    # handed the file's contents and copies what it needs
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head is not None and self.head.extra and self.head.extra[-1] >= self.dims.vocab:
            raise BundleError(f"head.extra id {self.head.extra[-1]} is outside the vocabulary 0..{self.dims.vocab - 1}")
        if self.head is not None and self.head.first > self.dims.vocab:
            raise BundleError(f"head.first={self.head.first} exceeds the vocabulary {self.dims.vocab}")

    @property
    def is_self(self) -> bool:
        """A self draft: some of the target's own layers (``layers``)."""
        return bool(self.layers)

    @property
    def logits_width(self) -> int:
        """Columns of the graph's logits: the vocabulary, or the draft head's rows (``head``)."""
        return self.dims.vocab if self.head is None else self.head.width

    def width_for(self, n_tokens: int) -> Width:
        """Smallest declared width with T >= n_tokens (prefill widths included)."""
        fits = [w for w in self.widths if w.T >= n_tokens]
        if not fits:
            raise BundleError(
                f"no declared width holds {n_tokens} tokens; widths are {[w.T for w in self.widths]}"
            )
        return min(fits, key=lambda w: w.T)


@dataclass(frozen=True)
class TokenizerInfo:
    file: str
    chat_template: str | None
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool
    vocab_size: int  # entries in the tokenizer (<= ModelDims.vocab)
    chat_templates: dict[str, str] = field(default_factory=dict)  # named variants besides chat_template


@dataclass(frozen=True)
class Manifest:
    max_context: int  # S_max
    k: int  # draft length K; verify width is K+1
    prefill_chunk: int  # P
    target: ModelEntry
    draft: ModelEntry | None
    drafter: str  # one of DRAFTER_KINDS
    drafter_params: dict[str, Any]
    tokenizer: TokenizerInfo
    files: dict[str, dict[str, Any]]  # name -> {"sha256", "bytes", "sample": {"stride", "sha256"} (optional)}
    kv_layout: str = "B,H_kv,S_max,D"
    kv_mode: str = "portable"
    kv_dtype: str = "float32"
    opset: int = ONNX_OPSET
    schema: str = SCHEMA
    created_by: str = ""
    engines: dict[str, Any] = field(default_factory=dict)  # key "<kind>-<precision>" -> EngineSet.to_json()
    device_argmax: bool = False  # graphs also output next_ids [B, L] = ArgMax(logits): greedy copies ids, not logits

    def __post_init__(self) -> None:
        if self.k < 1:
            raise BundleError(f"K must be >= 1, got {self.k}")
        if not self.max_context <= MAX_CONTEXT:
            raise BundleError(f"max_context S_max={self.max_context} exceeds {MAX_CONTEXT}")
        for role, e in self.models.items():
            wide = [w.T for w in e.widths if w.T > self.max_context]
            if wide:
                raise BundleError(f"{role}.widths {wide} exceed max_context S_max={self.max_context}")
        if self.prefill_chunk < 1:
            raise BundleError(f"prefill chunk P must be >= 1, got {self.prefill_chunk}")
        need = self.prefill_chunk + self.k + 1
        if self.max_context < need:
            raise BundleError(
                f"max_context S_max={self.max_context} is too small: it must hold at least "
                f"P + K + 1 = {self.prefill_chunk} + {self.k} + 1 = {need} positions"
            )
        if self.kv_mode not in KV_MODES:
            raise BundleError(f"unknown kv_mode {self.kv_mode!r}; this specedge reads {', '.join(KV_MODES)}")
        if self.kv_dtype not in KV_DTYPES:
            raise BundleError(f"unknown kv_dtype {self.kv_dtype!r}; this specedge reads {', '.join(KV_DTYPES)}")
        if self.kv_dtype != "float32" and self.kv_mode == "portable":
            raise BundleError(f"kv_dtype {self.kv_dtype} with kv_mode portable: a {self.kv_dtype} cache is read by "
                              "specedge's attention (kv_mode rows or ort-inplace in the specedge form)")
        if self.drafter not in DRAFTER_KINDS:
            raise BundleError(f"unknown drafter {self.drafter!r}; allowed: {', '.join(DRAFTER_KINDS)}")
        if (self.drafter == "model") != (self.draft is not None):
            raise BundleError("drafter 'model' needs a draft model entry, and only it has one")
        if self.target.layers:
            raise BundleError("target.layers describes a self draft; the target runs all its layers")
        d = self.draft
        if d is not None and d.layers:
            n = self.target.dims.n_layers
            if list(d.layers) != sorted(set(d.layers)) or d.layers[-1] >= n or d.dims.n_layers != len(d.layers) \
                    or d.weights != self.target.weights or self.kv_mode != ROWS_KV_MODE or d.head is not None \
                    or not d.tensors:
                raise BundleError(f"draft.layers {list(d.layers)}: a self draft runs increasing target layers in "
                                  f"0..{n - 1}, as many as its dims.n_layers ({d.dims.n_layers}), from the target's "
                                  f"weights file ({self.target.weights}; it names {d.weights}) and its tensors, in "
                                  "kv_mode rows, with the target's whole head")
        if self.target.head is not None:
            raise BundleError("target.head: the target's lm_head must cover the whole vocabulary (its distribution "
                              "is the output); only a draft may have a partial head")
        _check_files(self)
        from . import schema

        for key, es in self.engines.items():
            schema.load(EngineSet, es, f"engines.{key}")
        dp = self.drafter_params
        if set(dp) - {"ngram_max", "ngram_min"} or any(
                isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64 for v in dp.values()) \
                or dp.get("ngram_min", 1) > dp.get("ngram_max", DEFAULT_NGRAM_MAX):
            raise BundleError(f"drafter_params must hold ngram_min <= ngram_max, integers in 1..64, got {dp!r}")

    def engine_set(self, kind: str, precision: str | None = None) -> EngineSet:
        """The bundle's reduced-precision graphs ("onnx") or TensorRT engines ("trt") of one precision.

        precision None: the only set of that kind (an error if there are several or none)."""
        have = {key: EngineSet.from_json(v) for key, v in self.engines.items()}
        sets = [e for e in have.values() if e.kind == kind and (precision is None or e.precision == precision)]
        if len(sets) == 1:
            return sets[0]
        built = ", ".join(sorted(have)) or "none"
        if not sets:
            what = f"{kind} {precision}" if precision else kind
            how = ("spec-export build BUNDLE --backend trt --precision fp16" if kind == "trt"
                   else "spec-export build BUNDLE --backend onnx --precision fp16")
            raise BundleError(f"this bundle has no {what} engines (built: {built}); build them with: {how}")
        raise BundleError(f"this bundle has {kind} engines in several precisions ({built}); pick one with --precision")

    @property
    def models(self) -> dict[str, ModelEntry]:
        out = {"target": self.target}
        if self.draft is not None:
            out["draft"] = self.draft
        return out

    # ---- serialization -------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> Manifest:
        """Parsed manifest.json -> Manifest, every field checked against the dataclasses' types (schema.load)
        and the cross-field rules of __post_init__; errors name the field."""
        from . import schema

        if not isinstance(d, dict):
            raise BundleError(f"manifest must be a JSON object, got {type(d).__name__}")
        if d.get("schema") != SCHEMA:
            raise BundleError(f"manifest schema is {d.get('schema')!r}; this specedge reads {SCHEMA!r}")
        return schema.load(cls, d, "manifest")


ENGINE_KINDS = ("onnx", "trt")


@dataclass(frozen=True)
class EngineSet:
    """Graphs of every model of a bundle in one reduced precision, for one backend.

    kind "onnx": reduced-precision ONNX graphs (ONNX Runtime, and the input of TensorRT builds).
    kind "trt": serialized TensorRT engines, valid only for the TensorRT version and GPU (compute
    capability) recorded here; one optimization profile per width, in ``profiles`` order.
    """

    kind: str
    precision: str  # fp16 | bf16
    kv_dtype: str  # numpy-style name of the cache element type: float16 | bfloat16
    graphs: dict[str, str]  # role -> file inside the bundle
    sources: dict[str, str]  # role -> sha256 of the ONNX file the graph was made from
    profiles: dict[str, list[list[int]]] = field(default_factory=dict)  # role -> [[T, L], ...] (trt)
    tensorrt: str | None = None  # TensorRT version that built the engines (trt)
    gpu: dict[str, Any] = field(default_factory=dict)  # {"name", "compute_capability"} (trt)
    build: dict[str, Any] = field(default_factory=dict)  # how: seconds, workspace, timing cache, conversion report

    def __post_init__(self) -> None:
        if self.kind not in ENGINE_KINDS:
            raise BundleError(f"engine kind {self.kind!r} unknown; this specedge reads {', '.join(ENGINE_KINDS)}")
        if self.kind == "trt" and (not self.tensorrt or not self.gpu.get("compute_capability")):
            raise BundleError("a TensorRT engine entry must record the TensorRT version and GPU compute capability")

    @property
    def key(self) -> str:
        return f"{self.kind}-{self.precision}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EngineSet:
        try:
            return cls(**d)
        except TypeError as e:
            raise BundleError(f"manifest engine entry is malformed: {e}") from e


def _check_files(m: Manifest) -> None:
    """Every file entry well formed and inside the bundle; every file the models and tokenizer name is listed;
    token ids inside the vocabulary."""
    for name, meta in m.files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts or not name:
            raise BundleError(f"files: {name!r} is not a plain path inside the bundle")
        sha, size = meta.get("sha256"), meta.get("bytes")
        if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise BundleError(f"files.{name}.sha256 must be 64 lowercase hex digits, got {sha!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BundleError(f"files.{name}.bytes must be an integer >= 0, got {size!r}")
        sample = meta.get("sample")
        if sample is not None and not (isinstance(sample, dict) and hex64(sample.get("sha256"))
                                       and isinstance(sample.get("stride"), int)
                                       and not isinstance(sample.get("stride"), bool) and sample["stride"] > 0):
            raise BundleError(f"files.{name}.sample must be {{'stride': an integer > 0, 'sha256': 64 lowercase hex "
                              f"digits}}, got {sample!r}")
    for role, e in m.models.items():
        for key in ("graph", "weights"):
            name = getattr(e, key)
            if name is not None and name not in m.files:
                raise BundleError(f"{role}.{key} {name!r} is not among the bundle's files {sorted(m.files)}")
        if not any(w.role == ROLE_VERIFY or w.role == ROLE_DECODE for w in e.widths):
            raise BundleError(f"{role}.widths {e.widths} declare no decode or verify width")
    full = [w.T for w in m.target.widths if w.L == w.T]  # widths with a logits row per token: verify steps
    if max(full, default=0) < m.k + 1:
        raise BundleError(f"k={m.k} needs a target width of K+1={m.k + 1} tokens with every row's logits; the "
                          f"target's are {sorted(full)} (the manifest's k or widths were changed)")
    t = m.tokenizer
    if t.file not in m.files:
        raise BundleError(f"tokenizer.file {t.file!r} is not among the bundle's files {sorted(m.files)}")
    V = m.target.dims.vocab
    for name, ids in (("eos_ids", t.eos_ids), ("bos_id", () if t.bos_id is None else (t.bos_id,))):
        bad = [i for i in ids if not 0 <= i < V]
        if bad:
            raise BundleError(f"tokenizer.{name} {bad} outside the vocabulary 0..{V - 1}")


DRAFT_CATCHUP_WIDTHS = (2, 4, 8, 16)  # a draft's narrow prefill widths (model_widths)


def model_widths(role: str, k: int, prefill_chunk: int, extra_verify: tuple[int, ...] = (),
                 even: bool = False, catchup: tuple[int, ...] | None = None,
                 batch: tuple[int, ...] = ()) -> tuple[Width, ...]:
    """The fixed widths each model is run at.

    target: prefill (P), verify (K+1 and 2) and decode (1). Verify width 2 is what plain decoding runs
    by default: the last token plus a free one-token guess, because a width-1 step is computed by other
    kernels than every wider one (see GraphRunner.min_width); decode (1) stays for runs that give up
    batch invariance for a narrower step (``SpecDecoder.load(invariant=False)``).
    ``extra_verify`` adds more verify widths (2..K): a draft of k < K tokens then runs
    at the smallest width >= k+1 instead of padding to K+1 (one more optimization profile
    for TensorRT; nothing more for ONNX Runtime).
    draft: prefill (P), decode (1) and the ``catchup`` widths below P (default ``DRAFT_CATCHUP_WIDTHS``; one logits
    row each):
    a draft model that fell behind (a fully accepted round leaves it one token behind, a prompt-lookup round of auto
    several) feeds those tokens and its first draw in one step (``ModelDrafter.propose``): on 2 EPYC cores the Qwen
    0.5B draft ran 2 / 4 / 8 tokens in 7.4 / 9.0 / 13.2 ms where single steps took 6.4 ms each.
    even (target of an int8/int4 bundle): every verify width rounded up to an even one (K+1 = 9 -> 10; a draft of
    4 then runs at width 6, one padding row). ONNX Runtime's int8-compute MatMulNBits kernel takes rows in pairs
    and an odd last row alone through its M=1 kernel, whose rounding differs (measured on x86 with blocks >= 64
    at 4 bits, >= 128 at 8 bits; tests/export/test_quantized_bundle.py): with even widths no real row is ever
    that odd one, so a row's result is the same whatever the width. The prefill chunk must then be even too.
    batch (target of a row-addressed bundle: :data:`BATCH_WIDTHS`): more widths with logits at every row, the row
    budgets rounds of several requests run at (a width equal to the prefill chunk is left to the prefill).
    """
    if even and prefill_chunk % 2:
        raise ValueError(f"the prefill chunk of an int8/int4 target must be even (its rows go through the kernel in "
                         f"pairs), got {prefill_chunk}")
    widths = {Width(ROLE_PREFILL, prefill_chunk, 1), Width(ROLE_DECODE, 1, 1)}
    if role == "draft":
        widths |= {Width(ROLE_PREFILL, t, 1) for t in (DRAFT_CATCHUP_WIDTHS if catchup is None else catchup)
                   if 1 < t < prefill_chunk}
    if role == "target":
        for t in {k + 1, 2, *extra_verify}:
            if not 2 <= t <= k + 1:
                raise ValueError(f"verify widths must be in 2..K+1={k + 1}, got {t}")
            t += t % 2 if even else 0
            widths.add(Width(ROLE_VERIFY, t, t))
        widths |= {Width(ROLE_VERIFY, t + t % 2 if even else t, t + t % 2 if even else t) for t in batch
                   if t != prefill_chunk}
    # A width may coincide with another (e.g. P == K+1): keep the one that gives most logits.
    by_t: dict[int, Width] = {}
    for w in widths:
        if w.T not in by_t or w.L > by_t[w.T].L:
            by_t[w.T] = w
    return tuple(sorted(by_t.values(), key=lambda w: w.T))


def io_spec(dims: ModelDims, kv_mode: str = "portable", kv_dtype: str = "float32",
            argmax: bool = False, logits_width: int | None = None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of one model graph.

    portable: ``present`` holds the T new rows, copied into the cache by the runtime.
    ort-inplace: ``present`` is the cache itself (bound to the same buffer as ``past``).
    rows (:data:`ROWS_KV_MODE`): as ort-inplace over a pool of N slots [N, H_kv, S_max, D]; ``past_len`` is replaced
    by ``row_slot`` [T], ``row_pos`` [T] and ``row_parent`` [T]: each row's KV slot (-1: padding), the cache row it
    writes, and the earlier row of the step its token follows (-1: none; a tree row, see runtime/csrc/sek.h) (B = 1:
    the rows are T).
    kv_dtype: the cache's element type (float32; float16 / bfloat16 in reduced-precision graphs; float16 or int8 read
    by specedge's attention, an int8 row of D values followed by its 4-byte scale: :func:`kv_row_width`).
    Logits are float32 in every graph. argmax (``Manifest.device_argmax``): also ``next_ids`` [B, L] int64, the
    first index of each logits row's maximum (ONNX ArgMax, select_last_index 0: numpy's argmax).
    logits_width: the logits' last dimension (``ModelEntry.logits_width``; default the vocabulary V).
    """
    slots = "N" if kv_mode == ROWS_KV_MODE else "B"  # rows: the cache is a pool of N slots, one per sequence
    row = kv_row_width(dims.head_dim, kv_dtype)
    kv_in = [
        TensorSpec(f"past_key_values.{i}.{kind}", kv_dtype, (slots, dims.n_kv_heads, "S_max", row))
        for i in range(dims.n_layers)
        for kind in ("key", "value")
    ]
    kv_out = [
        TensorSpec(f"present.{i}.{kind}", kv_dtype,
                   (slots, dims.n_kv_heads, "T" if kv_mode == "portable" else "S_max", row))
        for i in range(dims.n_layers)
        for kind in ("key", "value")
    ]
    where = ([TensorSpec("row_slot", "int64", ("T",)), TensorSpec("row_pos", "int64", ("T",)),
              TensorSpec("row_parent", "int64", ("T",))]
             if kv_mode == ROWS_KV_MODE else [TensorSpec("past_len", "int64", ("B",))])
    inputs = [
        TensorSpec("input_ids", "int64", ("B", "T")),
        *where,
        TensorSpec("logits_at", "int64", ("B", "L")),
        *kv_in,
    ]
    outputs = [TensorSpec("logits", "float32", ("B", "L", logits_width or dims.vocab)), *kv_out]
    if argmax:
        outputs.append(TensorSpec("next_ids", "int64", ("B", "L")))
    return inputs, outputs


def width_shapes(dims: ModelDims, w: Width, max_context: int) -> dict[str, tuple[int, ...]]:
    """Every input's shape at one width (B = 1): a TensorRT optimization profile (min = opt = max), the
    TensorRT execution provider's profile strings, and the buffers a runner binds all come from here."""
    kv = (1, dims.n_kv_heads, max_context, dims.head_dim)
    shapes: dict[str, tuple[int, ...]] = {"input_ids": (1, w.T), "past_len": (1,), "logits_at": (1, w.L)}
    for i in range(dims.n_layers):
        shapes[f"past_key_values.{i}.key"] = shapes[f"past_key_values.{i}.value"] = kv
    return shapes


# ---- the manifest file ------------------------------------------------
def write_manifest(bundle_dir: Path, manifest: Manifest) -> None:
    """Write atomically: a reader never sees a half-written manifest, a crash leaves the old one."""
    path = Path(bundle_dir) / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    os.replace(tmp, path)


def read_manifest(bundle_dir: str | Path, verify: str = "sha256") -> Manifest:
    """Read and check a bundle's manifest.

    verify: "sha256" (hash every file), "size" (sizes, and each file's sampled hash where the manifest records one:
    a file zeroed or overwritten over more than about a MiB is caught without reading it; a flipped bit mostly is
    not), or "none".
    """
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST_NAME
    if verify not in VERIFY_MODES:
        raise BundleError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    if bundle_dir.exists() and not bundle_dir.is_dir():
        raise BundleError(f"{bundle_dir} is a file, not a bundle directory")
    if not bundle_dir.is_dir():
        raise BundleError(f"bundle directory {bundle_dir} does not exist")
    if not path.is_file():
        raise BundleError(f"{bundle_dir} is not a specedge bundle: {MANIFEST_NAME} is missing")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise BundleError(f"{path} is not valid JSON: {e}") from e
    manifest = Manifest.from_json(raw)
    verify_files(bundle_dir, manifest, verify)
    return manifest


def format_layers(layers: tuple[int, ...] | list[int]) -> str:
    """(3, 5, 6, 7) -> "3,5-7": the form --draft self: takes."""
    out, run = [], []
    for i in sorted(layers):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)
