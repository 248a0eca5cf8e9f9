"""--device-argmax: graphs also output next_ids = ArgMax(logits). Greedy rounds then take ids, not logits, from
the runner; the ids are the logits' own argmax (first index of the maximum), so the text is the same token for
token as without it, and speculative still equals plain."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.runtime import SamplingParams, SpecDecoder

PROMPTS = ["def fib(n):", "hello world hello world hello", "the cat sat on the"]


@pytest.fixture(scope="module")
def pair(tiny_llama, tiny_draft, tmp_path_factory):
    root = tmp_path_factory.mktemp("argmax")
    opts = dict(k=4, max_context=128, prefill_chunk=16, verify_widths=(2, 3))
    return (export_bundle(tiny_llama, tiny_draft, root / "ids", ExportOptions(device_argmax=True, **opts)).out,
            export_bundle(tiny_llama, tiny_draft, root / "plain", ExportOptions(**opts)).out)


def test_graph_outputs_next_ids_and_the_manifest_says_so(pair):
    with_ids, without = pair
    m = onnx.load(str(with_ids / "target.onnx"), load_external_data=False)
    out = {o.name: o.type.tensor_type.elem_type for o in m.graph.output}
    assert out["next_ids"] == onnx.TensorProto.INT64
    assert SpecDecoder.load(with_ids).manifest.device_argmax
    assert not SpecDecoder.load(without).manifest.device_argmax


def test_ids_are_the_argmax_of_the_same_rows(pair):
    dec = SpecDecoder.load(pair[0])
    t = dec.target
    assert t.has_argmax
    ids = dec.encode_prompt(" ".join(PROMPTS * 3))
    assert len(ids) >= 16
    t.step(np.array(ids[:8]), 0, all_logits=False)
    for n in (1, 2, 3, 5):  # every verify width, and the last-row-only prefill width
        logits = np.array(t.step(np.array(ids[8:8 + n]), 8, all_logits=True))
        got = np.array(t.step(np.array(ids[8:8 + n]), 8, all_logits=True, ids_only=True))
        np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    last = np.array(t.step(np.array(ids[:10]), 0, all_logits=False))
    assert np.array(t.step(np.array(ids[:10]), 0, all_logits=False, ids_only=True)).tolist() == [int(np.argmax(last))]


def test_a_graph_without_next_ids_refuses_ids_only(pair):
    dec = SpecDecoder.load(pair[1])
    assert not dec.target.has_argmax
    with pytest.raises(ValueError, match="--device-argmax"):
        dec.target.step(np.array([1, 2]), 0, all_logits=True, ids_only=True)


def test_greedy_text_is_the_same_with_and_without_device_ids(pair):
    with_ids, without = SpecDecoder.load(pair[0]), SpecDecoder.load(pair[1])
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for prompt in PROMPTS:
        plain = without.generate(prompt, params, drafter="none").token_ids
        assert with_ids.generate(prompt, params, drafter="none").token_ids == plain
        for drafter in ("model", "prompt-lookup", "auto"):
            for k in (1, 2, 4):
                assert with_ids.generate(prompt, params, drafter=drafter, k=k).token_ids == plain, (prompt, drafter, k)
    sampled = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8, seed=5)  # logits path, unchanged
    assert with_ids.generate(PROMPTS[1], sampled, drafter="model", k=3).token_ids == \
        without.generate(PROMPTS[1], sampled, drafter="model", k=3).token_ids


def test_fp16_graphs_keep_next_ids(pair, tmp_path):
    from specedge.export.engines import build_onnx

    b = tmp_path / "b"
    shutil.copytree(pair[0], b)
    es = build_onnx(b, "fp16", head="low")
    m = onnx.load(str(b / es.graphs["target"]), load_external_data=False)
    out = {o.name: o.type.tensor_type.elem_type for o in m.graph.output}
    assert out["next_ids"] == onnx.TensorProto.INT64 and out["logits"] == onnx.TensorProto.FLOAT
    dec = SpecDecoder.load(b, precision="fp16")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = dec.generate(PROMPTS[0], params, drafter="none").token_ids
    assert dec.generate(PROMPTS[0], params, drafter="model", k=3).token_ids == plain


def test_greedy_rounds_on_next_ids_compute_no_confidence(pair, monkeypatch):
    """With next_ids a greedy round has no logits on the host: auto goes without its target-confidence prior
    (its carried acceptance instead), and the text is the same."""
    from specedge.runtime.adaptive import AutoDrafter

    seen: list[float] = []
    monkeypatch.setattr(AutoDrafter, "observe_confidence", lambda self, confs: seen.extend(confs))
    dec = SpecDecoder.load(pair[0])
    dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True), drafter="auto")
    assert not seen
    dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8), drafter="auto")
    assert seen  # sampled rounds bring their logits
