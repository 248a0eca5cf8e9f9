"""Reduced-precision (fp16 / bf16) copies of a bundle's portable ONNX graphs.

TensorRT 10 builds *strongly typed* networks: every tensor's type comes from the ONNX graph
(TensorRT 11 removed the builder's precision flags), so the precision of an engine is decided
here, by rewriting the fp32 graph, not by a builder switch. The same graph runs on ONNX Runtime,
which is how ``spec-export validate`` checks it on a machine without a GPU.

What runs where:

* low precision (the dtype asked for): every MatMul and Gemm (the weights are stored in it),
  the residual stream, RoPE application, attention scores, the MLP, the KV cache (graph inputs
  ``past_key_values.*`` and outputs ``present.*``, so the cache costs half the memory and half
  the bandwidth);
* fp32: RMSNorm statistics (Pow, ReduceMean, Add eps, Sqrt, Div — x² overflows fp16 for
  |x| > 256), Softmax, the RoPE tables (cos/sin of positions up to S_max), and the logits head
  (final norm, lm_head, logits): the acceptance rule divides and compares these
  probabilities, and fp16 logits of magnitude 30 are only good to 0.03.

A generic op (Add, Mul, Where, Concat, Split, Reshape, …) runs in the precision of its first
float input that is not a constant; casts are inserted once per (tensor, dtype) and constants
converted once, so the rewrite is a pure function of the fp32 graph. Weights stream through one
at a time (read from the fp32 external-data file, written to the new one), so converting a 7 GB
graph needs about one tensor of memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specedge.runtime.errors import UnsupportedModelError
from specedge.runtime.manifest import SEK_DOMAIN

from .graph import ExternalWeights

PRECISIONS = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
KV_DTYPE = {"fp16": "float16", "bf16": "bfloat16"}
FP32_OPS = frozenset({"Pow", "ReduceMean", "Sqrt", "Div", "Softmax", "Cos", "Sin", "Exp", "Log", "Reciprocal"})
LOW_OPS = frozenset({"MatMul", "Gemm"})
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


@dataclass(frozen=True)
class ConversionReport:
    precision: str
    nodes: int
    low_nodes: int
    fp32_nodes: int
    casts_added: int
    weight_bytes: int
    seconds: float

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """fp32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FC0), rounded)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _read_raw(t: TensorProto, base: Path) -> bytes:
    meta = {e.key: e.value for e in t.external_data}
    with open(base / meta["location"], "rb") as f:
        f.seek(int(meta.get("offset", 0)))
        return f.read(int(meta["length"]))


def _read_external(t: TensorProto, base: Path) -> np.ndarray:
    meta = {e.key: e.value for e in t.external_data}
    dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
    count = int(np.prod(t.dims)) if len(t.dims) else 1
    arr = np.fromfile(base / meta["location"], dtype=dtype, count=count, offset=int(meta.get("offset", 0)))
    return arr.reshape(tuple(t.dims))


