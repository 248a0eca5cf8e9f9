"""Memory plan: what a deployment keeps resident, against the memory of the board it runs on.

    spec-export plan jetson-orin-nano-8gb          # a preset (models read from the GGUF headers in the cache)
    spec-export plan BUNDLE --board jetson-orin-nano-8gb --precision fp16 --head low
    spec-export build BUNDLE --backend trt ...     # prints the plan first, refuses what cannot fit

Per model: weights (from the dims and the weight format of the engine that will run them), the KV
cache at S_max, the new-rows buffer of the widest step, and the step's activation scratch; per
process: the CUDA context with TensorRT's kernels (GPU backends) and the Python runtime. The
weights and KV are exact counts; scratch and the context are estimates (TensorRT reports its real
scratch, ``device_memory_size``, only once an engine is built) and are labelled so.

On a Jetson, CPU and GPU share one memory: the plan's total must fit beside the OS
(``reserved_gb`` of the board). On a discrete GPU the device total is what counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import SpecEdgeError
from .manifest import KV_DTYPE_SHORT, Manifest, ModelDims, kv_row_bytes

GiB = 1 << 30
# per-process constants (estimates, stated in the plan): a CUDA 12 context with lazy module loading plus the
# TensorRT runtime's kernels, measured on Orin-class boards at 0.3-0.5 GB; Python + numpy + tokenizers ~0.15 GB.
CUDA_CONTEXT_BYTES = int(0.45 * GiB)
PYTHON_BYTES = int(0.15 * GiB)
WEIGHT_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0}


@dataclass(frozen=True)
class Board:
    name: str
    memory_gb: float
    unified: bool  # CPU and GPU share the memory (Jetson)
    reserved_gb: float  # what the OS and its services keep (unified boards) or the driver keeps (discrete)

    @property
    def usable_bytes(self) -> int:
        return int((self.memory_gb - self.reserved_gb) * GiB)

    @classmethod
    def from_table(cls, name: str, table: dict[str, Any]) -> Board:
        why = "needs a table"
        try:
            b = cls(str(table.get("name", name)), float(table["memory_gb"]), bool(table.get("unified", False)),
                    float(table.get("reserved_gb", 0.0)))
            if 0 < b.memory_gb < 1 << 20 and 0 <= b.reserved_gb < b.memory_gb:
                return b
            why = f"memory_gb {b.memory_gb} and reserved_gb {b.reserved_gb} out of range"
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            why = f"{type(e).__name__}: {e}"
        raise SpecEdgeError(f"[board] of {name}: needs memory_gb (a number of GB > 0), optional unified (bool) and "
                            f"reserved_gb (0 <= reserved_gb < memory_gb): {why}")


def _per_weight(fmt: str, scale_bytes: float, block: int = 32) -> float:
    """Bytes per weight of a linear layer in format fmt (int formats: the value plus its block's scale and, for
    GGUF Q4_1/Q4_K carried exactly, an offset of the same size — counted: the plan is an upper bound)."""
    if fmt in WEIGHT_BYTES:
        return WEIGHT_BYTES[fmt]
    if fmt == "int8":
        return 1.0 + scale_bytes / block
    if fmt == "int4":
        return 0.5 + 2 * scale_bytes / block
    raise SpecEdgeError(f"weight format {fmt!r}: one of fp32, fp16, bf16, int8, int4")


def weight_bytes(d: ModelDims, linear: str, head: str, embedding: str, scale_bytes: float = 4.0) -> dict[str, int]:
    """Weights of one model: the linear layers, the lm_head and the embedding table (stored apart from the
    head in every graph we write, tied or not: the gather table and the matmul want different layouts)."""
    q_out, kv_out = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
    per_layer = d.hidden * (2 * q_out + 2 * kv_out) + 3 * d.hidden * d.ffn
    norms = (2 * d.n_layers + 1) * d.hidden * 4
    return {"linear": int(d.n_layers * per_layer * _per_weight(linear, scale_bytes)) + norms,
            "lm_head": int(d.vocab * d.hidden * _per_weight(head, scale_bytes)),
            "embedding": int(d.vocab * d.hidden * WEIGHT_BYTES[embedding])}


def kv_bytes(d: ModelDims, max_context: int, kv_dtype: str, t_max: int) -> tuple[int, int]:
    """(cache at S_max, new-rows buffer of the widest step) of kv_dtype's rows."""
    row = d.n_layers * 2 * d.n_kv_heads * kv_row_bytes(d.head_dim, kv_dtype)
    return row * max_context, row * t_max


