"""Reduced-precision graphs, TensorRT build inputs, engine records and validation — all without a GPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto

from specedge.export.engines import build_onnx, build_trt, trt_profiles
from specedge.export.precision import convert_graph, from_bf16_bits, to_bf16_bits
from specedge.export.validate import ValidateOptions, validate
from specedge.runtime import BundleError, SamplingParams, SpecDecoder
from specedge.runtime.backends import trt_ep_options
from specedge.runtime.backends.trt import compat_problems, io_problems
from specedge.runtime.bundle_files import file_entry
from specedge.runtime.errors import BackendUnavailableError, UnsupportedModelError
from specedge.runtime.manifest import EngineSet, io_spec, read_manifest

FP32_OPS = {"Pow", "ReduceMean", "Sqrt", "Div", "Softmax", "Cos", "Sin"}


@pytest.fixture(scope="module")
def fp16_bundle(bundles, tmp_path_factory) -> Path:
    """A copy of the tiny 'model' bundle (target + draft) with its fp16 ONNX graphs built."""
    out = tmp_path_factory.mktemp("fp16") / "b"
    shutil.copytree(bundles["model"], out)
    build_onnx(out, "fp16")
    return out


def _types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    g = inferred.graph
    out = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.input, *g.output, *g.value_info]}
    out.update({t.name: t.data_type for t in g.initializer})
    return out


@pytest.mark.parametrize("precision, low", [("fp16", TensorProto.FLOAT16), ("bf16", TensorProto.BFLOAT16)])
@pytest.mark.parametrize("head", ["fp32", "low"])
def test_conversion_keeps_fp32_where_accuracy_needs_it(bundles, tmp_path, precision, low, head):
    src = bundles["model"] / "target.onnx"
    rep = convert_graph(src, tmp_path / "t.onnx", precision, head=head)
    m = onnx.load(str(tmp_path / "t.onnx"), load_external_data=False)
    types = _types(m)  # strict ONNX type inference passes: every node sees the types it declares
    io = {vi.name: vi.type.tensor_type.elem_type for vi in [*m.graph.input, *m.graph.output]}
    assert io["logits"] == TensorProto.FLOAT and io["input_ids"] == TensorProto.INT64
    assert all(t == low for n, t in io.items() if n.startswith(("past_key_values.", "present.")))
    for node in m.graph.node:
        floats = [types[i] for i in node.input if i and types.get(i) in (TensorProto.FLOAT, low)]
        if node.op_type in FP32_OPS:
            assert set(floats) == {TensorProto.FLOAT}, node.name
    mm = [n for n in m.graph.node if n.op_type in ("MatMul", "Gemm")]
    head_node = mm[-1]  # the lm_head is the last matmul
    assert {types[i] for i in head_node.input[:2]} == {TensorProto.FLOAT if head == "fp32" else low}
    assert all(types[n.input[0]] == low and types[n.input[1]] == low for n in mm[:-1])
    assert rep.low_nodes > rep.fp32_nodes > 0 and rep.casts_added > 0


def test_fp16_graph_runs_on_onnx_runtime_close_to_fp32(fp16_bundle):
    import onnxruntime as ort

    m = read_manifest(fp16_bundle)
    d = m.target.dims
    rng = np.random.default_rng(0)
    T, past = 9, 20
    feed = {"input_ids": rng.integers(0, d.vocab, (1, T)), "past_len": np.array([past]),
            "logits_at": np.arange(T)[None]}
    for i in range(d.n_layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = rng.normal(0, 1, (1, d.n_kv_heads, m.max_context, d.head_dim)) \
                .astype(np.float32)
    ref = ort.InferenceSession(str(fp16_bundle / "target.onnx")).run(None, feed)
    es = m.engine_set("onnx", "fp16")
    half = {k: v.astype(np.float16) if k.startswith("past_key_values.") else v for k, v in feed.items()}
    got = ort.InferenceSession(str(fp16_bundle / es.graphs["target"])).run(None, half)
    assert got[0].dtype == np.float32 and got[1].dtype == np.float16
    np.testing.assert_allclose(got[0], ref[0], atol=0.05, rtol=0.02)  # logits of magnitude ~3
    for r, g in zip(ref[1:], got[1:]):
        np.testing.assert_allclose(g.astype(np.float32), r, atol=0.02, rtol=0.01)


def test_bf16_bits_match_torch():
    import torch

    x = np.random.default_rng(1).normal(0, 10, 10_000).astype(np.float32)
    x[:4] = [0.0, -0.0, np.inf, 1e-40]
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_bf16_bits(x), want)
    np.testing.assert_allclose(from_bf16_bits(want)[4:], x[4:], rtol=2 ** -8)  # normal numbers: 8 bits
    assert np.isnan(from_bf16_bits(to_bf16_bits(np.array([np.nan], np.float32))))[0]


def test_conversion_refuses_onnx_runtime_only_graphs(tiny_llama, tmp_path):
    from specedge.export.bundle import ExportOptions, export_bundle
    from specedge.export.quant import WeightFormat

    b = export_bundle(tiny_llama, "prompt-lookup", tmp_path / "q",
                      ExportOptions(k=2, max_context=64, prefill_chunk=8, weights=WeightFormat("int8"))).out
    with pytest.raises(UnsupportedModelError, match="--quant-form qdq"):
        convert_graph(b / "target.onnx", tmp_path / "x.onnx", "fp16")
    with pytest.raises(BundleError, match="portable KV mode"):
        validate(b)
    ig = export_bundle(tiny_llama, "prompt-lookup", tmp_path / "ig",  # standard ops, but MatMulInteger: not TensorRT's
                       ExportOptions(k=2, max_context=64, prefill_chunk=8,
                                     weights=WeightFormat("int8", form="intgemm"))).out
    with pytest.raises(UnsupportedModelError, match=r"MatMulInteger.*--quant-form qdq"):
        convert_graph(ig / "target.onnx", tmp_path / "y.onnx", "fp16")
    with pytest.raises(BundleError, match="portable KV mode"):
        validate(ig)


def test_engine_sets_in_the_manifest(fp16_bundle):
    m = read_manifest(fp16_bundle)  # sha256 of the new files checked
    es = m.engine_set("onnx")
    assert es.kind == "onnx" and es.kv_dtype == "float16" and set(es.graphs) == {"target", "draft"}
    assert es.sources["target"] == m.files["target.onnx"]["sha256"]
    assert {"target.fp16.onnx", "target.fp16.onnx.data", "draft.fp16.onnx"} <= set(m.files)
    with pytest.raises(BundleError, match="no trt engines.*spec-export build .* --backend trt"):
        m.engine_set("trt")
    with pytest.raises(BundleError, match="no onnx bf16"):
        m.engine_set("onnx", "bf16")
    assert build_onnx(fp16_bundle, "fp16").graphs == es.graphs  # up to date: reused, not rebuilt
    with pytest.raises(BundleError, match="must record the TensorRT version"):
        EngineSet("trt", "fp16", "float16", {}, {})


def test_profiles_follow_the_manifest(bundles):
    m = read_manifest(bundles["model"])
    for role, e in m.models.items():
        profiles = trt_profiles(m, role)
        assert len(profiles) == len(e.widths)
        for w, p in zip(e.widths, profiles):
            assert p["input_ids"] == (1, w.T) and p["logits_at"] == (1, w.L) and p["past_len"] == (1,)
            kv = [v for k, v in p.items() if k.startswith("past_key_values.")]
            assert len(kv) == 2 * e.dims.n_layers
            assert set(kv) == {(1, e.dims.n_kv_heads, m.max_context, e.dims.head_dim)}
    opts = trt_ep_options(bundles["model"], m, "target")
    widths = m.target.widths
    # ONE profile spanning the widths (the EP keeps its context on profile 0): min, opt = K+1, max
    lo, opt, hi = (dict(e.split(":") for e in opts[f"trt_profile_{k}_shapes"].split(","))
                   for k in ("min", "opt", "max"))
    assert len(lo) == len(opt) == len(hi) == 3 + 2 * m.target.dims.n_layers  # each input named once
    assert lo["input_ids"] == "1x1" and lo["logits_at"] == "1x1"
    assert opt["input_ids"] == opt["logits_at"] == f"1x{m.k + 1}"
    assert hi["input_ids"] == f"1x{max(w.T for w in widths)}" and hi["logits_at"] == f"1x{m.k + 1}"
    assert lo["past_key_values.0.key"] == hi["past_key_values.0.key"]  # S_max fixed
    assert opts["trt_engine_cache_path"].startswith(str(bundles["model"]))


def _trt_set(**kw) -> EngineSet:
    base = dict(kind="trt", precision="fp16", kv_dtype="float16", graphs={"target": "trt/target.engine"},
                sources={"target": "x"}, tensorrt="10.3.0.30", gpu={"name": "Orin", "compute_capability": "8.7"})
    return EngineSet(**{**base, **kw})


def test_engine_compatibility():
    es = _trt_set()
    assert compat_problems(es, "10.3.0.26", "8.7", "Orin (nvgpu)") == []  # build number may differ
    p = compat_problems(es, "10.7.0", "9.0", "NVIDIA H100")
    assert len(p) == 2 and "TensorRT 10.3.0.30" in p[0] and "10.7.0" in p[0]
    assert "compute capability 8.7 (Orin)" in p[1] and "NVIDIA H100 with compute capability 9.0" in p[1]


def test_engine_io_checked_against_the_manifest(bundles):
    m = read_manifest(bundles["model"])
    e = m.target
    ins, outs = io_spec(e.dims, "portable", "float16")
    tensors = {s.name: {"mode": "input", "dtype": s.dtype, "shape": []} for s in ins}
    tensors |= {s.name: {"mode": "output", "dtype": s.dtype, "shape": []} for s in outs}
    profiles = [{k: [list(v)] * 3 for k, v in p.items()} for p in trt_profiles(m, "target")]
    good = {"tensors": tensors, "profiles": profiles}
    assert io_problems(good, e.dims, e.widths, m.max_context, "float16") == []
    assert "float32" in io_problems(good, e.dims, e.widths, m.max_context, "float32")[0]
    assert "S_max 512" in " ".join(io_problems(good, e.dims, e.widths, 512, "float16"))
    fewer = {"tensors": tensors, "profiles": profiles[:-1]}
    assert "optimization profiles" in io_problems(fewer, e.dims, e.widths, m.max_context, "float16")[0]
    missing = {"tensors": {k: v for k, v in tensors.items() if k != "logits"}, "profiles": profiles}
    assert "missing from the engine: logits" in io_problems(missing, e.dims, e.widths, m.max_context, "float16")[0]


def test_trt_without_tensorrt_fails_with_one_clear_line(fp16_bundle):
    pytest.importorskip("onnxruntime")
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed here")
    with pytest.raises(BackendUnavailableError, match="TensorRT is not installed"):
        build_trt(fp16_bundle)
    from specedge.export.cli import main

    r = CliRunner().invoke(main, ["build", str(fp16_bundle), "--backend", "trt"])
    assert r.exit_code == 2
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: TensorRT is not installed"), r.output
    with pytest.raises(BackendUnavailableError, match="backend 'trt' is not available"):
        SpecDecoder.load(fp16_bundle, backend="trt")


def test_fp16_speculative_greedy_equals_fp16_plain(fp16_bundle):
    """Exactness holds within a precision: fp16 graphs, speculative vs plain."""
    from tests.runtime.test_decoder import PROMPTS, greedy_mismatch

    dec = SpecDecoder.load(fp16_bundle, precision="fp16")
    assert dec.target.kv.dtype == np.float16
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ties = 0
    for prompt in PROMPTS:
        plain = dec.generate(prompt, params, drafter="none").token_ids
        for drafter in ("model", "prompt-lookup", "auto"):
            ties += greedy_mismatch(dec, prompt, dec.generate(prompt, params, drafter=drafter, k=4).token_ids, plain)
    assert ties <= 1
    dec.close()


def test_validate_passes_and_goldens_round_trip(fp16_bundle, tmp_path):
    goldens = tmp_path / "g.npz"
    prompts = ("def fib(n):", "The quick brown fox", "import numpy as np\nx = np.arange(10)\n")
    rep = validate(fp16_bundle, ValidateOptions(tokens=12, prompts=prompts, chat=False, save_goldens=goldens,
                                                min_agreement=0.9))
    assert rep["passed"], json.dumps(rep, indent=1)[:3000]
    names = {(c["role"], c["case"]) for c in rep["cases"]}
    assert names == {("target", "prefill"), ("target", "verify"), ("target", "decode"), ("draft", "prefill"),
                     ("draft", "decode")}
    assert all(c["past_len"] > 0 for c in rep["cases"])  # every recorded input runs over a filled cache
    assert all(c["logits"]["max_absdiff"] > 0 for c in rep["cases"])  # fp16 really differs from fp32 ...
    assert all(c["logits"]["max_absdiff"] < 0.1 for c in rep["cases"])  # ... by little
    assert rep["greedy"]["target"]["tokens"] == 12 * 3
    z = np.load(goldens)
    meta = json.loads(bytes(z["meta"]).decode())
    pre = next(j for j, c in enumerate(meta["cases"]) if c["name"] == "prefill" and c["role"] == "target")
    assert meta["cases"][pre]["n"] < meta["cases"][pre]["T"]  # a padded chunk ...
    assert z[f"c{pre}/out/present.0.key"].shape[2] == meta["cases"][pre]["n"]  # ... compared on its real rows only
    again = validate(fp16_bundle, ValidateOptions(tokens=12, goldens=goldens, chat=False, min_agreement=0.9))
    assert again["passed"] and again["prompts"] == rep["prompts"]
    for a, b in zip(rep["cases"], again["cases"]):
        assert a["logits"]["max_absdiff"] == pytest.approx(b["logits"]["max_absdiff"])


def test_validate_fails_on_a_corrupted_graph(fp16_bundle, tmp_path):
    from specedge.export.cli import main

    bad = tmp_path / "bad"
    shutil.copytree(fp16_bundle, bad)
    m = onnx.load(str(bad / "target.fp16.onnx"), load_external_data=False)
    w = next(t for t in m.graph.initializer if t.name.startswith("layers.0.attn.o") and t.data_location == 1)
    meta = {e.key: e.value for e in w.external_data}
    data = np.memmap(bad / meta["location"], dtype=np.float16, mode="r+", offset=int(meta["offset"]),
                     shape=(int(meta["length"]) // 2,))
    data[:] = -data * 3  # a wrong sign and scale in one projection: the kind of bug a converter makes
    data.flush()
    del data
    # recorded as the exporter wrote it (a converter's bug is in the bundle before its files are hashed)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["files"][meta["location"]] = file_entry(bad / meta["location"])
    (bad / "manifest.json").write_text(json.dumps(manifest))
    report = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["validate", str(bad), "--tokens", "8", "--report", str(report)])
    assert r.exit_code == 1, r.output
    rep = json.loads(report.read_text())
    assert not rep["passed"] and "FAILED" in r.output
    target_cases = [c for c in rep["cases"] if c["role"] == "target"]
    assert not any(c["logits"]["passed"] for c in target_cases)
    assert all(c["passed"] for c in rep["cases"] if c["role"] == "draft")  # the draft graph is untouched


def test_goldens_from_another_bundle_are_refused(fp16_bundle, bundles, tmp_path):
    goldens = tmp_path / "g.npz"
    validate(fp16_bundle, ValidateOptions(tokens=2, prompts=("hi",), save_goldens=goldens, min_agreement=0))
    other = tmp_path / "other"
    shutil.copytree(bundles["self"], other)
    build_onnx(other, "fp16")
    with pytest.raises(BundleError, match="recorded from other graphs"):
        validate(other, ValidateOptions(goldens=goldens))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(BundleError, match="not a specedge goldens file"):
        validate(fp16_bundle, ValidateOptions(goldens=tmp_path / "junk.npz"))


def test_a_deleted_engine_file_is_rebuilt_not_refused(fp16_bundle, tmp_path):
    """A derived graph removed by hand: loading refuses the bundle (the file is listed), and `build` recreates
    it instead of refusing to start."""
    import shutil

    b = tmp_path / "b"
    shutil.copytree(fp16_bundle, b)
    es = read_manifest(b, verify="size").engine_set("onnx", "fp16")
    (b / es.graphs["target"]).unlink()
    with pytest.raises(BundleError, match="missing"):
        read_manifest(b, verify="size")
    build_onnx(b, "fp16")
    read_manifest(b, verify="sha256")  # whole again, hashes recorded