class _Rewriter:
    def __init__(self, model: onnx.ModelProto, src_dir: Path, low: int, weights: ExternalWeights):
        g = model.graph
        self.g, self.src_dir, self.low, self.w = g, src_dir, low, weights
        self.inits = {t.name: t for t in g.initializer}
        self.dtype: dict[str, int] = {}  # tensor name -> element type, as rewritten
        for vi in g.input:
            self.dtype[vi.name] = vi.type.tensor_type.elem_type
        self.converted: dict[tuple[str, int], str] = {}  # (tensor, dtype) -> name of that tensor in dtype
        self.new_nodes: list[onnx.NodeProto] = []
        self.new_inits: dict[str, TensorProto] = {}
        self.casts = 0

    # ---- tensors ----------------------------------------------------------
    def value(self, name: str) -> np.ndarray:
        t = self.inits[name]
        if t.data_location == TensorProto.EXTERNAL:
            return _read_external(t, self.src_dir)
        return numpy_helper.to_array(t)

    def type_of(self, name: str) -> int | None:
        return self.inits[name].data_type if name in self.inits else self.dtype.get(name)

    def as_type(self, name: str, to: int) -> str:
        """`name` in element type `to`: the tensor itself, a converted constant, or a Cast (made once)."""
        have = self.type_of(name)
        if have == to or have not in _FLOATS:
            return name
        key = (name, to)
        if key in self.converted:
            return self.converted[key]
        suffix = {TensorProto.FLOAT: "fp32", TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}[to]
        new = f"{name}.{suffix}"
        if name in self.inits:
            self.add_constant(new, self.value(name), to)
        else:
            self.new_nodes.append(helper.make_node("Cast", [name], [new], name=f"cast_{new}", to=to))
            self.casts += 1
        self.dtype[new] = to
        self.converted[key] = new
        return new

    def add_constant(self, name: str, arr: np.ndarray, to: int) -> None:
        arr = np.asarray(arr, dtype=np.float32)
        if to == TensorProto.FLOAT16:
            data = arr.astype(np.float16)
        elif to == TensorProto.BFLOAT16:
            data = to_bf16_bits(arr)
        else:
            data = arr
        if data.nbytes >= 1024:  # weights go to the external file; small constants stay inline
            self.w.add(name, data)
            t = self.w.initializers[-1]
        else:
            t = numpy_helper.from_array(data, name)
        t.data_type = to  # bf16 bits were written as uint16
        self.new_inits[name] = t

    def keep_init(self, name: str) -> None:
        """An initializer used as is: copied (streamed) into the new graph once."""
        if name in self.new_inits or name not in self.inits:
            return
        t = self.inits[name]
        if t.data_location == TensorProto.EXTERNAL:
            if t.data_type == TensorProto.INT4:  # no numpy type: the packed bytes as they are
                self.w.add_raw(name, _read_raw(t, self.src_dir), tuple(t.dims), t.data_type)
            else:
                self.w.add(name, self.value(name))
            t = self.w.initializers[-1]
        self.new_inits[name] = t

    # ---- nodes ------------------------------------------------------------
    def precision_of(self, node: onnx.NodeProto, forced: dict[str, int]) -> int | None:
        """The float type `node` computes in, or None for a node without float inputs (shape arithmetic)."""
        floats = [i for i in node.input if i and self._is_float(i)]
        if node.op_type == "Cast":  # int -> float casts (RoPE positions) produce fp32; float -> float follow the rules
            to = _cast_to(node)
            if to not in _FLOATS:
                return None
            if not floats:
                return to
        elif not floats:
            return None
        if node.name in forced:
            return forced[node.name]
        if node.op_type in FP32_OPS:
            return TensorProto.FLOAT
        if node.op_type in LOW_OPS:
            return self.low
        live = [i for i in floats if i not in self.inits]
        return self.dtype[live[0]] if live else self.low

    def _is_float(self, name: str) -> bool:
        return self.type_of(name) in _FLOATS

    def rewrite(self, node: onnx.NodeProto, forced: dict[str, int]) -> int | None:
        """Append `node` (inputs cast or converted to its precision) to the new graph; return that precision."""
        prec = self.precision_of(node, forced)
        if node.op_type == "DequantizeLinear" and self.type_of(node.input[0]) != TensorProto.INT4:
            # TensorRT takes block scales for INT4 only: an 8-bit block matrix becomes a plain constant
            q, scale = self.value(node.input[0]).astype(np.float32), self.value(node.input[1])
            block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
            if block and scale.ndim == q.ndim:
                w = np.repeat(scale, block, axis=0)[: q.shape[0]] * q
                self.add_constant(node.output[0], w, prec)
                self.dtype[node.output[0]] = prec
                return prec
        if node.op_type == "Cast" and prec is not None:  # a cast to float lands in the node's precision
            self.keep_init(node.input[0])
            self.new_nodes.append(helper.make_node("Cast", [node.input[0]], list(node.output), name=node.name, to=prec))
            self.dtype[node.output[0]] = prec
            return prec
        ins = []
        for i in node.input:
            if i and prec is not None and self._is_float(i):
                i = self.as_type(i, prec)
            if i in self.inits:
                self.keep_init(i)
            ins.append(i)
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.input[:]
        new.input.extend(ins)
        self.new_nodes.append(new)
        for o in node.output:
            self.dtype[o] = self._out_type(node, prec, ins)
        return prec

    def _out_type(self, node: onnx.NodeProto, prec: int | None, ins: list[str]) -> int:
        if node.op_type == "Cast":
            return _cast_to(node)
        if node.op_type in ("Shape", "Range", "Less", "LessOrEqual", "Greater", "Equal", "ArgMax", "NonZero"):
            return (TensorProto.BOOL if node.op_type in ("Less", "LessOrEqual", "Greater", "Equal")
                    else TensorProto.INT64)
        if prec is not None:
            return prec
        # no float input: integer ops keep their first input's type
        first = ins[0] if ins else None
        if first is None:
            return TensorProto.INT64
        return self.type_of(first) or TensorProto.INT64


def _cast_to(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "to")


def _logits_head(g: onnx.GraphProto) -> set[str]:
    """Names of the nodes from the lm_head MatMul/Gemm to the ``logits`` output (kept in fp32)."""
    producer = {o: n for n in g.node for o in n.output}
    keep, todo = set(), ["logits"]
    while todo:
        n = producer.get(todo.pop())
        if n is None or n.name in keep:
            continue
        keep.add(n.name)
        if n.op_type in LOW_OPS:
            # the lm_head and what feeds it from the final norm (GatherND/Reshape of the normed stream)
            for i in n.input[:1]:
                m = producer.get(i)
                while m is not None and m.op_type in ("Reshape", "GatherND", "Flatten"):
                    keep.add(m.name)
                    m = producer.get(m.input[0])
            continue
        todo.extend(i for i in n.input if i)
    return keep


HEADS = ("fp32", "low")