def scratch_bytes(d: ModelDims, max_context: int, t_max: int, l_max: int, act_bytes: int) -> int:
    """Estimate of one step's live activations at width t_max: the fp32 logits rows, attention scores over the
    whole cache (all heads), and the widest MLP intermediates, twice (a layer's input and output alive)."""
    logits = l_max * d.vocab * 4
    scores = d.n_heads * t_max * max_context * 4
    mlp = 2 * t_max * (2 * d.ffn + 4 * d.hidden) * act_bytes
    return logits + scores + mlp


@dataclass
class ModelPlan:
    role: str
    weights: dict[str, int]
    kv: int
    new_rows: int
    scratch: int

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.kv + self.new_rows + self.scratch


@dataclass
class Plan:
    what: str  # e.g. "qwen2.5-coder-1.5b + qwen2.5-coder-0.5b, trt fp16 (head low), S_max 2048"
    gpu: bool
    models: list[ModelPlan]
    board: Board | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def process(self) -> int:
        return PYTHON_BYTES + (CUDA_CONTEXT_BYTES if self.gpu else 0)

    @property
    def total(self) -> int:
        return sum(m.total for m in self.models) + self.process

    @property
    def weights(self) -> int:
        return sum(sum(m.weights.values()) for m in self.models)

    def verdict(self) -> tuple[str, str]:
        """("fits" | "tight" | "does not fit" | "unknown", sentence)."""
        gpu = self.gpu
        if self.board is None:
            return "unknown", "no board given: compare the total with the memory of the machine"
        usable, total = self.board.usable_bytes, self.total
        where = (f"{self.board.name}: {self.board.memory_gb:g} GB, {self.board.reserved_gb:g} GB kept by the "
                 f"{'OS (memory shared by CPU and GPU)' if self.board.unified else 'driver' if gpu else 'OS'}, "
                 f"{usable / GiB:.2f} GB usable")
        if total > usable:
            return "does not fit", f"{total / GiB:.2f} GB > {where}"
        if total > 0.85 * usable:
            return "tight", f"{total / GiB:.2f} GB of {where} (> 85 %: close other programs; estimates are ±10 %)"
        return "fits", f"{total / GiB:.2f} GB of {where}"

    def to_json(self) -> dict[str, Any]:
        v, why = self.verdict()
        return {"what": self.what, "gpu": self.gpu, "board": self.board.__dict__ if self.board else None,
                "models": [{"role": m.role, **{f"weights_{k}": b for k, b in m.weights.items()}, "kv": m.kv,
                            "new_rows": m.new_rows, "scratch_estimate": m.scratch} for m in self.models],
                "process_estimate": self.process, "total": self.total, "verdict": v, "why": why, "notes": self.notes}


def plan_models(models: list[tuple[str, ModelDims, str, int, int]], *, max_context: int, backend: str,
                precision: str, head: str, what: str, board: Board | None = None, max_batch: int = 1,
                kv_dtype: str | None = None) -> Plan:
    """models: (role, dims, exported weight format, t_max, l_max). backend: trt | ort-cuda | ort-trt | ort-cpu.
    precision: the engine precision on a GPU (fp16/bf16; fp32 = the exported graphs as they are). head: fp32 |
    low (the lm_head in the engine precision). max_batch: sequences each model's KV cache holds (requests decoded
    together: one cache each). kv_dtype: the KV cache's element type on the CPU (the bundle's; default float32)."""
    gpu = backend != "ort-cpu"
    out = []
    for role, d, fmt, t_max, l_max in models:
        if gpu and precision in ("fp16", "bf16"):
            linear = fmt if fmt in ("int4",) else precision  # int4 stays INT4 weight-only (--quant-form qdq)
            head_fmt = "fp32" if head == "fp32" else precision
            emb, scale, act, kvb = precision, 2.0, 2, "float16"
        else:
            linear = fmt
            head_fmt = "int8" if fmt in ("int8", "int4") else fmt
            emb, scale, act, kvb = ("fp16" if fmt in ("int8", "int4") else "fp32"), 4.0, 4, kv_dtype or "float32"
        kv, new = kv_bytes(d, max_context, kvb, t_max)
        kv *= max_batch  # a draft model too drafts in a slot of its own per request decoded together
        out.append(ModelPlan(role, weight_bytes(d, linear, head_fmt, emb, scale), kv, new,
                             scratch_bytes(d, max_context, t_max, l_max, act)))
    notes = ["scratch and process are estimates; `spec-export build` reports TensorRT's real scratch per engine"]
    if max_batch > 1:
        notes.append(f"the target's KV, and a draft model's, hold {max_batch} sequences (max_batch {max_batch}: "
                     "requests decoded together)")
    if gpu and board is not None and board.unified:
        notes.append("unified memory: engine files are memory-mapped while loading (page cache, reclaimable); a "
                     "TensorRT build needs about twice the weights plus its workspace on top of the OS")
    return Plan(what, gpu, out, board, notes)


