"""Sliding-window attention in the static graph: a mask over the fixed KV buffer. Gemma 3's local layers and Mistral
with a window shorter than S_max export and match transformers past the window, in every attention form, and the
CPU form decodes them speculatively bitwise plain."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.export.graph import build_model_graph
from specedge.export.loaders import load_source

from ..conftest import make_hf_model
from ..llama_cpp import convert_hf_to_gguf
from .test_families import _logits as _family_logits
from .test_families import _rel_rms

torch = pytest.importorskip("torch")  # the reference side: not in the fast tier's venv

WINDOW, S_MAX, N_POS = 16, 128, 64


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> dict[str, dict]:
    """Gemma 3 (five local layers with a window of 16, then a global one), Mistral (every layer windowed) and Qwen2
    with use_sliding_window (its layers from max_window_layers = 1 on), each with transformers' logits over 64
    positions with the window and, to show it matters, without."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("windowed")
    out = {}
    for i, fam in enumerate(("gemma3", "mistral", "qwen2")):
        qwen = {"use_sliding_window": True, "max_window_layers": 1} if fam == "qwen2" else {}
        hf = make_hf_model(root / fam, fam, layers=6 if fam == "gemma3" else 2, seed=50 + i, tie=fam == "gemma3",
                           sliding_window=WINDOW, **qwen)
        ids = torch.randint(3, 320, (1, N_POS), generator=torch.Generator().manual_seed(i))
        logits = {}
        for w in (WINDOW, 4096):
            ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, sliding_window=w).eval()
            with torch.no_grad():
                logits[w] = ref(ids).logits[0].numpy()
        out[fam] = {"hf": hf, "ids": ids[0].numpy(), "logits": logits[WINDOW], "full": logits[4096]}
        if fam == "gemma3":  # llama.cpp's converter writes gemma3's window; for Mistral it writes none (full)
            out[fam]["gguf"] = convert_hf_to_gguf(hf, root / f"{fam}.gguf")
    return out


CASES = [("gemma3", "hf"), ("gemma3", "gguf"), ("mistral", "hf"), ("qwen2", "hf")]
LAYER_WINDOWS = {"gemma3": [WINDOW] * 5 + [0], "mistral": [WINDOW] * 2, "qwen2": [0, WINDOW]}


@pytest.mark.parametrize("kv_mode", ["portable", "ort-inplace"])
@pytest.mark.parametrize("family,source", CASES)
def test_a_window_shorter_than_the_context_matches_transformers_past_it(windowed, family, source, kv_mode, tmp_path,
                                                                        monkeypatch):
    m = windowed[family]
    src = load_source(m[source])
    assert src.config.sliding_window == WINDOW and src.config.window(0, WINDOW) == 0  # a window over every position
    assert [src.config.window(i, S_MAX) for i in range(src.config.dims.n_layers)] == LAYER_WINDOWS[family]
    assert _rel_rms(m["full"][WINDOW:], m["logits"][WINDOW:]) > 0.05  # the window changes the logits past it
    monkeypatch.setattr("tests.export.test_families.S_MAX", S_MAX)
    path, _, _ = build_model_graph(src, tmp_path, "m", kv_mode=kv_mode, max_positions=S_MAX)
    for split in (0, 24, 40):  # one step; a prefix of 24 or 40 in the cache, then the rest on top of it
        got = _family_logits(path, src, m["ids"], split, inplace=kv_mode == "ort-inplace")
        assert _rel_rms(got, m["logits"]) < 1e-4, (family, source, kv_mode, split)


def _cpu_form(src_path, out):
    from specedge.export.bundle import ExportOptions, export_bundle
    from specedge.export.quant import WeightFormat
    from specedge.runtime import SpecDecoder

    return SpecDecoder.load(export_bundle(src_path, "prompt-lookup", out, ExportOptions(
        k=4, max_context=S_MAX, prefill_chunk=16, verify_widths=(2, 3), kv_mode="rows", kv_dtype="float16",
        weights=WeightFormat("int4", form="specedge"))).out)


def _step_logits(dec, ids: np.ndarray) -> np.ndarray:
    """The target's logits at every position, in steps of up to K + 1 = 5 rows (a step's widest with all logits)."""
    rows = [np.array(dec.target.step(np.array(ids[at:at + 5]), at, all_logits=True)[: len(ids[at:at + 5])])
            for at in range(0, len(ids), 5)]
    return np.concatenate(rows)


@pytest.mark.parametrize("family,source", CASES)
def test_the_cpu_form_applies_the_window_and_decodes_speculatively_bitwise_plain(windowed, family, source,
                                                                                 tmp_path, monkeypatch):
    """The default CPU form (specedge's int4 kernels, SekRowAttention with the window, fp16 KV) at S_max 128: its
    logits equal, bit for bit, those of the same bundle built without the window up to the window's length and part
    from them past it, towards transformers' windowed logits; greedy and seeded speculation with prompt lookup and
    auto equal plain decoding over more tokens than the window holds."""
    from specedge.export.families import ModelConfig
    from specedge.runtime import SamplingParams

    m = windowed[family]
    dec = _cpu_form(m[source], tmp_path / "b")
    got = _step_logits(dec, m["ids"])
    with monkeypatch.context() as mp:
        mp.setattr(ModelConfig, "window", lambda self, layer, max_positions=None: 0)
        full = _step_logits(_cpu_form(m[source], tmp_path / "full"), m["ids"])
    assert np.array_equal(got[:WINDOW], full[:WINDOW])  # nothing lies before the window yet
    assert (np.abs(got[WINDOW:] - full[WINDOW:]).max(axis=-1) > 1e-3).all()
    assert _rel_rms(got[WINDOW:], m["logits"][WINDOW:]) < _rel_rms(got[WINDOW:], m["full"][WINDOW:])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.9, seed=3)
    for prompt in ("def fib(n):", "hello world hello world hello"):
        plain = dec.generate(prompt, params, drafter="none").token_ids
        seeded = dec.generate(prompt, sampled, drafter="none").token_ids
        for drafter in ("prompt-lookup", "auto"):
            assert dec.generate(prompt, params, drafter=drafter, k=4).token_ids == plain, (prompt, drafter)
            assert dec.generate(prompt, sampled, drafter=drafter, k=4).token_ids == seeded, (prompt, drafter)
