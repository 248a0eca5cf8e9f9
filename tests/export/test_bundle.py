"""Bundle export, manifest round trip, and refusal of bad input."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from specedge.export.bundle import ExportOptions, export_bundle
from specedge.export.cli import main as export_cli
from specedge.runtime.errors import SpecEdgeError, BundleError, UnsupportedModelError, VocabularyMismatchError
from specedge.runtime.manifest import MANIFEST_NAME, Manifest, read_manifest

from ..conftest import make_hf_model


def test_manifest_round_trips(bundles):
    m = read_manifest(bundles["model"])
    again = Manifest.from_json(json.loads(json.dumps(m.to_json())))
    assert again == m
    assert m.drafter == "model" and m.draft is not None
    assert [w.T for w in m.target.widths] == [1, 2, 9, 16]  # decode, verify 2 (plain rounds) and K+1, prefill P
    assert [w.T for w in m.draft.widths] == [1, 16]
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
