"""Every family against references no one here wrote: a tiny random model from transformers' own config class, and
its GGUF made by llama.cpp's own converter; both exported and run against transformers' fp32 logits."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from specedge.export.graph import build_model_graph
from specedge.export.loaders import load_source

from ..conftest import make_hf_model
from ..llama_cpp import convert_hf_to_gguf, requantize_gguf

torch = pytest.importorskip("torch")  # the reference side: not in the fast tier's venv

FAMILIES = ("qwen3", "granite", "smollm3", "llama3", "gemma3", "gemma2", "phi3")
S_MAX = 96
N_POS = 64


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, dict]:
    """Per family: its HF folder, the same weights through llama.cpp's converter (f32), and transformers' logits
    over 64 positions of one random sequence."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, fam in enumerate(FAMILIES):
        # 4 layers: smollm3's 4th attends without RoPE, gemma2's 2nd and 4th are global; 6: gemma3's 6th is
        hf = make_hf_model(root / fam, fam, layers=6 if fam == "gemma3" else 4, seed=10 + i,
                           tie=fam in ("llama3", "granite", "gemma3", "gemma2"))
        gg = convert_hf_to_gguf(hf, root / f"{fam}.gguf")
        from transformers import AutoModelForCausalLM

        # eager attention: the soft-capped scores (gemma2) are the eager path's
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
        ids = torch.randint(3, 320, (1, N_POS), generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            logits = ref(ids).logits[0].numpy()
        out[fam] = {"hf": hf, "gguf": gg, "ids": ids[0].numpy(), "logits": logits}
    return out


def _rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def _logits(path, src, ids: np.ndarray, split: int, inplace: bool = False) -> np.ndarray:
    """Logits of every position, fed as ``ids[:split]`` then the rest on top of the cache (split 0: one step).
    Portable graphs return the new rows, copied into the cache here; an ort-inplace graph's present buffers are the
    next step's past."""
    d = src.config.dims
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    kv = {f"past_key_values.{i}.{k}": np.zeros((1, d.n_kv_heads, S_MAX, d.head_dim), np.float32)
          for i in range(d.n_layers) for k in ("key", "value")}
    rows = []
    for at, chunk in ((0, ids[:split]), (split, ids[split:])):
        if not len(chunk):
            continue
        n = len(chunk)
        out = sess.run(None, {"input_ids": chunk[None].astype(np.int64), "past_len": np.array([at]),
                              "logits_at": np.arange(n)[None], **kv})
        rows.append(out[0][0])
        for i in range(d.n_layers):
            for j, k in enumerate(("key", "value")):
                name = f"past_key_values.{i}.{k}"
                if inplace:
                    kv[name] = out[1 + 2 * i + j]
                else:
                    kv[name][:, :, at:at + n] = out[1 + 2 * i + j][:, :, :n]
    return np.concatenate(rows)


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_exported_from_its_folder_and_from_llama_cpp_s_gguf_matches_transformers(
        family_models, family, source, tmp_path):
    m = family_models[family]
    src = load_source(m[source])
    assert src.config.family.name == ("llama" if family == "llama3" else family)
    path, _, _ = build_model_graph(src, tmp_path, "m", max_positions=S_MAX)
    for split in (0, 24):  # all 64 from position 0; 24 as a prefix in the cache, then 40 on top of it
        got = _logits(path, src, m["ids"], split)
        assert _rel_rms(got, m["logits"]) < 1e-4, (family, source, split)


def test_each_family_s_quirks_are_read_from_both_sources(family_models):
    for source in ("hf", "gguf"):
        c = {f: load_source(family_models[f][source]).config for f in FAMILIES}
        assert c["qwen3"].family.qk_norm and c["qwen3"].dims.head_dim == 32
        g = c["granite"]
        got = (g.embedding_scale, g.residual_scale, g.attention_scale, g.logit_scale)
        assert got == pytest.approx((3.0, 0.4, 0.09, 2.5), rel=1e-6)  # GGUF holds them as float32
        assert c["smollm3"].rope_layers == (True, True, True, False)
        gm = c["gemma3"]
        assert gm.local_layers == (True,) * 5 + (False,) and gm.sliding_window == 128
        assert (gm.local_rope_theta, gm.rope_theta) == (10000.0, 1e6) and gm.embedding_scale == pytest.approx(8.0)
        g2 = c["gemma2"]
        assert g2.local_layers == (True, False, True, False) and g2.sliding_window == 128 and not g2.family.qk_norm
        assert (g2.attn_softcap, g2.final_softcap) == (1.5, 2.0) and g2.local_rope_theta == g2.rope_theta
        p3 = c["phi3"]
        assert p3.rotary_dim == 16 and p3.rope_scaling["rope_type"] == "longrope" and p3.rope_mscale() > 1.0
        assert p3.rope_scaling["original_max_position_embeddings"] == 32 and p3.inv_freq(None, 96).shape == (8,)
        assert not np.array_equal(p3.inv_freq(None, 96), p3.inv_freq(None, 32))  # long factors past 32
        assert all(x.plain_layers() for x in (c["llama3"],)) and c["llama3"].tie_embeddings
    assert load_source(family_models["llama3"]["gguf"]).rope_freq_factors is not None  # llama3 RoPE, as ggml has it
    assert load_source(family_models["llama3"]["hf"]).config.rope_scaling["rope_type"] == "llama3"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_in_place_attention_takes_each_family_s_layers(family_models, family, tmp_path):
    """ONNX Runtime's GroupQueryAttention with the cache bound in place: rotary tables from the graph (identity
    ones for smollm3's layers without RoPE) and the family's own score scale."""
    m = family_models[family]
    src = load_source(m["hf"])
    path, _, _ = build_model_graph(src, tmp_path, "m", kv_mode="ort-inplace", max_positions=S_MAX)
    for split in (0, 24):
        assert _rel_rms(_logits(path, src, m["ids"], split, inplace=True), m["logits"]) < 1e-4, (family, split)


@pytest.fixture(scope="module")
def family_drafts(tmp_path_factory) -> dict[str, object]:
    """A draft model of each family: one layer, half the width, other weights."""
    root = tmp_path_factory.mktemp("family-drafts")
    return {f: make_hf_model(root / f, f, layers=1, hidden=32, seed=40 + i, tie=f in ("llama3", "granite", "gemma3"))
            for i, f in enumerate(FAMILIES)}


def _gguf_blocks(name: str):
    """The block types of the families' GGUFs: as a Q4_K_M file of a model whose rows are not whole 256-value
    super-blocks holds them (Gemma 3 270M: Q5_0 for most matrices), with Q4_0, Q4_1, Q5_1 and IQ4_NL beside."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if name in ("token_embd.weight", "output.weight"):  # Gemma 3 270M's token_embd (its tied head) is Q8_0
        return Q.Q8_0
    return (Q.Q4_1 if "ffn_down" in name else Q.Q5_0 if any(p in name for p in ("attn_q.", "attn_k.", "ffn_gate"))
            else Q.Q5_1 if "attn_output" in name else Q.IQ4_NL if "attn_v" in name else Q.Q4_0)


def _opts(**kw):
    from specedge.export.bundle import ExportOptions

    return ExportOptions(k=4, max_context=128, prefill_chunk=16, verify_widths=(2, 3), **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_s_gguf_blocks_are_carried_and_compute_as_its_fp32_export(family_models, family, tmp_path):
    """llama.cpp's GGUF with its linears in Q4_0/Q4_1/Q5_0/Q5_1/IQ4_NL blocks (the head Q8_0 where untied): every
    matrix carried as the file holds it, nothing re-quantized; fp32 compute (accuracy level 0, fp32 head and
    embedding) gives the logits of the same GGUF exported fp32, as for the llama family (test_quantized_bundle)."""
    from specedge.export.bundle import export_bundle
    from specedge.export.quant import WeightFormat
    from specedge.runtime import SpecDecoder

    m = family_models[family]
    gg = requantize_gguf(m["gguf"], tmp_path / "q4.gguf", _gguf_blocks)
    n_layers = load_source(gg).config.dims.n_layers
    fp32 = SpecDecoder.load(export_bundle(gg, "prompt-lookup", tmp_path / "f", _opts()).out)
    q = SpecDecoder.load(export_bundle(gg, "prompt-lookup", tmp_path / "q", _opts(
        weights=WeightFormat("int4", accuracy_level=0, lm_head="fp32", embedding="fp32"))).out)
    info = q.manifest.target.quant  # (the head fp32 here: from the float embedding or output rows)
    assert info["repacked_from_gguf"] == 7 * n_layers and info["requantized"] == 0, info
    ids = np.array(m["ids"][:5])
    a = np.array(fp32.target.step(ids, 0, all_logits=True)[:5])
    b = np.array(q.target.step(ids, 0, all_logits=True)[:5])
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


PROMPTS = ["def fib(n):", "hello world hello world hello", "the cat sat on the"]


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_default_cpu_form_decodes_each_family_speculatively_bitwise_plain(
        family_models, family_drafts, family, source, tmp_path):
    """The CPU profile's form (specedge's int4 kernels, row-addressed steps, fp16 KV): greedy and seeded sampling
    equal plain decoding token for token with prompt lookup, a draft model of the same family and auto."""
    from specedge.export.bundle import export_bundle
    from specedge.export.quant import WeightFormat
    from specedge.runtime import SamplingParams, SpecDecoder

    m = family_models[family]
    target = requantize_gguf(m["gguf"], tmp_path / "q4.gguf", _gguf_blocks) if source == "gguf" else m["hf"]
    # the CPU profile's head from a GGUF: the file's own blocks (export/profiles.py head_from_file), a tied one's too
    head = "gguf" if source == "gguf" else "auto"
    out = export_bundle(target, family_drafts[family], tmp_path / "b", _opts(
        weights=WeightFormat("int4", form="specedge", lm_head=head),
        draft_weights=WeightFormat("int4", form="specedge"), kv_mode="rows", kv_dtype="float16")).out
    dec = SpecDecoder.load(out)
    assert dec.manifest.target.quant["format"] == "SekMatMul"
    if source == "gguf":  # every block carried, the head's (a tied one: the embedding's Q8_0 blocks) too
        q = dec.manifest.target.quant
        assert q["requantized"] == 0 and q["lm_head_gguf_type"] == "Q8_0", q
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.9, seed=5)
    for prompt in PROMPTS:
        for params in (greedy, sampled):
            plain = dec.generate(prompt, params, drafter="none").token_ids
            assert len(plain) == 24
            for drafter, k in (("prompt-lookup", 4), ("model", 1), ("model", 4), ("auto", 4)):
                res = dec.generate(prompt, params, drafter=drafter, k=k)
                assert res.token_ids == plain, (family, source, prompt, drafter, k, params.temperature)
                assert drafter != "model" or res.stats.drafted > 0


def test_a_gguf_type_without_an_exact_form_is_named_where_it_is_re_quantized(family_models, tmp_path):
    import gguf

    from specedge.export.bundle import export_bundle
    from specedge.export.quant import WeightFormat
    from specedge.runtime import SpecDecoder

    Q = gguf.GGMLQuantizationType
    gg = requantize_gguf(family_models["llama3"]["gguf"], tmp_path / "mxfp4.gguf",
                         lambda n: Q.MXFP4 if "ffn_up" in n else _gguf_blocks(n))
    q = SpecDecoder.load(export_bundle(gg, "prompt-lookup", tmp_path / "b", _opts(
        weights=WeightFormat("int4", form="specedge"))).out).manifest.target.quant
    assert q["requantized_gguf_types"] == ["MXFP4"] and q["requantized"] >= 4  # ffn_up of 4 layers


def test_a_partial_rotary_onnx_runtime_s_attention_cannot_take_is_refused_with_the_way_out(family_drafts, tmp_path):
    """The one-layer phi3 draft rotates 8 of its 16 dims: GroupQueryAttention's tables must be a multiple of 8 wide,
    so its ort-inplace fp32 export is refused, naming the forms that take it."""
    from specedge.export.bundle import export_bundle
    from specedge.runtime.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="rotates 8 of each head's 16 dims.*specedge form"):
        export_bundle(family_drafts["phi3"], "prompt-lookup", tmp_path / "b", _opts(kv_mode="ort-inplace"))
