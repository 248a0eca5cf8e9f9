"""Bundle export, manifest round trip, and refusal of bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.export.cli import main as export_cli
from specedge.runtime.errors import BundleError, SpecEdgeError, UnsupportedModelError, VocabularyMismatchError
from specedge.runtime.manifest import MANIFEST_NAME, Manifest, read_manifest

from ..conftest import make_hf_model


def test_manifest_round_trips(bundles):
    m = read_manifest(bundles["model"])
    again = Manifest.from_json(json.loads(json.dumps(m.to_json())))
    assert again == m
    assert m.drafter == "model" and m.draft is not None
    assert [w.T for w in m.target.widths] == [1, 2, 9, 16]  # decode, verify 2 (plain rounds) and K+1, prefill P
    assert [w.T for w in m.draft.widths] == [1, 2, 4, 8, 16]  # decode, the catch-up widths below P, prefill P
    assert all(w.L == 1 for w in m.draft.widths)
    assert set(m.files) == {"target.onnx", "target.onnx.data", "draft.onnx", "draft.onnx.data", "tokenizer.json"}


def test_info_cli_prints_the_bundle(bundles):
    r = CliRunner().invoke(export_cli, ["info", str(bundles["lookup"])])
    assert r.exit_code == 0, r.output
    assert "verify width 9" in r.output and "prompt-lookup" in r.output and "all files match" in r.output


@pytest.fixture()
def bundle_copy(bundles, tmp_path):
    dst = tmp_path / "b"
    shutil.copytree(bundles["lookup"], dst)
    return dst


def test_corrupt_file_fails_sha256(bundle_copy):
    data = bundle_copy / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match="sha256"):
        read_manifest(bundle_copy)


def test_missing_and_truncated_files_are_refused(bundle_copy):
    with open(bundle_copy / "tokenizer.json", "ab") as f:
        f.write(b" ")
    with pytest.raises(BundleError, match="bytes"):
        read_manifest(bundle_copy, verify="size")
    (bundle_copy / "target.onnx").unlink()
    with pytest.raises(BundleError, match="missing target.onnx"):
        read_manifest(bundle_copy)
    (bundle_copy / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        read_manifest(bundle_copy)


@pytest.mark.parametrize("kw, msg", [
    ({"k": 0}, r"--k must be in 1..16, got 0"),
    ({"k": 17}, r"--k must be in 1..16, got 17"),
    ({"max_context": 20, "prefill_chunk": 16, "k": 4}, "at least 21"),
    ({"prefill_chunk": 0}, "prefill-chunk"),
])
def test_bad_options_are_refused(kw, msg):
    with pytest.raises(BundleError, match=msg):
        ExportOptions(**kw)


def test_failed_export_leaves_nothing_behind(tiny_llama, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        export_bundle(bad, "none", tmp_path / "out", ExportOptions(max_context=64, prefill_chunk=8))
    with pytest.raises(SpecEdgeError, match=r"neither a known model \(smollm2-135m, .*\) nor an existing path"):
        export_bundle(tmp_path / "nope", "none", tmp_path / "out", ExportOptions(max_context=64, prefill_chunk=8))
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]


def test_draft_with_other_vocabulary_is_refused(tiny_llama, tmp_path):
    other = make_hf_model(tmp_path / "other", "llama", layers=1, hidden=32)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # swap two ids
    (other / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(VocabularyMismatchError, match="differs"):
        export_bundle(tiny_llama, other, tmp_path / "out", ExportOptions(max_context=64, prefill_chunk=8))
    assert not (tmp_path / "out").exists()


def test_cli_errors_are_one_line(tmp_path):
    r = CliRunner().invoke(export_cli, ["export", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert r.output.strip().startswith("error:") and "Traceback" not in r.output


def test_a_partial_draft_head_is_the_full_heads_columns(bundles):
    """--draft-vocab: the draft graph's logits are the full head's logits at HeadRows.ids() (same weights, same
    draft model), the manifest round-trips it, `info` shows it, and only the draft may have one."""
    import dataclasses

    import numpy as np

    from specedge.runtime.backends.ort import OrtRunner
    from specedge.runtime.manifest import HeadRows

    from ..conftest import DRAFT_HEAD

    part, full = read_manifest(bundles["model-head"]), read_manifest(bundles["model"])
    assert part.draft.head == HeadRows(DRAFT_HEAD) and part.draft.logits_width == DRAFT_HEAD
    assert full.draft.head is None and full.draft.logits_width == full.draft.dims.vocab
    assert Manifest.from_json(json.loads(json.dumps(part.to_json()))) == part
    r = CliRunner().invoke(export_cli, ["info", str(bundles["model-head"])])
    assert f"lm_head: {DRAFT_HEAD} ids" in r.output, r.output
    a, b = OrtRunner(bundles["model-head"], part, "draft"), OrtRunner(bundles["model"], full, "draft")
    ids = [5, 40, 7, 200, 3]
    la, lb = a.step(ids, 0, all_logits=False).copy(), b.step(ids, 0, all_logits=False).copy()
    assert la.shape == (1, DRAFT_HEAD) and lb.shape == (1, full.draft.dims.vocab)
    np.testing.assert_allclose(la, lb[:, part.draft.head.ids()], rtol=1e-5, atol=1e-5)
    with pytest.raises(BundleError, match="only a draft may have a partial head"):
        dataclasses.replace(part, target=dataclasses.replace(part.target, head=HeadRows(8)))
    with pytest.raises(BundleError, match="outside the vocabulary"):
        dataclasses.replace(part.draft, head=HeadRows(8, (9, part.draft.dims.vocab)))
    with pytest.raises(BundleError, match="ascending, distinct"):
        HeadRows(8, (12, 9))
    with pytest.raises(BundleError, match="ascending, distinct"):
        HeadRows(8, (3,))


def test_the_draft_head_keeps_the_special_tokens_above_it(tiny_llama, tmp_path):
    """Added tokens (and eos) with ids >= N join the head, so the draft can still propose the end of a turn."""
    from specedge.export.bundle import _draft_head
    from specedge.export.loaders import load_source

    tj = json.loads((tiny_llama / "tokenizer.json").read_text())
    added = sorted(t["id"] for t in tj["added_tokens"])
    assert added == [0, 1, 2]  # the tiny tokenizer's specials come first, so N = 2 leaves one above it
    head = _draft_head(load_source(tiny_llama), tiny_llama / "tokenizer.json", (2, 300), 2, lambda s: None)
    assert head.first == 2 and head.extra == (2, 300)
    assert list(head.ids()) == [0, 1, 2, 300]
    assert _draft_head(load_source(tiny_llama), tiny_llama / "tokenizer.json", (2,), 0, lambda s: None) is None
    assert _draft_head(load_source(tiny_llama), tiny_llama / "tokenizer.json", (2,), 10_000, lambda s: None) is None
    with pytest.raises(BundleError, match="--draft prompt-lookup has no model"):
        export_bundle(tiny_llama, "prompt-lookup", tmp_path / "out", ExportOptions(max_context=64, prefill_chunk=8,
                                                                                  draft_vocab=100))
    with pytest.raises(BundleError, match="--draft-vocab must be 0"):
        ExportOptions(draft_vocab=-1)
    assert not (tmp_path / "out").exists()


def test_the_drafts_catch_up_widths_are_chosen_at_export(tmp_path, tiny_llama, tiny_draft):
    """--draft-catchup-widths: the draft's narrow prefill widths (default 2, 4, 8, 16 below P), 'none' for decode and
    P only (fewer TensorRT profiles); a width outside 2..P-1 is refused with the range, before anything is built."""
    from specedge.runtime.manifest import model_widths

    assert [w.T for w in model_widths("draft", 4, 16)] == [1, 2, 4, 8, 16]
    assert [w.T for w in model_widths("draft", 4, 16, catchup=())] == [1, 16]
    assert [w.T for w in model_widths("target", 4, 16, catchup=(3,))] == [1, 2, 5, 16]  # the target has none
    with pytest.raises(BundleError, match=r"--draft-catchup-widths \[16\] out of range: each must be in 2..P-1=15"):
        ExportOptions(prefill_chunk=16, draft_catchup_widths=(2, 16))
    ExportOptions(prefill_chunk=8)  # the default: the widths below P
    r = CliRunner().invoke(export_cli, ["export", "--target", "x", "--draft", "y", "--prefill-chunk", "8",
                                        "--draft-catchup-widths", "2,9", "--out", str(tmp_path / "b")])
    assert r.exit_code != 0 and "--draft-catchup-widths [9] out of range" in r.output
    r = CliRunner().invoke(export_cli, ["export", "--target", "x", "--draft", "y", "--draft-catchup-widths", "2,x",
                                        "--out", str(tmp_path / "b")])
    assert r.exit_code != 0 and "comma-separated list" in r.output
    # (the tiny draft's head_dim 8 is below what the CPU profile's in-place attention takes)
    r = CliRunner().invoke(export_cli, ["export", "--target", str(tiny_llama), "--draft", str(tiny_draft),
                                        "--for", "datacenter-gpu", "--k", "4",
                                        "--prefill-chunk", "16", "--max-context", "64", "--draft-catchup-widths",
                                        "none", "--out", str(tmp_path / "none")])
    assert r.exit_code == 0, r.output
    assert [w.T for w in read_manifest(tmp_path / "none").draft.widths] == [1, 16]