CONTEXT_FLOOR = 2048  # the shortest S_max a default context halves down to (a model's own is less: its own)


def context_that_fits(models: list[tuple[str, ModelDims, str, int, int]], own: int, board: Board | None, *,
                      kv_dtype: str | None = None, max_batch: int = 1) -> int:
    """The S_max a bundle takes by default: the models' own context (``own``), halved while its CPU plan does not
    fit ``board`` with ``max_batch`` sequences ("fits", not "tight"), never below CONTEXT_FLOOR (or ``own`` if that
    is less). Without a board, ``own``."""
    c = own
    while board is not None and c > CONTEXT_FLOOR:
        p = plan_models(models, max_context=c, backend="ort-cpu", precision="fp32", head="fp32", what="",
                        board=board, max_batch=max_batch, kv_dtype=kv_dtype)
        if p.verdict()[0] == "fits":
            return c
        c //= 2
    return max(c, min(own, CONTEXT_FLOOR))


def plan_for_manifest(m: Manifest, backend: str, precision: str = "fp32", head: str = "fp32",
                      board: Board | None = None, what: str | None = None, max_batch: int = 1) -> Plan:
    models = []
    for role, e in (("target", m.target), ("draft", m.draft)):
        if e is None:
            continue
        models.append((role, e.dims, e.precision, max(w.T for w in e.widths), max(w.L for w in e.widths)))
    kv = f", KV {KV_DTYPE_SHORT[m.kv_dtype]}" if m.kv_dtype != "float32" and backend == "ort-cpu" else ""
    label = what or (f"{m.target.source.get('name', 'target') if isinstance(m.target.source, dict) else 'target'}"
                     f"{' + draft' if m.draft else ''}, {backend} {precision} (head {head}), S_max {m.max_context}{kv}")
    plan = plan_models(models, max_context=m.max_context, backend=backend, precision=precision, head=head,
                       what=label, board=board, max_batch=max_batch,
                       kv_dtype=m.kv_dtype if backend == "ort-cpu" else None)
    if m.draft is not None and m.draft.is_self:  # the target's own layers: its weights and KV cache, nothing more
        draft = next(p for p in plan.models if p.role == "draft")
        draft.weights = {k: 0 for k in draft.weights}
        draft.kv = draft.new_rows = 0
        plan.notes.append(f"the draft is the target's own {m.draft.dims.n_layers} of {m.target.dims.n_layers} layers "
                          "(a self draft): no weights or KV cache of its own")
    return plan


def this_machine() -> Board | None:
    """The machine we run on: a Jetson (memory shared by CPU and GPU: MemTotal, 1.2 GB kept by a headless L4T),
    a discrete GPU (its total, 0.5 GB kept by the driver), else the host's memory (1 GB kept by the OS)."""
    from .doctor import jetson_info, meminfo

    total = meminfo().get("MemTotal") or 0.0
    info = jetson_info()
    if info is not None:
        return Board(str(info.get("model") or "Jetson"), total, True, 1.2)
    try:
        from .backends.cuda_rt import CudaRuntime

        cuda = CudaRuntime()
        return Board(cuda.device_name(), cuda.mem_info()[1] / GiB, False, 0.5)
    except Exception:  # no GPU or no libcudart: the host
        return Board("this machine (host memory)", total, False, 1.0) if total else None


def format_plan(p: Plan) -> str:
    gb = lambda b: f"{b / GiB:6.2f} GB"  # noqa: E731
    lines = [f"memory plan: {p.what}"]
    for m in p.models:
        w = m.weights
        lines.append(f"  {m.role:6s} weights {gb(sum(w.values()))} (linear {gb(w['linear']).strip()}, lm_head "
                     f"{gb(w['lm_head']).strip()}, embedding {gb(w['embedding']).strip()}); "
                     f"KV at S_max {gb(m.kv).strip()}"
                     f" + new rows {gb(m.new_rows).strip()}; scratch ~{gb(m.scratch).strip()}")
    lines.append(f"  process ~{gb(p.process).strip()} ({'CUDA context + TensorRT kernels, ' if p.gpu else ''}Python)")
    v, why = p.verdict()
    lines.append(f"  total {gb(p.total).strip()}: {v.upper()} — {why}")
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)
