"""Build one ONNX graph per model directly from the weights (no torch).

The graph follows the contract in ``specedge.runtime.manifest.io_spec``:

    input_ids [B, T] int64, past_len [B] int64, logits_at [B, L] int64,
    past_key_values.{i}.key|value [B, H_kv, S_max, D]
    -> logits [B, L, V], present.{i}.key|value [B, H_kv, T, D]  (portable: only the T new rows)
                         or [B, H_kv, S_max, D] (ort-inplace: the cache buffer itself)

Query t attends to cached positions < past_len and new positions <= t; RoPE at
past_len + t. How attention is expressed depends on the KV mode (``attention.py``).
Linear layers are fp32 MatMuls or MatMulNBits (int8/int4, ``quant.py``), fused as
q|k|v and gate|up; in the specedge form a layer's bias, SwiGLU and residual additions run in
its SekMatMuls' epilogue (``_Linears.epilogue``).

Weights are streamed, one tensor at a time, into a single external-data file
(64-byte aligned), so export peak memory is about one tensor plus the
in-memory graph structure.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from specedge.runtime.errors import UnsupportedModelError
from specedge.runtime.manifest import (
    GRAPH_POSITIONS_KEY,
    GRAPH_RESIDUALS_KEY,
    INTGEMM_FORMAT,
    ONNX_OPSET,
    QDQ_FORMAT,
    ROWS_KV_MODE,
    SEK_ATTENTION,
    SEK_DOMAIN,
    SEK_FORMAT,
    io_spec,
)

from .attention import KV_MODES, InplaceGqaAttention, PortableAttention, SekInplaceAttention, SekRowAttention
from .families import ModelConfig
from .loaders import WeightSource
from .quant import (
    GGUF_REPACKABLE,
    QDQ_OPSET,
    Packed,
    QuantSpec,
    WeightFormat,
    concat_rows,
    dequantize,
    pack_int4,
    positive_scales,
    quantize,
    quantize_channels,
    rel_error,
    repack_gguf,
    sek_pack,
    sek_pack_sb,
    signed_values,
)

_NP_TO_ONNX = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "float16": TensorProto.FLOAT16,
               "int8": TensorProto.INT8}
_ALIGN = 64


class ExternalWeights:
    """Appends initializers to one external-data file as they are produced."""

    def __init__(self, data_path: Path):
        self.data_path = Path(data_path)
        self._f = open(self.data_path, "wb")
        self.initializers: list[TensorProto] = []
        self.bytes_written = 0

    def add(self, name: str, arr: np.ndarray) -> str:
        arr = np.ascontiguousarray(arr)
        return self.add_raw(name, arr.tobytes(), arr.shape, helper.np_dtype_to_tensor_dtype(arr.dtype))

    def add_raw(self, name: str, data: bytes, shape: tuple[int, ...], data_type: int) -> str:
        """An initializer from its raw bytes (types numpy lacks: INT4, two values per byte)."""
        pad = (-self._f.tell()) % _ALIGN
        if pad:
            self._f.write(b"\0" * pad)
        offset = self._f.tell()
        self._f.write(data)
        t = TensorProto()
        t.name = name
        t.data_type = data_type
        t.dims.extend(shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", self.data_path.name), ("offset", str(offset)), ("length", str(len(data)))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.initializers.append(t)
        self.bytes_written += len(data)
        return name

    def close(self) -> None:
        self._f.close()


class _Graph:
    """Tiny node-list helper: unique names, constants, and op shorthands."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.consts: list[TensorProto] = []
        self._n = 0

    def op(self, op_type: str, *inputs: str, n_out: int = 1, **attrs) -> str | list[str]:
        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}_{j}" for j in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{op_type}_{self._n}", **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, arr: np.ndarray | list | float | int, dtype=np.int64) -> str:
        self._n += 1
        name = f"const_{self._n}"
        self.consts.append(onnx.numpy_helper.from_array(np.asarray(arr, dtype=dtype), name))
        return name


