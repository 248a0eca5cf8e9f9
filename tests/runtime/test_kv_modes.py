"""The ort-inplace KV mode (GroupQueryAttention, cache written in place) computes what the portable
mode computes, and speculation on it stays exact."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.drafters import feed
from specedge.runtime.errors import BundleError, UnsupportedModelError

from .test_decoder import greedy_mismatch

PROMPTS = ["def fib(n):", "The quick brown fox", "import numpy as np\nx = np.arange(10)\n"]


@pytest.fixture(scope="module")
def mode_decoders(tiny_qwen, tmp_path_factory):
    from ..conftest import make_hf_model

    root = tmp_path_factory.mktemp("kv")
    draft = make_hf_model(root / "draft", "llama", layers=1, hidden=64, seed=3)  # head_dim 16: GQA's minimum
    out = {}
    for mode in ("portable", "ort-inplace"):
        opts = ExportOptions(k=4, max_context=96, prefill_chunk=16, verify_widths=(3,), kv_mode=mode)
        out[mode] = SpecDecoder.load(export_bundle(tiny_qwen, draft, root / mode, opts).out)
    return out


def test_inplace_logits_match_portable(mode_decoders):
    port, inpl = mode_decoders["portable"], mode_decoders["ort-inplace"]
    assert inpl.manifest.kv_mode == "ort-inplace" and inpl.target.pads_into_cache
    ids = np.array(port.encode_prompt(PROMPTS[2]))  # > one prefill chunk: chunked prefill with a cache
    n = len(ids)
    assert n > 16
    for dec in (port, inpl):
        dec._last = [feed(dec.target, ids[: n - 4], 0, 16).copy()]
        dec._last.append(np.array(dec.target.step(ids[n - 4: n - 1], n - 4, all_logits=True)))  # verify width 3
        dec._last.append(np.array(dec.target.step(ids[n - 1: n], n - 1, all_logits=True)))  # decode width 1
        dec._last.append(np.array(dec.target.step(ids[n - 3: n - 1], n - 3, all_logits=True)))  # rollback + rewrite
    for a, b in zip(port._last, inpl._last):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_inplace_generation_equals_portable_and_speculation_is_exact(mode_decoders):
    port, inpl = mode_decoders["portable"], mode_decoders["ort-inplace"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    near_ties = 0
    for prompt in PROMPTS:
        plain = inpl.generate(prompt, params, drafter="none").token_ids
        near_ties += greedy_mismatch(port, prompt, plain, port.generate(prompt, params, drafter="none").token_ids)
        for drafter in ("model", "prompt-lookup"):
            for k in (1, 2, 4):
                near_ties += greedy_mismatch(inpl, prompt,
                                             inpl.generate(prompt, params, drafter=drafter, k=k).token_ids, plain)
    assert near_ties <= 1


def test_inplace_runs_to_the_end_of_the_cache(mode_decoders):
    dec = mode_decoders["ort-inplace"]
    prompt = next(p for r in range(12, 0, -1) if len(dec.encode_prompt(p := "hello world " * r)) <= 60)
    n = len(dec.encode_prompt(prompt))
    max_new = 96 - n - 5  # exactly fills S_max = prompt + max_new + K+1
    assert max_new > 2
    res = dec.generate(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True), drafter="prompt-lookup")
    assert len(res.token_ids) == max_new


def test_a_manifest_whose_context_outgrows_the_graphs_position_tables_is_refused_at_load(mode_decoders, tmp_path):
    """An in-place graph's RoPE tables hold S_max positions (its metadata says how many): a manifest edited to a
    larger max_context was refused only once a request passed the tables, by the attention op, mid-generation."""
    import json
    import shutil

    src = mode_decoders["ort-inplace"].bundle_dir
    dst = tmp_path / "b"
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["max_context"] = 192
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=r"holds positions up to 96, and the manifest's max_context is S_max=192"):
        SpecDecoder.load(dst, verify="none")


def test_unsupported_kv_mode_requests_are_refused(tiny_draft, tmp_path):
    with pytest.raises(BundleError, match="kv-mode"):
        ExportOptions(kv_mode="paged")
    with pytest.raises(UnsupportedModelError, match="head_dim 8"):  # tiny_draft: 32 hidden / 4 heads
        export_bundle(tiny_draft, "prompt-lookup", tmp_path / "b", ExportOptions(kv_mode="ort-inplace"))


@pytest.mark.parametrize("mode", ["portable", "ort-inplace"])
def test_last_token_logits_at_every_width(mode_decoders, mode):
    """step(..., all_logits=False) returns the *last* token's logits whatever width runs it — also a verify
    width, which computes logits for every row (a prefill remainder of 2..K+1 tokens lands there)."""
    dec = mode_decoders[mode]
    ids = dec.encode_prompt(PROMPTS[2])
    r = dec.target
    for n in range(1, 8):
        full = np.array(r.step(ids[:n], 0, all_logits=True)) if n <= 5 else None
        last = np.array(r.step(ids[:n], 0, all_logits=False))
        assert last.shape == (1, dec.manifest.target.dims.vocab)
        for i in range(n):  # one token at a time: the decode width, no question which row is the last
            ref = np.array(r.step(ids[i:i + 1], i, all_logits=False))[0]
        np.testing.assert_allclose(last[0], ref, rtol=1e-4, atol=1e-4, err_msg=f"n={n}")
        if full is not None:
            np.testing.assert_allclose(full[-1], ref, rtol=1e-4, atol=1e-4)


def test_a_portable_bundle_on_a_cpu_says_it_is_exact_only_up_to_near_ties(mode_decoders):
    import warnings

    from specedge.runtime import SpecDecoder

    for mode, warns in (("portable", True), ("ort-inplace", False)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            SpecDecoder.load(mode_decoders[mode].bundle_dir, backend="ort-cpu").close()
        said = [str(w.message) for w in seen if "portable-KV bundle on a CPU" in str(w.message)]
        assert bool(said) == warns, (mode, said)
        if warns:
            assert "--for cpu" in said[0]