def convert_graph(src_onnx: Path, dst_onnx: Path, precision: str,
                  progress: Callable[[str], None] | None = None, head: str = "fp32") -> ConversionReport:
    """Write a reduced-precision copy of a portable fp32 graph: ``dst_onnx`` + ``dst_onnx``.data.

    head: "fp32" keeps the lm_head (weights and matmul) in fp32 (the default); "low" stores it in the
    reduced precision too (logits still leave the graph as fp32) — for memory-bound devices, where a
    150k-vocabulary fp32 head costs ~1 GB (it is also a second copy of a tied embedding)."""
    if head not in HEADS:
        raise UnsupportedModelError(f"head {head!r}: choose one of {', '.join(HEADS)}")
    if precision not in PRECISIONS:
        raise UnsupportedModelError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    src_onnx, dst_onnx = Path(src_onnx), Path(dst_onnx)
    model = onnx.load(str(src_onnx), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    # MatMulInteger: standard, not TensorRT's; SekMatMul(SB) / SekAttention: specedge's own CPU ops
    # (--quant-form specedge)
    ort_only = {"MatMulNBits", "GroupQueryAttention", "MatMulInteger", "SekMatMul", "SekMatMulSB", "SekAttention"}
    if ops & ort_only or any(o.domain in ("com.microsoft", SEK_DOMAIN) for o in model.opset_import):
        raise UnsupportedModelError(
            f"{src_onnx.name} uses ONNX Runtime-only ops ({', '.join(sorted(ops & ort_only))}): "
            "reduced-precision graphs for TensorRT are made from fp32 weights, or int8/int4 written as standard "
            "DequantizeLinear, and the portable KV mode; re-export for TensorRT: --for jetson-orin-nano-8gb (int4 as "
            "--quant-form qdq) or --for datacenter-gpu (fp32)")
    low = PRECISIONS[precision]
    g = model.graph
    data_name = dst_onnx.name + ".data"
    w = ExternalWeights(dst_onnx.parent / data_name)
    rw = _Rewriter(model, src_onnx.parent, low, w)
    kv_inputs = [vi for vi in g.input if vi.name.startswith("past_key_values.")]
    for vi in kv_inputs:  # the cache lives in low precision
        vi.type.tensor_type.elem_type = low
        rw.dtype[vi.name] = low
    forced = {name: TensorProto.FLOAT for name in _logits_head(g)} if head == "fp32" else {}
    producer = {o: n for n in g.node for o in n.output}
    for n in g.node:  # GGUF block offsets (block sums of x . offsets^T): sums of 32 activations stay fp32
        if n.op_type == "MatMul" and (n.input[1].startswith("block_indicator.") or n.input[1].endswith(".offsets")):
            forced[n.name] = TensorProto.FLOAT
            if (p := producer.get(n.input[0])) is not None and p.op_type == "ReduceSum":
                forced[p.name] = TensorProto.FLOAT
    for n in g.node:  # a head kept in fp32 dequantizes its weights in fp32 too
        if n.name in forced and n.op_type in LOW_OPS:
            for i in n.input[1:]:
                if (p := producer.get(i)) is not None and p.op_type == "DequantizeLinear":
                    forced[p.name] = TensorProto.FLOAT
    n_low = n_fp32 = 0
    try:
        for i, node in enumerate(g.node):
            if i % 200 == 0:
                say(f"  {precision}: node {i}/{len(g.node)}")
            p = rw.rewrite(node, forced)
            n_low += p == low
            n_fp32 += p == TensorProto.FLOAT
        # outputs: logits in fp32, present rows in the cache's precision
        for vo in g.output:
            if vo.name not in ("logits",) and not vo.name.startswith("present."):
                continue  # next_ids: int64 whatever the precision
            want = low if vo.name.startswith("present.") else TensorProto.FLOAT
            have = rw.dtype.get(vo.name)
            if have != want and have in _FLOATS:
                tmp_name = f"{vo.name}.pre_cast"
                for n in rw.new_nodes:
                    n.output[:] = [tmp_name if o == vo.name else o for o in n.output]
                    n.input[:] = [tmp_name if x == vo.name else x for x in n.input]
                rw.new_nodes.append(helper.make_node("Cast", [tmp_name], [vo.name], name=f"cast_{vo.name}", to=want))
                rw.casts += 1
            vo.type.tensor_type.elem_type = want
    finally:
        w.close()
    del g.node[:]
    g.node.extend(rw.new_nodes)
    del g.initializer[:]
    g.initializer.extend(rw.new_inits.values())
    for t in g.initializer:  # external initializers point at the new data file
        for e in t.external_data:
            if e.key == "location":
                e.value = data_name
    model.producer_name = f"specedge ({precision})"
    onnx.save_model(model, str(dst_onnx))
    onnx.checker.check_model(str(dst_onnx))
    return ConversionReport(precision, len(g.node), n_low, n_fp32, rw.casts, w.bytes_written,
                            round(time.perf_counter() - t0, 2))