class _Linears:
    """Emits every linear layer in one weight format: MatMul over fp32 [in, out], or MatMulNBits.

    Records what it did for the manifest: how many matrices were re-packed from GGUF blocks
    bit-exactly, how many re-quantized, and the weight error re-quantization added.
    """

    def __init__(self, g: _Graph, w: ExternalWeights, src: WeightSource, fmt: WeightFormat):
        self.g, self.w, self.src, self.fmt = g, w, src, fmt
        self.repacked = self.requantized = 0  # matrices (parts of fused ones counted one by one)
        self._indicators: dict[tuple[int, int], str] = {}
        self._sums: dict[tuple[str, int, int], str] = {}
        self._rowq: dict[str, tuple[str, str | tuple[str, str]]] = {}
        self._zp: str | None = None
        self._splits: dict[int, str] = {}  # F -> the [F, F] split of gate|up (where SwiGLU is not fused)
        self._err_num = self._err_den = 0.0
        self._worst = 0.0
        self.head_type = ""  # --lm-head gguf: the GGUF type the head was carried as
        self.requantized_types: set[str] = set()  # GGUF block types with no exact form here, re-quantized

    def __call__(self, x: str, name: str, parts: list[str], spec: QuantSpec | None = None,
                 weights: np.ndarray | None = None) -> str:
        """x [.., in] @ concat(parts, out axis).T -> [.., out]. ``weights`` overrides reading ``parts``."""
        spec = spec if spec is not None or weights is not None else self.fmt.linear_spec()
        if spec is None or (spec.bits == 8 and self.fmt.intgemm):  # from the float weights (intgemm: quantized once)
            w_cat = weights if weights is not None else np.concatenate([self.src.get(p) for p in parts], axis=0)
            if spec is not None:
                return self._emit_intgemm(x, name, w_cat)
            return self.g.op("MatMul", x, self.w.add(f"{name}.weight", w_cat.T))  # [in, out]
        # an explicit --lm-head width is what the head gets (and what the manifest says), even when the GGUF's own
        # blocks could be carried at another width
        exact_width = name == "lm_head" and self.fmt.lm_head not in ("auto", "gguf")
        groups = (self._gguf_head(weights, parts[0]) if name == "lm_head" and self.fmt.lm_head == "gguf"
                  else self._pack_groups(parts, spec, weights, exact_width))
        outs = [self._emit(x, name if len(groups) == 1 else f"{name}.{i}", packed, spec)
                for i, packed in enumerate(groups)]
        return outs[0] if len(outs) == 1 else self.g.op("Concat", *outs, axis=-1)  # parts in order, [.., out]

    def epilogue(self, y: str, bias: str | None = None, swiglu: int | None = None, residual: str | None = None) -> str:
        """What follows a linear layer: + bias, then SwiGLU (``swiglu``: F, gate|up's halves; silu(gate) * up),
        then residual + y. Fused into the SekMatMul that computed ``y`` where it is one (the specedge form,
        one matrix, no padded columns: runtime/csrc/sek_ort.c), which saves a layer five nodes; else as nodes."""
        node = self.g.nodes[-1] if self.g.nodes and self.g.nodes[-1].output[0] == y else None
        if node is not None and node.op_type == "SekMatMul":
            n = next(a.i for a in node.attribute if a.name == "N")
            if swiglu is None or n % 32 == 0:
                extra = [bias or "", residual or ""]
                while extra and not extra[-1]:
                    extra.pop()
                node.input.extend(extra)
                if swiglu is not None:
                    node.attribute.append(helper.make_attribute("activation", 1))
                return y
        if bias is not None:
            y = self.g.op("Add", y, bias)
        if swiglu is not None:
            if swiglu not in self._splits:
                self._splits[swiglu] = self.g.const([swiglu, swiglu])
            gate, up = self.g.op("Split", y, self._splits[swiglu], axis=-1, n_out=2)
            y = self.g.op("Mul", self.g.op("Mul", gate, self.g.op("Sigmoid", gate)), up)  # silu(gate) * up
        return y if residual is None else self.g.op("Add", residual, y)

    def _emit(self, x: str, name: str, packed: Packed, spec: QuantSpec) -> str:
        if self.fmt.intgemm and packed.bits == 8:  # a GGUF Q6_K/Q8_0 part carried at 8 bits in an int4 model
            return self._emit_intgemm(x, name, dequantize(packed))
        if self.fmt.specedge:
            return self._emit_sek(x, name, packed)
        if self.fmt.qdq:
            y, packed = self._emit_qdq(x, name, packed)
        else:
            ins = [x, self.w.add(f"{name}.qweight", packed.b), self.w.add(f"{name}.scales", packed.scales)]
            if packed.zero_points is not None:
                ins.append(self.w.add(f"{name}.zero_points", packed.zero_points))
            y = self.g.op("MatMulNBits", *ins, domain="com.microsoft", K=packed.k, N=packed.n, bits=packed.bits,
                          block_size=packed.block, accuracy_level=spec.accuracy_level)
        if packed.offsets is None:
            return y
        # GGUF Q4_1/Q4_K: + sum_b offset[n, b] * (sum of x over block b): the block sums of x (once per input
        # and block size: q|k|v and gate|up share theirs), then one small fp32 MatMul with offsets.T [K/32, N]
        sums = self._block_sums(x, packed.k, packed.block)
        return self.g.op("Add", y, self.g.op("MatMul", sums, self.w.add(f"{name}.offsets", packed.offsets.T)))

    def _emit_sek(self, x: str, name: str, packed: Packed) -> str:
        """x [.., K] @ the matrix through specedge's kernel (runtime/kernels.py), the weights in its tile layout,
        output columns padded to whole tiles sliced off: ai.specedge::SekMatMul with fp32 block scales
        (quant.sek_pack), or SekMatMulSB with a GGUF K-quant's own two-level scales (quant.sek_pack_sb)."""
        if packed.superblocks is not None:
            sb = packed.superblocks
            b, sc, d, mn, dmin, n_pad = sek_pack_sb(packed)
            mins = (np.zeros(0, np.int8), np.zeros(0, np.float16)) if mn is None else (mn, dmin)
            y = self.g.op("SekMatMulSB", x, self.w.add(f"{name}.qweight", b), self.w.add(f"{name}.block_scales", sc),
                          self.w.add(f"{name}.scales", d), self.w.add(f"{name}.block_mins", mins[0]),
                          self.w.add(f"{name}.min_scales", mins[1]), domain=SEK_DOMAIN, K=packed.k, N=n_pad,
                          bits=sb.bits, block_size=packed.block, superblock=sb.superblock, zero_point=sb.zero_point)
        else:
            b, scales, zp, n_pad = sek_pack(packed)
            y = self.g.op("SekMatMul", x, self.w.add(f"{name}.qweight", b), self.w.add(f"{name}.scales", scales),
                          self.w.add(f"{name}.zero_points", zp), domain=SEK_DOMAIN, K=packed.k, N=n_pad,
                          bits=packed.bits, block_size=packed.block)
        if n_pad == packed.n:
            return y
        return self.g.op("Slice", y, self.g.const([0]), self.g.const([packed.n]), self.g.const([-1]))

    def _emit_intgemm(self, x: str, name: str, w_cat: np.ndarray) -> str:
        """x [.., K] @ w_cat [N, K].T in integer arithmetic: w_cat as int8 per output channel (quantize_channels, 7
        or 8 bits), x as uint8 per row (``_row_quantized``), MatMulInteger's int32 sums, then x's row scale times
        w's channel scale. Every row's sums are exact integers whatever the other rows are (the ranges keep every
        CPU kernel's int16 pair sums from saturating: WeightFormat.intgemm_pair_bound), so batch-invariant by
        construction."""
        q, scales = quantize_channels(w_cat, self.fmt.intgemm_weight_bits)
        self._record_error(w_cat, q.astype(np.float32) * scales[:, None])
        xq, xs = self._row_quantized(x)
        acc = self.g.op("MatMulInteger", xq, self.w.add(f"{name}.qweight", np.ascontiguousarray(q.T)),
                        self._row_zero_point())
        if self.fmt.intgemm_activation_bits == 16:  # [2, .., N]: the rounded rows, then their residuals
            hi, lo = self.g.op("Split", acc, self.g.const([1, 1]), axis=0, n_out=2)
            s_hi, s_lo = xs
            y = self.g.op("Add", self.g.op("Mul", self.g.op("Cast", hi, to=TensorProto.FLOAT), s_hi),
                          self.g.op("Mul", self.g.op("Cast", lo, to=TensorProto.FLOAT), s_lo))
            return self.g.op("Squeeze", self.g.op("Mul", y, self.w.add(f"{name}.scales", scales)), self.g.const([0]))
        # channel scales first, then the row's: ONNX Runtime fuses Mul(Cast(MatMulInteger), Mul(a, b)) into
        # MatMulIntegerToFloat, which takes one scale for all of A's rows (per-row scales come out wrong)
        y = self.g.op("Mul", self.g.op("Cast", acc, to=TensorProto.FLOAT), self.w.add(f"{name}.scales", scales))
        return self.g.op("Mul", y, xs)

    def _row_quantized(self, x: str) -> tuple[str, str | tuple[str, str]]:
        """x [.., K] float -> (uint8 round(x / s) + L + 1, s [.., 1]) with s = max|row| / L
        (L = WeightFormat.intgemm_activation_levels: 127, stored 1..255): symmetric per row, so one scalar zero
        point serves every row (MatMulInteger takes no per-row zero point). Once per input (q|k|v and gate|up
        share it); a zero row gets s = tiny, not a division by zero.

        16-bit activations (``intgemm_activation_bits``): L = 63 (stored 1..127; 127 with
        ``intgemm_full_range``), and the row's residual r = x - s q is quantized the same way
        (s2 = max|r| / L <= s / 2L) and stacked as a second row block,
        [2, .., K], so one MatMulInteger call computes both (the weights are read once) and
        y = (s acc_q + s2 acc_r) s_w: a row's small values keep ~13 bits next to an outlier. Returns the scales
        as (s, s2) then."""
        if x not in self._rowq:
            q, s = self._row_levels(x)
            if self.fmt.intgemm_activation_bits == 16:
                q2, s2 = self._row_levels(self.g.op("Sub", x, self.g.op("Mul", q, s)))
                q, s = (self.g.op("Concat", *(self.g.op("Unsqueeze", v, self.g.const([0])) for v in (q, q2)), axis=0),
                        (s, s2))
            zp = float(self.fmt.intgemm_activation_levels + 1)
            u = self.g.op("Add", q, self.g.const(np.float32(zp), np.float32))
            self._rowq[x] = (self.g.op("Cast", u, to=TensorProto.UINT8), s)
        return self._rowq[x]

    def _row_levels(self, v: str) -> tuple[str, str]:
        """v [.., K] -> (round(v / s) in -L..L, float, and s [.., 1] = max|row| / L, tiny for a zero row)."""
        amax = self.g.op("ReduceMax", self.g.op("Abs", v), axes=[-1], keepdims=1)  # opset 17: axes attribute
        levels = np.float32(self.fmt.intgemm_activation_levels)
        s = self.g.op("Div", self.g.op("Max", amax, self.g.const(np.float32(1e-30), np.float32)),
                      self.g.const(levels, np.float32))
        return self.g.op("Round", self.g.op("Div", v, s)), s

    def _row_zero_point(self) -> str:
        if self._zp is None:
            self._zp = self.g.const(np.uint8(self.fmt.intgemm_activation_levels + 1), np.uint8)
        return self._zp

    def _block_sums(self, x: str, k: int, block: int) -> str:
        """x [1, T, K] (or [T, K]) -> [T, K/block], each block's sum: a Reshape and a ReduceSum over 32 values, row
        by row (a row's sums never depend on the other rows: batch-invariant), reading nothing but x. A K that
        the block does not divide takes the block-indicator MatMul instead (x @ E, E [K, K/block] of 0/1)."""
        key = (x, k, block)
        if key not in self._sums:
            if k % block:
                self._sums[key] = self.g.op("MatMul", x, self._block_indicator(k, block))
            else:
                blocks = self.g.op("Reshape", x, self.g.const([-1, k // block, block]))
                self._sums[key] = self.g.op("ReduceSum", blocks, self.g.const([-1]), keepdims=0)
        return self._sums[key]

    def _emit_qdq(self, x: str, name: str, packed: Packed) -> tuple[str, Packed]:
        """x @ DequantizeLinear(q [K, N], scales [K/block, N], axis 0, block_size) — standard ONNX (opset 21).
        4-bit blocks get positive scales first (TensorRT refuses a scale <= 0; ``positive_scales`` keeps the
        weights exact by moving a sign flip into the block offset). Returns the output and the Packed whose
        offsets the caller adds."""
        if packed.bits == 4:
            packed = positive_scales(packed)
        q = np.ascontiguousarray(signed_values(packed).T)  # [K, N]
        if packed.bits == 4:
            qw = self.w.add_raw(f"{name}.qweight", pack_int4(q), q.shape, TensorProto.INT4)
        else:
            qw = self.w.add(f"{name}.qweight", q)
        s = self.w.add(f"{name}.scales", np.ascontiguousarray(packed.scales.T))  # [K/block, N]
        wd = self.g.op("DequantizeLinear", qw, s, axis=0, block_size=packed.block)
        return self.g.op("MatMul", x, wd), packed

    def _block_indicator(self, k: int, block: int) -> str:
        key = (k, block)
        if key not in self._indicators:
            e = np.zeros((k, -(-k // block)), dtype=np.float32)  # [K, k_blocks]
            e[np.arange(k), np.arange(k) // block] = 1.0
            self._indicators[key] = self.w.add(f"block_indicator.{k}x{block}", e)
        return self._indicators[key]

    def _carried(self, raw: tuple[str, np.ndarray] | None, spec: QuantSpec, exact_width: bool = False) -> bool:
        """Whether a GGUF tensor is carried over exactly. Default (gguf_exact): every type with an exact
        MatMulNBits form, at its own width (a Q6_K tensor stays 8-bit in an int4 bundle: faithful first).
        --no-gguf-exact: only Q4_0 / Q8_0, and only at the requested width. exact_width (an explicit --lm-head):
        only a type whose exact form has the requested width; any other is re-quantized to it."""
        if raw is None or raw[0] not in GGUF_REPACKABLE or not spec.symmetric or spec.block != 32:
            return False
        if self.fmt.gguf_exact:
            return not exact_width or GGUF_REPACKABLE[raw[0]][2] == spec.bits
        return raw[0] in ("Q4_0", "Q8_0") and GGUF_REPACKABLE[raw[0]][2] == spec.bits

    def _gguf_head(self, weights: np.ndarray | None, part: str = "lm_head") -> list[Packed]:
        """--lm-head gguf: the source's own output.weight blocks (``part`` "embed": a tied head's, the token
        embedding's), whatever --gguf-exact, --quant-block and --asymmetric say for the other matrices (Q4_K_M files
        hold it as Q6_K: 6.56 bits a weight, where a re-quantized int8 head at block 128 takes 8.3)."""
        raw = self.src.raw(part) if weights is None else None
        tensor = "token embedding (the tied head)" if part == "embed" else "output.weight"
        if weights is not None:
            why = "this head is a partial draft head (--draft-vocab)"
        elif raw is None:
            why = f"the source has no block-quantized {tensor} (not a GGUF, or a float one)"
        elif raw[0] not in GGUF_REPACKABLE:
            why = f"its {tensor} is {raw[0]}; the blocks carried as they are: {', '.join(GGUF_REPACKABLE)}"
        else:
            why = ""
        if why:
            raise UnsupportedModelError(f"--lm-head gguf carries a GGUF's own output.weight blocks, and {why}: "
                                        "use --lm-head int8 (or auto)")
        self.repacked += 1
        self.head_type = raw[0]
        return [repack_gguf(*raw)]

    def _pack_groups(self, parts: list[str], spec: QuantSpec, weights: np.ndarray | None,
                     exact_width: bool = False) -> list[Packed]:
        """The matrix in MatMulNBits form, as few groups as the parts allow: consecutive parts that end up with
        the same bits and block are fused into one; GGUF blocks are carried over where ``_carried`` says so,
        the rest quantized from their float values."""
        if weights is not None:
            return [self._quantize(weights, spec)]
        raws = [self.src.raw(p) for p in parts]
        packed = []
        for part, r in zip(parts, raws):
            if r is not None and r[0] not in GGUF_REPACKABLE:
                self.requantized_types.add(r[0])
            elif r is None and part in self.src.float_types:  # a GGUF's F16 / BF16 matrix, quantized to this width
                self.requantized_types.add(self.src.float_types[part])
            if self._carried(r, spec, exact_width):
                packed.append(repack_gguf(*r))
                # an 8-bit part in the integer-GEMM form is re-quantized per channel (_emit), not carried
                self.repacked += not (self.fmt.intgemm and packed[-1].bits == 8)
            else:
                packed.append(None)
        if not any(x is not None for x in packed):  # nothing carried: quantize the fused matrix in one go
            self.requantized += len(parts) - 1
            return [self._quantize(np.concatenate([self.src.get(p) for p in parts], axis=0), spec)]
        packed = [x if x is not None else self._quantize(self.src.get(p), spec) for p, x in zip(parts, packed)]
        groups: list[list[Packed]] = []
        form = lambda p: (p.bits, p.block, None if p.superblocks is None else p.superblocks.key())  # noqa: E731
        for x in packed:  # parts with two-level scales fuse only with parts of the same kind (they keep them)
            if groups and form(groups[-1][0]) == form(x):
                groups[-1].append(x)
            else:
                groups.append([x])
        return [concat_rows(g) for g in groups]

    def _quantize(self, w_cat: np.ndarray, spec: QuantSpec) -> Packed:
        packed = quantize(w_cat, spec)
        self._record_error(w_cat, dequantize(packed))
        return packed

    def _record_error(self, w_cat: np.ndarray, approx: np.ndarray) -> None:
        self.requantized += 1
        d = rel_error(w_cat, approx)
        n2 = float((w_cat.astype(np.float64) ** 2).sum())
        self._err_num += d * d * n2
        self._err_den += n2
        self._worst = max(self._worst, d)

    def report(self) -> dict:
        if not self.fmt.quantized:
            return {}
        err = (self._err_num / self._err_den) ** 0.5 if self._err_den else 0.0
        lm = self.fmt.lm_head_spec()
        # INTGEMM_FORMAT alone: no MatMulNBits left (no even-width rule; the runtime reads it so)
        form = (QDQ_FORMAT if self.fmt.qdq else SEK_FORMAT if self.fmt.specedge
                else "MatMulNBits" if not self.fmt.intgemm
                else f"MatMulNBits+{INTGEMM_FORMAT}" if self.fmt.even_widths else INTGEMM_FORMAT)
        return {"format": form, "bits": int(self.fmt.name[3:]),
                "block": self.fmt.block,
                "symmetric": self.fmt.symmetric, "accuracy_level": self.fmt.accuracy_level,
                "lm_head": ("gguf" if self.fmt.lm_head == "gguf" else f"int{lm.bits}" if lm else "fp32"),
                **({"lm_head_gguf_type": self.head_type} if self.head_type else {}),
                "embedding": self.fmt.embedding,
                "gguf_exact": self.fmt.gguf_exact,
                **({"activation_bits": self.fmt.intgemm_activation_bits, "weight_bits": self.fmt.intgemm_weight_bits,
                    "pair_sum_bound": self.fmt.intgemm_pair_bound} if self.fmt.intgemm else {}),
                "repacked_from_gguf": self.repacked, "requantized": self.requantized,
                **({"requantized_gguf_types": sorted(self.requantized_types)} if self.requantized_types else {}),
                "requant_weight_rel_rms_error": round(err, 5),
                "requant_weight_rel_rms_error_max": round(self._worst, 5)}


def build_model_graph(
    src: WeightSource,
    out_dir: Path,
    graph_name: str,
    progress: Callable[[str], None] | None = None,
    fmt: WeightFormat = WeightFormat(),
    kv_mode: str = "portable",
    kv_dtype: str = "float32",
    max_positions: int = 2048,
    argmax: bool = False,
    head_ids: np.ndarray | None = None,
) -> tuple[Path, Path, dict]:
    """Write ``<graph_name>.onnx`` + ``<graph_name>.onnx.data`` into out_dir; returns their paths and the
    quantization report (empty for fp32).

    head_ids (a draft's ``HeadRows.ids()``): the lm_head keeps only these rows, in this order, so logits column j
    is token head_ids[j]. Its rows are taken from the float weights (a GGUF's blocks are not carried for it)."""
    cfg: ModelConfig = src.config
    d = cfg.dims
    H = d.hidden
    onnx_path = Path(out_dir) / f"{graph_name}.onnx"
    data_path = Path(out_dir) / f"{graph_name}.onnx.data"
    w = ExternalWeights(data_path)
    g = _Graph()
    opset = QDQ_OPSET if fmt.qdq else ONNX_OPSET
    say = progress or (lambda s: None)
    linear = _Linears(g, w, src, fmt)

    inv_freq = cfg.inv_freq(src.rope_freq_factors, max_positions)  # [R/2]: the rotary dims
    if kv_mode == "portable":
        attention = PortableAttention(g, w, cfg, inv_freq)
    elif kv_mode == "ort-inplace":  # the specedge form brings its own attention: rows invariant at width 1 too
        attention = (SekInplaceAttention if fmt.specedge else InplaceGqaAttention)(g, w, cfg, inv_freq, max_positions)
    elif kv_mode == ROWS_KV_MODE:
        if not fmt.specedge:
            raise UnsupportedModelError("row-addressed steps need specedge's attention: the specedge weight form "
                                        "(--quant-form specedge)")
        attention = SekRowAttention(g, w, cfg, inv_freq, max_positions)
    else:
        raise UnsupportedModelError(f"kv mode {kv_mode!r}: choose one of {', '.join(KV_MODES)}")

    def rmsnorm(x: str, weight: str) -> str:
        # Pow -> ReduceMean -> Add -> Sqrt -> Div: the pattern ONNX Runtime fuses into SimplifiedLayerNormalization
        sq = g.op("Pow", x, g.const(2.0, np.float32))
        var = (g.op("ReduceMean", sq, axes=[-1], keepdims=1) if opset < 18  # axes became an input in opset 18
               else g.op("ReduceMean", sq, g.const([-1]), keepdims=1))
        std = g.op("Sqrt", g.op("Add", var, g.const(cfg.rms_eps, np.float32)))
        return g.op("Mul", g.op("Div", x, std), weight)

    def head_norm(y: str, heads: int, weight: str) -> str:
        """y [B, T, heads D]: each head's D values RMS-normalized with its weight [D] (qwen3's q and k norm)."""
        per_head = g.op("Reshape", y, g.const([0, 0, heads, d.head_dim]))
        return g.op("Reshape", rmsnorm(per_head, weight), g.const([0, 0, heads * d.head_dim]))

    def geglu(gate_up: str) -> str:
        """gate|up [.., 2F] -> gelu(gate) * up, GELU's tanh form (gemma's gelu_pytorch_tanh), element by element:
        0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))."""
        gate, up = g.op("Split", gate_up, g.const([d.ffn, d.ffn]), axis=-1, n_out=2)
        cube = g.op("Mul", g.op("Mul", gate, gate), gate)
        inner = g.op("Mul", g.op("Add", gate, g.op("Mul", cube, g.const(np.float32(0.044715), np.float32))),
                     g.const(np.float32(np.sqrt(2.0 / np.pi)), np.float32))
        half = g.op("Mul", gate, g.const(np.float32(0.5), np.float32))
        gelu = g.op("Mul", half, g.op("Add", g.op("Tanh", inner), g.const(np.float32(1.0), np.float32)))
        return g.op("Mul", gelu, up)

    def scaled(y: str, factor: float) -> str:
        return y if factor == 1.0 else g.op("Mul", y, g.const(np.float32(factor), np.float32))

    say("embeddings")
    embed_f32 = src.get("embed")  # [V, H]
    if fmt.quantized and fmt.embedding == "fp16":  # fp16 table, one row gathered per token, then widened
        embed = w.add("embed.weight_fp16", embed_f32.astype(np.float16))
        x = g.op("Cast", g.op("Gather", embed, "input_ids", axis=0), to=TensorProto.FLOAT)  # [B, T, H]
    else:
        embed = w.add("embed.weight", embed_f32)
        x = g.op("Gather", embed, "input_ids", axis=0)  # [B, T, H]
    x = scaled(x, cfg.embedding_scale)
    if (not cfg.tie_embeddings or not fmt.quantized) and head_ids is None:
        del embed_f32

    residuals = [x]  # the stream before each layer and after the last: where a self draft skips layers
    for i in range(d.n_layers):
        say(f"layer {i + 1}/{d.n_layers}")
        p = f"layers.{i}"
        h = rmsnorm(x, w.add(f"{p}.attn_norm.weight", src.get(f"l{i}.attn_norm")))
        qkv = linear(h, f"{p}.attn.qkv", [f"l{i}.q", f"l{i}.k", f"l{i}.v"])  # fused: [B, T, (Hq+2Hkv) D]
        k_bias = src.get(f"l{i}.k_bias") if cfg.family.qkv_bias else None
        if k_bias is not None:
            bias = np.concatenate([src.get(f"l{i}.q_bias"), k_bias, src.get(f"l{i}.v_bias")])
            qkv = linear.epilogue(qkv, bias=w.add(f"{p}.attn.qkv.bias", bias))
        if cfg.family.qk_norm:
            q, k, v = g.op("Split", qkv, g.const([d.n_heads * d.head_dim] + [d.n_kv_heads * d.head_dim] * 2),
                           axis=-1, n_out=3)
            q = head_norm(q, d.n_heads, w.add(f"{p}.attn.q_norm.weight", src.get(f"l{i}.q_norm")))
            k = head_norm(k, d.n_kv_heads, w.add(f"{p}.attn.k_norm.weight", src.get(f"l{i}.k_norm")))
            qkv = g.op("Concat", q, k, v, axis=-1)
        shifted = (k_bias is not None and kv_dtype != "float32" and not cfg.family.qk_norm
                   and isinstance(attention, SekInplaceAttention))  # fp16 / int8 caches hold the keys less the bias
        attn = attention(i, qkv, k_bias) if shifted else attention(i, qkv)  # [B, T, Hq D]; writes present.{i}.*
        y = linear(attn, f"{p}.attn.o", [f"l{i}.o"])
        if cfg.family.gemma:  # the attention's output normalized before it joins the stream
            y = rmsnorm(y, w.add(f"{p}.attn.post_norm.weight", src.get(f"l{i}.post_attn_norm")))
        x = linear.epilogue(scaled(y, cfg.residual_scale), residual=x)

        h = rmsnorm(x, w.add(f"{p}.mlp_norm.weight", src.get(f"l{i}.mlp_norm")))
        gate_up = linear(h, f"{p}.mlp.gate_up", [f"l{i}.gate", f"l{i}.up"])
        act = geglu(gate_up) if cfg.family.gemma else linear.epilogue(gate_up, swiglu=d.ffn)  # [B, T, F]
        y = linear(act, f"{p}.mlp.down", [f"l{i}.down"])
        if cfg.family.gemma:
            y = rmsnorm(y, w.add(f"{p}.mlp.post_norm.weight", src.get(f"l{i}.post_mlp_norm")))
        x = linear.epilogue(scaled(y, cfg.residual_scale), residual=x)
        residuals.append(x)

    say("lm_head")
    x = rmsnorm(x, w.add("final_norm.weight", src.get("final_norm")))
    picked = g.op("GatherND", x, g.op("Unsqueeze", "logits_at", g.const([2])), batch_dims=1)  # [B, L, H]
    flat = g.op("Reshape", picked, g.const([-1, H]))
    head_spec = fmt.lm_head_spec()
    n_logits = d.vocab
    if head_ids is not None:  # a draft's partial head: its own rows, whatever the tying
        rows = (embed_f32 if cfg.tie_embeddings else src.get("lm_head"))[head_ids]
        del embed_f32
        n_logits = len(head_ids)
        logits = (g.op("Gemm", flat, w.add("lm_head.weight", rows), transB=1) if head_spec is None
                  else linear(flat, "lm_head", ["lm_head"], spec=head_spec, weights=rows))  # [B*L, len(head_ids)]
    elif head_spec is None and (not cfg.tie_embeddings or not fmt.quantized):  # fp32, tied: one shared initializer
        lm_head = embed if cfg.tie_embeddings else w.add("lm_head.weight", src.get("lm_head"))  # [V, H]
        logits = g.op("Gemm", flat, lm_head, transB=1)  # [B*L, V]
    elif cfg.tie_embeddings and fmt.lm_head == "gguf":  # the embedding's own blocks, as the file holds them
        logits = linear(flat, "lm_head", ["embed"], spec=head_spec)  # [B*L, V]
    else:
        tied = embed_f32 if cfg.tie_embeddings else None
        logits = linear(flat, "lm_head", ["lm_head"], spec=head_spec, weights=tied)  # [B*L, V]
    if cfg.logit_scale != 1.0:  # granite: the logits divided by its logits_scaling
        logits = g.op("Div", logits, g.const(np.float32(cfg.logit_scale), np.float32))
    if cfg.final_softcap:  # gemma2: c tanh(z / c), as transformers computes it (divide, tanh, multiply)
        cap = g.const(np.float32(cfg.final_softcap), np.float32)
        logits = g.op("Mul", g.op("Tanh", g.op("Div", logits, cap)), cap)
    out_shape = g.op("Concat", g.op("Shape", "logits_at"), g.const([n_logits]), axis=0)
    g.nodes.append(helper.make_node("Reshape", [logits, out_shape], ["logits"]))
    if argmax:  # device-side greedy: [B, L] ids, so a greedy round copies L ids instead of L x V logits.
        # axis 2, not -1: onnx-tensorrt builds ArgMax as a TopK whose axis mask is 1 << axis (it casts the indices to
        # INT64). ONNX picks the first index of a tie; TensorRT's TopK is not documented to - either way every greedy
        # round (plain and speculative alike) takes its ids from here, so the output stays the same for both.
        g.nodes.append(helper.make_node("ArgMax", ["logits"], ["next_ids"], name="next_ids", axis=2, keepdims=0,
                                        select_last_index=0))
    w.close()

    inputs, outputs = io_spec(d, kv_mode, kv_dtype, argmax=argmax, logits_width=n_logits)
    vi = lambda s: helper.make_tensor_value_info(s.name, _NP_TO_ONNX[s.dtype], list(s.shape))  # noqa: E731
    graph = helper.make_graph(
        g.nodes, graph_name, [vi(s) for s in inputs], [vi(s) for s in outputs],
        initializer=g.consts + w.initializers,
    )
    opsets = [helper.make_opsetid("", opset)]
    if (fmt.quantized and not fmt.qdq) or kv_mode != "portable":
        opsets.append(helper.make_opsetid("com.microsoft", 1))  # MatMulNBits, GroupQueryAttention
    if fmt.specedge:
        opsets.append(helper.make_opsetid(SEK_DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="specedge")
    props = {GRAPH_RESIDUALS_KEY: json.dumps(residuals)}
    if kv_mode != "portable":  # the positions its RoPE tables hold: the runtime refuses a manifest whose S_max is more
        props[GRAPH_POSITIONS_KEY] = str(max_positions)
    helper.set_model_props(model, props)
    model.ir_version = 10 if fmt.qdq else 8  # 8: ONNX Runtime >= 1.14, TensorRT 10.x; 10: INT4 tensors
    onnx.save_model(model, str(onnx_path))
    onnx.checker.check_model(str(onnx_path))
    report = linear.report()
    if isinstance(attention, SekInplaceAttention):
        report["attention"] = SEK_ATTENTION  # the runtime reads it: every row invariant, width 1 included
    return onnx_path, data_path, report
