"""Standard-ONNX int4/int8 graphs (``--quant-form qdq``): blocked DequantizeLinear feeding MatMul, the form
TensorRT 10 parses as weight-only INT4 and ONNX Runtime fuses back into MatMulNBits. The weights stay exactly
the GGUF's; ONNX Runtime really fuses them (no per-step dequantization); speculation stays exact; TensorRT's
parser rules (read from onnx-tensorrt's DequantizeLinear importer) hold for every int4 node."""

from __future__ import annotations

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from specedge.export.bundle import export_bundle
from specedge.export.engines import trt_parser_problems
from specedge.export.quant import Packed, QuantSpec, WeightFormat, positive_scales, quantize, repack_gguf
from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.errors import UnsupportedModelError

from .test_gguf import write_tiny_gguf
from .test_quantized_bundle import PROMPTS, _logits, _opts

Q = gguf.GGMLQuantizationType
MIXED = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q8_0,
         "ffn_down": Q.Q4_1, "attn_output": Q.Q4_0}


def _dequant64(p: Packed) -> np.ndarray:
    """float64 reference of what the packed weights mean (no fp32 rounding to hide a wrong sign or level)."""
    from specedge.export.quant import _unpack_nibbles

    u = (_unpack_nibbles(p.b) if p.bits == 4 else p.b).astype(np.float64)
    w = (u - (1 << (p.bits - 1))) * p.scales.astype(np.float64)[..., None]
    if p.offsets is not None:
        w = w + p.offsets.astype(np.float64)[..., None]
    return w.reshape(p.n, -1)[:, : p.k]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_positive_scales_keeps_gguf_weights_exact(qtype):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    w[3, :32] = 0.0  # an all-zero block: scale 0
    raw = gguf.quants.quantize(w, qtype)
    p = repack_gguf(qtype.name, raw)
    assert (p.scales < 0).any() or qtype != Q.Q4_0  # Q4_0's rule gives negative scales: the case that matters
    pos = positive_scales(p)
    assert (pos.scales > 0).all()
    np.testing.assert_array_equal(_dequant64(pos), _dequant64(p))
    np.testing.assert_array_equal(_dequant64(p).astype(np.float32), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("bits", [4, 8])
def test_positive_scale_quantizer(bits):
    w = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    plain, pos = quantize(w, QuantSpec(bits, 32)), quantize(w, QuantSpec(bits, 32, positive_scales=True))
    assert (plain.scales < 0).any() and (pos.scales > 0).all()
    err = lambda p: np.abs(_dequant64(p) - w).max() / np.abs(w).max()  # noqa: E731
    assert err(pos) < 1.3 * err(plain)  # one level fewer for positive extremes: a little coarser, no worse


def test_qdq_refuses_asymmetric():
    with pytest.raises(UnsupportedModelError, match="symmetric"):
        WeightFormat("int4", symmetric=False, form="qdq")
    with pytest.raises(UnsupportedModelError, match="choose one of"):
        WeightFormat("int4", form="int4-awq")


@pytest.fixture(scope="module")
def mixed(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("qdq")
    gg = root / "mixed.gguf"
    write_tiny_gguf(tiny_llama, gg, MIXED)
    exact = dict(accuracy_level=0, lm_head="fp32", embedding="fp32")
    return {"gguf": gg,
            "fp32": export_bundle(gg, "prompt-lookup", root / "f", _opts("fp32")).out,
            "nbits": export_bundle(gg, "prompt-lookup", root / "n", _opts("int4", **exact)).out,
            "qdq": export_bundle(gg, "prompt-lookup", root / "q", _opts("int4", form="qdq", **exact)).out,
            "qdq-fast": export_bundle(gg, "prompt-lookup", root / "q4", _opts("int4", form="qdq")).out}


def test_qdq_graph_is_standard_onnx_and_carries_gguf_blocks_exactly(mixed):
    m = onnx.load(str(mixed["qdq"] / "target.onnx"), load_external_data=False)
    ops = {n.op_type for n in m.graph.node}
    assert "DequantizeLinear" in ops and "MatMulNBits" not in ops
    assert {o.domain for o in m.opset_import} == {""} and m.opset_import[0].version == 21
    int4 = [t for t in m.graph.initializer if t.data_type == onnx.TensorProto.INT4]
    assert int4, "4-bit blocks must be stored as ONNX INT4"
    dec, ref = SpecDecoder.load(mixed["qdq"]), SpecDecoder.load(mixed["fp32"])
    assert dec.manifest.target.quant["format"] == "DequantizeLinear+MatMul"
    assert dec.manifest.target.quant["repacked_from_gguf"] == 2 * 7
    ids = ref.encode_prompt(PROMPTS[1])
    np.testing.assert_allclose(_logits(dec, ids), _logits(ref, ids), rtol=1e-4, atol=1e-4)


def test_onnx_runtime_fuses_qdq_into_matmulnbits_bitwise(mixed, tmp_path):
    """The fusion is what makes one graph serve both: without it every step would dequantize every matrix."""
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(mixed["qdq-fast"] / "target.onnx"), so, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "opt.onnx"), load_external_data=False).graph.node]
    assert "DequantizeLinear" not in ops and ops.count("MatMulNBits") >= 2 * 5
    # the fused graph computes what a MatMulNBits bundle of the same (positive-scale) weights computes
    nb = SpecDecoder.load(mixed["nbits"])
    q = SpecDecoder.load(mixed["qdq"])
    ids = nb.encode_prompt(PROMPTS[0])
    np.testing.assert_allclose(_logits(q, ids), _logits(nb, ids), rtol=1e-5, atol=1e-5)


