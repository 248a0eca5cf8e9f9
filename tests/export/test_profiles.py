"""`spec-export export --for PROFILE`: with no form flags a GGUF becomes the fastest exact CPU form; other sources keep
their float weights; a CPU profile refuses the KV mode that is not bitwise exact; options given win."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as Q

from specedge.export.cli import main as export_cli
from specedge.export.profiles import default_verify_widths, kernels_buildable, load_profile, settle
from specedge.runtime.errors import OptionError
from specedge.runtime.manifest import BATCH_WIDTHS

from .test_gguf import write_tiny_gguf

CLICK_DEFAULTS = dict(k=4, verify_widths=None, weights="fp32", quant_form="auto", lm_head="auto", kv_mode="ort-inplace",
                      max_context=2048, prefill_chunk=64)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_tiny_gguf(tiny_llama, path, {q: Q.Q4_0 for q in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                            "ffn_up", "ffn_down")} | {"output": Q.Q8_0})
    return path


def _export(args, tmp_path, name="b"):
    r = CliRunner().invoke(export_cli, ["export", *args, "--max-context", "128", "--prefill-chunk", "16",
                                        "--out", str(tmp_path / name)])
    manifest = json.loads((tmp_path / name / "manifest.json").read_text()) if r.exit_code == 0 else None
    return r, manifest


def test_default_widths_are_the_odd_ones_below_k_plus_one():
    assert default_verify_widths(8) == (3, 5, 7)
    assert default_verify_widths(4) == (3,)
    assert default_verify_widths(2) == ()
    assert default_verify_widths(9) == (3, 5, 7, 9)


def test_a_gguf_with_no_form_flags_is_the_fast_exact_cpu_form(tiny_gguf, tmp_path):
    if kernels_buildable() is not None:
        pytest.skip(f"specedge's kernels cannot be built here: {kernels_buildable()}")
    r, m = _export(["--target", str(tiny_gguf)], tmp_path)
    assert r.exit_code == 0, r.output
    t = m["target"]
    assert (t["precision"], m["kv_mode"], m["k"]) == ("int4", "rows", 8)  # row-addressed: requests batch
    assert m["kv_dtype"] == "float16"  # specedge's attention: half the cache, rows rounded once as written
    assert t["quant"]["format"].startswith("SekMatMul") and t["quant"]["lm_head"] == "gguf"
    assert t["quant"]["requantized"] == 0  # every matrix is the file's own blocks, the head included
    verify = sorted(w["T"] for w in t["widths"] if w["role"] == "verify")
    # every width from 2 rows to 9: a chain of k tokens runs in k + 1 rows, and R users' plain rows in R rows (a
    # padding row costs what a real one does)
    assert verify[:8] == list(range(2, 10))
    assert set(verify[8:]) <= set(BATCH_WIDTHS)  # and the row budgets of rounds of several requests
    assert "form (--for cpu): int4 specedge, lm_head gguf, kv rows float16, K=8" in r.output


def test_without_a_compiler_the_default_is_matmulnbits_and_says_how_to_get_the_fast_form(tiny_gguf, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    r, m = _export(["--target", str(tiny_gguf)], tmp_path)
    assert r.exit_code == 0, r.output
    assert m["target"]["quant"].get("format", "MatMulNBits") == "MatMulNBits"
    assert m["kv_dtype"] == "float32"  # ONNX Runtime's attention: the fp32 cache
    assert "install a C compiler" in r.output and "specedge's kernels" in r.output
    verify = sorted(w["T"] for w in m["target"]["widths"] if w["role"] == "verify")
    assert verify == [2, 4, 6, 8, 10]  # MatMulNBits: every width rounded up to an even one


def test_a_float_source_keeps_its_weights_unless_quantizing_is_asked_for(tiny_llama, tmp_path):
    r, m = _export(["--target", str(tiny_llama)], tmp_path)
    assert r.exit_code == 0, r.output
    assert m["target"]["precision"] == "fp32" and "is not a GGUF" in r.output
    r, m = _export(["--target", str(tiny_llama), "--weights", "int8", "--quant-form", "matmulnbits"], tmp_path, "q")
    assert r.exit_code == 0, r.output
    assert m["target"]["precision"] == "int8" and "is not a GGUF" not in r.output


def test_a_cpu_profile_refuses_the_portable_kv_mode_and_names_the_exact_one(tiny_gguf, tmp_path):
    r, _ = _export(["--target", str(tiny_gguf), "--kv-mode", "portable"], tmp_path)
    assert r.exit_code == 2 and "not bitwise exact on a CPU" in r.output and "--kv-mode ort-inplace" in r.output
    assert not (tmp_path / "b").exists()


def test_an_fp32_cache_is_kept_when_asked_and_fp16_is_refused_where_specedges_attention_does_not_run(tiny_gguf,
                                                                                                    tmp_path):
    if kernels_buildable() is not None:
        pytest.skip(f"specedge's kernels cannot be built here: {kernels_buildable()}")
    r, m = _export(["--target", str(tiny_gguf), "--kv-dtype", "fp32"], tmp_path)
    assert r.exit_code == 0, r.output
    assert m["kv_dtype"] == "float32" and "kv rows float32" in r.output
    r, _ = _export(["--target", str(tiny_gguf), "--kv-dtype", "fp16", "--quant-form", "matmulnbits"], tmp_path, "c")
    assert r.exit_code != 0 and "--kv-dtype fp16 is read by specedge's attention" in r.output
    assert "this export is int4 matmulnbits, kv ort-inplace: choose --kv-dtype fp32" in r.output
    assert not (tmp_path / "c").exists()


def test_a_gpu_profile_takes_its_own_form_and_given_options_win(tiny_gguf, tmp_path):
    r, m = _export(["--target", str(tiny_gguf), "--for", "jetson-orin-nano-8gb", "--k", "6"], tmp_path)
    assert r.exit_code == 0, r.output
    assert m["kv_mode"] == "portable" and m["k"] == 6 and m["device_argmax"] and m["kv_dtype"] == "float32"
    assert m["target"]["quant"]["format"] == "DequantizeLinear+MatMul"


def test_settle_applies_the_profile_only_where_nothing_was_given(tiny_gguf, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")  # the form does not depend on this machine's compiler below
    prof = load_profile("cpu")
    said = []
    v = settle(CLICK_DEFAULTS, {"k"}, prof, tiny_gguf, said.append)
    assert v["k"] == 4 and v["verify_widths"] == (3,) and v["weights"] == "int4"
    v = settle({**CLICK_DEFAULTS, "verify_widths": ()}, {"verify_widths", "quant_form"}, prof, tiny_gguf,
               said.append)
    assert v["verify_widths"] == () and v["quant_form"] == "matmulnbits"  # no compiler: ONNX Runtime's kernel
    assert any("install a C compiler" in s for s in said)


def test_an_unknown_profile_lists_the_presets():
    with pytest.raises(OptionError, match="cpu"):
        load_profile("no-such-board")


def test_a_config_preset_alone_is_its_own_profile(tiny_gguf, tmp_path):
    """--config jetson-orin-nano-8gb without --for: the preset's portable KV mode is its TensorRT form, not refused by
    the default cpu profile; a --config file that names models only keeps the cpu profile."""
    r, m = _export(["--target", str(tiny_gguf), "--draft", "prompt-lookup", "--config", "jetson-orin-nano-8gb"],
                   tmp_path)
    assert r.exit_code == 0, r.output
    assert m["kv_mode"] == "portable" and "form (--for jetson-orin-nano-8gb)" in r.output
    models_only = tmp_path / "models.toml"
    models_only.write_text(f'[export]\ntarget = "{tiny_gguf}"\n')
    r, m = _export(["--config", str(models_only), "--weights", "int8", "--quant-form", "matmulnbits"], tmp_path, "c")
    assert r.exit_code == 0, r.output
    assert m["kv_mode"] == "ort-inplace" and m["k"] == 8 and "form (--for cpu)" in r.output


def test_an_explicit_lm_head_auto_is_the_default_one(tiny_gguf, tmp_path):
    r, m = _export(["--target", str(tiny_gguf), "--lm-head", "auto", "--quant-form", "matmulnbits"], tmp_path)
    assert r.exit_code == 0, r.output
    assert m["target"]["quant"]["lm_head"] == "gguf"


def test_without_max_context_the_cpu_form_takes_the_models_own_context_and_says_so(tiny_gguf, tmp_path):
    if kernels_buildable() is not None:
        pytest.skip(f"specedge's kernels cannot be built here: {kernels_buildable()}")
    r = CliRunner().invoke(export_cli, ["export", "--target", str(tiny_gguf), "--prefill-chunk", "16", "--out",
                                        str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["max_context"] == 512  # the tiny model's own (its GGUF's context_length): this machine holds it
    assert ("context: S_max 512 (the model's own; KV 0.00 GiB a sequence, 4 sequences by default); --max-context "
            "sets another") in r.output
