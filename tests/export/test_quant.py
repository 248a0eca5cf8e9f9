"""MatMulNBits packing: quantization error bounds, exact GGUF re-packing, and ONNX Runtime agreement."""

from __future__ import annotations

import gguf
import numpy as np
import onnxruntime as ort
import pytest
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from onnx import TensorProto, helper

from specedge.export.quant import (
    QuantSpec,
    concat_rows,
    dequantize,
    quantize,
    quantize_channels,
    rel_rms_error,
    repack_gguf,
)
from specedge.runtime.errors import UnsupportedModelError

pytestmark = pytest.mark.fast  # torch-free: make test-fast

Q = gguf.GGMLQuantizationType


def _weights(n=24, k=80, seed=0):  # k=80: not a multiple of 32, exercises the padded last block
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_round_to_nearest_error_is_within_half_a_step(bits, symmetric):
    w = _weights()
    p = quantize(w, QuantSpec(bits, 32, symmetric, search=False))
    step = np.repeat(np.abs(p.scales), 32, axis=1)[:, : w.shape[1]]
    err = np.abs(dequantize(p) - w)
    # round to nearest: half a step, except the symmetric form clips the top level (+7/+127 vs -8/-128)
    bound = step * (1.0 if symmetric else 0.5) + 1e-6
    assert (err <= bound).all()
    assert rel_rms_error(w, p) < (0.12 if bits == 4 else 0.008)