def test_qdq_speculation_is_bitwise_plain(mixed):
    dec = SpecDecoder.load(mixed["qdq-fast"])
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    for prompt in PROMPTS:
        plain = dec.generate(prompt, params, drafter="none").token_ids
        for k in (1, 3, 4):
            assert dec.generate(prompt, params, drafter="prompt-lookup", k=k).token_ids == plain


def test_tensorrt_parser_rules(mixed, tmp_path):
    m = onnx.load(str(mixed["qdq"] / "target.onnx"), load_external_data=True)
    problems = trt_parser_problems(m)
    # every int4 node passes; the int8 blocks (Q8_0 carried exactly) are named: TensorRT blocks only INT4
    assert problems and all("INT8" in p and "block" in p for p in problems), problems
    dq = next(n for n in m.graph.node if n.op_type == "DequantizeLinear"
              and next(t for t in m.graph.initializer if t.name == n.input[0]).data_type == onnx.TensorProto.INT4)
    scale = next(t for t in m.graph.initializer if t.name == dq.input[1])
    arr = onnx.numpy_helper.to_array(scale).copy()
    arr.flat[0] = -arr.flat[0]
    scale.CopyFrom(onnx.numpy_helper.from_array(arr, scale.name))
    assert any("scale" in p and "> 0" in p and dq.name in p for p in trt_parser_problems(m))


def test_fp16_graph_of_a_qdq_bundle_keeps_int4_blocks_and_runs(mixed, tmp_path):
    """The TensorRT input: ``build --backend onnx`` turns the qdq graph into fp16 keeping every INT4
    DequantizeLinear (weight-only INT4 for TensorRT), dequantizing the 8-bit blocks TensorRT cannot take into
    fp16 constants; it runs on ONNX Runtime CPU close to the fp32 bundle and passes the parser rules."""
    import shutil

    from specedge.export.engines import build_onnx

    b = tmp_path / "b"
    shutil.copytree(mixed["qdq-fast"], b)
    build_onnx(b, "fp16")
    dec = SpecDecoder.load(b, precision="fp16")
    graph = b / dec.manifest.engine_set("onnx", "fp16").graphs["target"]
    m = onnx.load(str(graph), load_external_data=True)
    dqs = [n for n in m.graph.node if n.op_type == "DequantizeLinear"]
    assert dqs and trt_parser_problems(m) == []
    assert ({next(t for t in m.graph.initializer if t.name == n.input[0]).data_type for n in dqs}
            == {onnx.TensorProto.INT4})
    ref = SpecDecoder.load(mixed["fp32"])
    ids = ref.encode_prompt(PROMPTS[1])
    a, b16 = _logits(ref, ids), _logits(dec, ids)
    assert np.isfinite(b16).all() and np.abs(a - b16).max() / np.abs(a).max() < 0.1
    plain = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True), drafter="none").token_ids
    assert dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True), drafter="prompt-lookup",
                        k=3).token_ids == plain


def test_manifest_records_the_qdq_opset(mixed):
    assert SpecDecoder.load(mixed["qdq"]).manifest.opset == 21
    assert SpecDecoder.load(mixed["nbits"]).manifest.opset == 17