def _block_sq_err(w, p):
    d = np.zeros((w.shape[0], -(-w.shape[1] // p.block) * p.block), np.float64)
    d[:, : w.shape[1]] = dequantize(p).astype(np.float64) - w
    return (d.reshape(w.shape[0], -1, p.block) ** 2).sum(-1)  # [N, k_blocks]


@pytest.mark.parametrize("bits,symmetric,block", [(4, True, 32), (4, False, 32), (4, True, 128), (4, False, 128),
                                                  (8, True, 32)])
def test_scale_search_never_loses_to_round_to_nearest_and_usually_wins(bits, symmetric, block):
    w = _weights(n=64, k=300)
    rtn, best = (quantize(w, QuantSpec(bits, block, symmetric, search=s)) for s in (False, True))
    e_rtn, e_best = _block_sq_err(w, rtn), _block_sq_err(w, best)
    assert (e_best <= e_rtn * (1 + 1e-5) + 1e-9).all()  # round-to-nearest is one of the candidates
    if bits == 4:  # and a better scale exists for most 4-bit blocks of gaussian weights
        assert e_best.sum() < 0.94 * e_rtn.sum()
        assert (e_best < e_rtn * (1 - 1e-4)).mean() > 0.5


@pytest.mark.parametrize("bits", [7, 8])
def test_channel_quantization_is_symmetric_per_row_and_its_search_never_loses(bits):
    w = _weights(n=40, k=300)
    w[5] = 0.0
    (q0, s0), (q, s) = quantize_channels(w, bits, search=False), quantize_channels(w, bits)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    assert q.dtype == np.int8 and q.shape == w.shape and s.shape == (40,)
    assert q.min() >= lo and q.max() <= hi and q0.min() >= lo and q0.max() <= hi
    assert (q[5] == 0).all() and s0[5] == 0
    assert (np.abs(q0.astype(np.int16)).max(axis=1)[np.arange(40) != 5] == -lo).all()  # the extreme maps to lo
    e0 = ((q0 * s0[:, None] - w) ** 2).sum(1)
    e = ((q * s[:, None] - w) ** 2).sum(1)
    assert (e <= e0 * (1 + 1e-5) + 1e-9).all()
    assert np.sqrt(e.sum() / (w * w).sum()) < (0.01 if bits == 8 else 0.02)


def _pair_sums_saturating(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What an AVX2 / AVX-512BW uint8 x int8 kernel computes (vpmaddubsw: two adjacent products added into a
    saturating int16, then vpmaddwd widens the pairs to int32): x uint8 [M, K], w int8 [K, N], K even."""
    p = x.astype(np.int64)[:, :, None] * w.astype(np.int64)[None]  # [M, K, N]
    pairs = np.clip(p[:, 0::2] + p[:, 1::2], -32768, 32767)
    return pairs.sum(axis=1)


def test_integer_gemm_full_range_is_8_bit_on_both_sides_and_says_its_pair_bound():
    from specedge.export.quant import WeightFormat
    from specedge.runtime.cpu import INT16_MAX

    for act_bits in (8, 16):
        f = WeightFormat("int8", form="intgemm", intgemm_activation_bits=act_bits, intgemm_full_range=True)
        assert (f.intgemm_weight_bits, f.intgemm_activation_levels, f.intgemm_pair_bound) == (8, 127, 65280)
        assert f.intgemm_pair_bound > INT16_MAX  # what the runtime refuses on CPUs without VNNI
    with pytest.raises(UnsupportedModelError, match="--intgemm-full-range needs --quant-form intgemm"):
        WeightFormat("int8", intgemm_full_range=True)


@pytest.mark.parametrize("act_bits", [8, 16])
def test_integer_gemm_ranges_cannot_saturate_a_pair_sum(act_bits):
    """Full-range uint8 activations times full-range int8 weights saturate the int16 pair sums of x86 kernels
    without VNNI (CI and users run on such CPUs): those rows would differ from exact sums, and differently in the
    GEMV (one row) kernel. At the ranges the form exports — 8-bit activations with 7-bit weights, or 7-bit
    activation parts with 8-bit weights — the worst cases are exact."""
    from specedge.export.quant import WeightFormat
    from specedge.runtime.cpu import INT16_MAX

    k = 64
    x = np.full((2, k), 255, np.uint8)
    x[1, 1::2] = 0
    full = np.full((k, 3), 127, np.int8)
    full[:, 1] = -128
    assert not np.array_equal(_pair_sums_saturating(x, full), x.astype(np.int64) @ full.astype(np.int64))
    fmt = WeightFormat("int8", form="intgemm", intgemm_activation_bits=act_bits)
    a_max = 2 * fmt.intgemm_activation_levels + 1  # stored uint8: 1..a_max
    w_lo, w_hi = -(1 << (fmt.intgemm_weight_bits - 1)), (1 << (fmt.intgemm_weight_bits - 1)) - 1
    assert fmt.intgemm_pair_bound == 2 * a_max * -w_lo <= INT16_MAX
    x = np.full((2, k), a_max, np.uint8)
    x[1, 1::2] = 1
    for extreme in (w_lo, w_hi):
        w = np.full((k, 3), extreme, np.int8)
        w[1::2, 2] = w_lo if extreme > 0 else w_hi
        np.testing.assert_array_equal(_pair_sums_saturating(x, w), x.astype(np.int64) @ w.astype(np.int64))


@pytest.mark.parametrize("act_bits,full", [(8, False), (16, False), (8, True)])
def test_onnxruntime_integer_gemm_is_exact_and_row_invariant_on_this_cpu(act_bits, full):
    """What --quant-form intgemm rests on: MatMulInteger (uint8 activations over the stored range with the form's
    zero point, int8 weights over the range exported next to them, the extremes included) returns the exact
    integer sums, for every number of rows, on whatever kernel this CPU gets (VNNI, AVX2's saturating pairs, Arm
    dot products). Full ranges only where the runtime would load such a bundle."""
    from specedge.export.quant import WeightFormat
    from specedge.runtime.cpu import int16_pair_saturation

    if full and int16_pair_saturation() is not False:
        pytest.skip("full-range integer GEMM is refused on this CPU (no VNNI: int16 pair sums) or flags unknown")
    fmt = WeightFormat("int8", form="intgemm", intgemm_activation_bits=act_bits, intgemm_full_range=full)
    zp, w_lo = fmt.intgemm_activation_levels + 1, -(1 << (fmt.intgemm_weight_bits - 1))
    rng = np.random.default_rng(0)
    k, n = 1536, 96
    w = rng.integers(w_lo, -w_lo, (k, n)).astype(np.int8)
    w[:8] = w_lo  # the worst case for a pair of products
    x = rng.integers(1, 2 * zp, (10, k)).astype(np.uint8)
    x[0] = 2 * zp - 1
    x[1] = 1
    g = helper.make_graph([helper.make_node("MatMulInteger", ["x", "w", "zp"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.UINT8, ["T", k])],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, ["T", n])],
                          [helper.make_tensor("w", TensorProto.INT8, [k, n], w.tobytes(), raw=True),
                           helper.make_tensor("zp", TensorProto.UINT8, [], [zp])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ref = (x.astype(np.int64) - zp) @ w.astype(np.int64)
    for t in range(1, 11):
        np.testing.assert_array_equal(sess.run(None, {"x": x[:t]})[0], ref[:t])


def test_scale_search_keeps_positive_scales_and_zero_blocks():
    w = _weights(n=16, k=96)
    w[3, 32:64] = 0.0
    p = quantize(w, QuantSpec(4, 32, positive_scales=True))
    assert (p.scales >= 0).all() and p.scales[3, 1] == 0
    assert (dequantize(p)[3, 32:64] == 0).all()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q5_0])
def test_gguf_blocks_repack_bit_exactly(qtype):
    w = _weights(k=96)
    raw = gguf_quantize(w, qtype)  # uint8 [N, row bytes]
    p = repack_gguf(qtype.name, raw, 96)
    np.testing.assert_array_equal(dequantize(p), gguf_dequantize(raw, qtype).reshape(w.shape))


# where each carried type keeps its fp16 fields (d, and m / dmin), by byte within its block
GGUF_FP16_FIELDS = {"Q5_1": (0, 2), "Q5_K": (0, 2), "Q3_K": (108,), "Q2_K": (80, 82), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_gguf_rows(rng, type_name: str, n: int, blocks: int) -> np.ndarray:
    """Random valid GGUF rows (any bits are valid levels, scales and indices; the fp16 fields finite, one of
    them a subnormal and one a negative zero)."""
    from specedge.export.quant import GGUF_REPACKABLE

    _, nbytes, _ = GGUF_REPACKABLE[type_name]
    raw = rng.integers(0, 256, size=(n, blocks, nbytes), dtype=np.uint8)
    for at in GGUF_FP16_FIELDS[type_name]:
        raw[..., at:at + 2] = np.frombuffer(rng.uniform(-0.02, 0.02, n * blocks).astype(np.float16).tobytes(),
                                            np.uint8).reshape(n, blocks, 2)
    at = GGUF_FP16_FIELDS[type_name][0]
    raw[0, 0, at:at + 2] = np.frombuffer(np.float16(-3e-6).tobytes(), np.uint8)
    raw[-1, -1, at:at + 2] = np.frombuffer(np.float16(-0.0).tobytes(), np.uint8)
    return raw.reshape(n, blocks * nbytes)


@pytest.mark.parametrize("type_name", sorted(GGUF_FP16_FIELDS))
def test_more_gguf_types_round_trip_bit_exactly(type_name):
    """Q5_1, Q5_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS: the carried levels, scales and offsets dequantize to gguf-py's
    own values bit for bit (random blocks: gguf-py cannot quantize most of these, only read them)."""
    raw = random_gguf_rows(np.random.default_rng(5), type_name, 6, 3)
    p = repack_gguf(type_name, raw)
    ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(6, -1)
    assert p.bits == 8 and p.k == ref.shape[1] and (p.offsets is not None) == (type_name in ("Q5_1", "Q5_K", "Q2_K"))
    np.testing.assert_array_equal(dequantize(p), ref)
    assert (p.superblocks is not None) == type_name.endswith("_K")


def test_other_gguf_types_are_not_repacked():
    with pytest.raises(UnsupportedModelError, match="no exact MatMulNBits form"):
        repack_gguf("IQ3_S", np.zeros((2, 110), np.uint8), 256)


def _matmulnbits(x: np.ndarray, p, accuracy_level: int) -> np.ndarray:
    inits = [helper.make_tensor("B", TensorProto.UINT8, p.b.shape, p.b.tobytes(), raw=True),
             helper.make_tensor("S", TensorProto.FLOAT, p.scales.shape, p.scales.tobytes(), raw=True)]
    ins = ["A", "B", "S"]
    if p.zero_points is not None:
        inits.append(helper.make_tensor("Z", TensorProto.UINT8, p.zero_points.shape, p.zero_points.tobytes(), raw=True))
        ins.append("Z")
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=p.k, N=p.n, bits=p.bits,
                            block_size=p.block, accuracy_level=accuracy_level)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, (x.shape[0], p.n))], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"A": x})[0]


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
def test_onnxruntime_matmulnbits_computes_our_dequantized_matmul(bits, symmetric):
    w = _weights()
    p = concat_rows([quantize(w[:10], QuantSpec(bits, 32, symmetric)),
                     quantize(w[10:], QuantSpec(bits, 32, symmetric))])
    x = np.random.default_rng(1).standard_normal((3, w.shape[1])).astype(np.float32)
    ref = x @ dequantize(p).T
    np.testing.assert_allclose(_matmulnbits(x, p, accuracy_level=0), ref, rtol=1e-4, atol=1e-4)
    # accuracy_level 4 quantizes the activations to int8 per block: close, not exact
    fast = _matmulnbits(x, p, accuracy_level=4)
    assert np.abs(fast - ref).max() < 0.05 * np.abs(ref).max()


def test_bad_specs_are_refused():
    for kw in ({"bits": 3}, {"bits": 4, "block": 24}, {"bits": 4, "accuracy_level": 7}):
        with pytest.raises(UnsupportedModelError):
            QuantSpec(**kw)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K"])
def test_q4_1_and_q4_k_blocks_are_carried_exactly(type_name):
    """Symmetric int4 (zero point 8) + a per-32-block float offset reproduces gguf's own dequantization of
    Q4_1 and Q4_K (random valid blocks: gguf-py cannot quantize Q4_K, only read it)."""
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    from specedge.export.quant import GGUF_REPACKABLE, dequantize, repack_gguf

    block, nbytes, _ = GGUF_REPACKABLE[type_name]
    rng = np.random.default_rng(0)
    n, kb = 8, 3
    raw = rng.integers(0, 256, size=(n, kb, nbytes), dtype=np.uint8)
    for a in (0, 2):  # d and m (Q4_1) / d and dmin (Q4_K): finite fp16
        raw[..., a:a + 2] = np.frombuffer(rng.uniform(-0.02, 0.02, n * kb).astype(np.float16).tobytes(),
                                          np.uint8).reshape(n, kb, 2)
    raw = raw.reshape(n, kb * nbytes)
    ref = gguf_dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(n, kb * block)
    packed = repack_gguf(type_name, raw)
    assert packed.offsets is not None and packed.block == 32 and packed.zero_points is None
    np.testing.assert_allclose(dequantize(packed), ref, rtol=0, atol=1e-6 * np.abs(ref).max())


def test_q6_k_blocks_are_carried_exactly_as_int8():
    import gguf
    from gguf.quants import dequantize as gguf_dequantize

    from specedge.export.quant import dequantize, repack_gguf

    rng = np.random.default_rng(1)
    n, kb = 4, 2
    raw = rng.integers(0, 256, size=(n, kb, 210), dtype=np.uint8)
    raw[..., 208:210] = np.frombuffer(rng.uniform(-0.02, 0.02, n * kb).astype(np.float16).tobytes(),
                                      np.uint8).reshape(n, kb, 2)
    raw = raw.reshape(n, -1)
    p = repack_gguf("Q6_K", raw)
    assert (p.bits, p.block, p.offsets) == (8, 16, None)
    np.testing.assert_array_equal(dequantize(p), gguf_dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(n, -1))


@pytest.mark.parametrize("act_bits,bound", [(8, 0.04), (16, 0.02)])
def test_intgemm_linear_scales_every_row_by_its_own_scale(tmp_path, act_bits, bound):
    """The emitted integer-GEMM linear, run by ONNX Runtime at full optimization, against x @ w.T: rows of very
    different magnitudes each keep their own activation scale (ONNX Runtime's MatMulIntegerToFloat fusion
    would apply one scale to every row if the graph let it match)."""
    import onnx

    from specedge.export.graph import ExternalWeights, _Graph, _Linears
    from specedge.export.quant import WeightFormat

    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    g, ext = _Graph(), ExternalWeights(tmp_path / "m.onnx.data")
    fmt = WeightFormat("int8", form="intgemm", intgemm_activation_bits=act_bits)
    y = _Linears(g, ext, None, fmt)("x", "m", [], spec=QuantSpec(8), weights=w)
    bias = rng.standard_normal(48).astype(np.float32)
    y = g.op("Add", y, ext.add("m.bias", bias))  # as Qwen's q|k|v: the fusion takes a constant bias in too
    ext.close()
    graph = helper.make_graph(g.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 64])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)], ext.initializers + g.consts)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    assert {n.op_type for n in graph.node} >= {"MatMulInteger", "ReduceMax"}
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, 5, 64)).astype(np.float32) * np.array([1e-3, 1.0, 100.0, 0.0, 1.0], np.float32)[:, None]
    x[0, 4, 7] = 60.0  # an activation outlier: with 8 bits the rest of its row rounds to a few levels
    got, ref = sess.run(None, {"x": x})[0][0] - bias, x[0] @ w.T
    for row in (0, 1, 2):
        assert np.abs(got[row] - ref[row]).max() < bound * np.abs(ref[row]).max(), row
    assert np.abs(got[3]).max() < 1e-6  # an all-zero row: no division by zero
    # the outlier row: the residual row keeps its small values (16 bits); 8 bits lose them. Against the quantized
    # weights, so that only the activations' rounding is measured (60 x a weight's rounding would hide it)
    q, s = quantize_channels(w, fmt.intgemm_weight_bits)
    small = x[0, 4].copy()
    small[7] = 0.0
    err = np.abs(got[4] - x[0, 4] @ (q * s[:, None]).T).max() / np.abs(small @ w.T).max()
    assert (err < 0.05) if act_bits == 16 else (err > 0.05), err
