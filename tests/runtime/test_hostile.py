"""A careless or hostile user: every bad input is a typed, one-line SpecEdgeError (or a correct result)."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specedge.runtime import SamplingParams, SpecDecoder
from specedge.runtime.bundle_files import file_entry
from specedge.runtime.errors import BundleError, OptionError, PromptError, SamplingParamsError, SpecEdgeError
from specedge.runtime.manifest import read_manifest
from specedge.runtime.sampling import choose_next


@pytest.fixture()
def editable(bundles, tmp_path) -> Path:
    """A copy of the lookup bundle whose manifest a test may rewrite (graphs linked, not copied)."""
    dst = tmp_path / "b"
    dst.mkdir()
    for f in bundles["lookup"].iterdir():
        if f.name == "manifest.json":
            shutil.copy(f, dst / f.name)
        else:
            os.symlink(f, dst / f.name)
    return dst


def rewrite(bundle: Path, edit) -> None:  # noqa: ANN001
    m = json.loads((bundle / "manifest.json").read_text())
    m = edit(m)
    (bundle / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("edit, message", [
    (lambda m: {**m, "tokenizer": {**m["tokenizer"], "eos_ids": "2"}}, r"manifest.tokenizer.eos_ids must be a list"),
    (lambda m: {**m, "k": 8.5}, r"manifest.k must be an integer, got float 8.5"),
    (lambda m: {**m, "new_feature": 1}, r"unknown field\(s\) \['new_feature'\]"),
    (lambda m: [m], r"manifest must be a JSON object, got list"),
    (lambda m: {**m, "files": {n: {"sha256": v["sha256"]} for n, v in m["files"].items()}}, r"files\..*\.bytes"),
    (lambda m: {**m, "files": {**m["files"], "../../etc/passwd": next(iter(m["files"].values()))}},
     r"not a plain path inside the bundle"),
    (lambda m: {**m, "tokenizer": {**m["tokenizer"], "eos_ids": [10 ** 6]}}, r"outside the vocabulary"),
    (lambda m: {**m, "target": {**m["target"], "widths": [{"role": "verify", "T": 2, "L": 3}]}}, r"1 <= L <= T"),
    (lambda m: {**m, "target": {**m["target"], "dims": {**m["target"]["dims"], "n_layers": "2"}}},
     r"manifest.target.dims.n_layers must be an integer"),
])
def test_malformed_manifests_name_the_field(editable, edit, message):
    rewrite(editable, edit)
    with pytest.raises(BundleError, match=message):
        read_manifest(editable, verify="none")


@pytest.mark.parametrize("field, value, message", [
    ("n_kv_heads", 1, r"has shape .* the manifest implies"),
    ("n_layers", 1, r"graph inputs differ from the manifest's contract"),
    ("vocab", 999, r"output logits has shape"),
])
def test_dims_that_disagree_with_the_graph_are_refused_at_load(editable, field, value, message):
    def edit(m):
        m["target"]["dims"][field] = value
        if field == "n_kv_heads":
            m["target"]["dims"]["n_heads"] = 4
        return m
    rewrite(editable, edit)
    with pytest.raises(BundleError, match=message):
        SpecDecoder.load(editable, verify="none")


def test_missing_graph_broken_template_and_bad_paths(editable, tmp_path):
    rewrite(editable, lambda m: {**m, "tokenizer": {**m["tokenizer"], "chat_template": "{% for %}"}})
    with pytest.raises(BundleError, match="chat template does not compile"):
        SpecDecoder.load(editable, verify="none")
    rewrite(editable, lambda m: {**m, "tokenizer": {**m["tokenizer"], "chat_template": None}})
    (editable / "target.onnx").unlink()
    with pytest.raises(BundleError, match="target graph .* is missing"):
        SpecDecoder.load(editable, verify="none")
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(BundleError, match="is a file, not a bundle directory"):
        SpecDecoder.load(f)
    with pytest.raises(OptionError, match="bundle must be a path"):
        SpecDecoder.load(None)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="verify must be one of sha256, size, none"):
        SpecDecoder.load(editable, verify="md5")
    with pytest.raises(OptionError, match="threads must be an int in 1..256"):
        SpecDecoder.load(editable, threads=100_000)


def test_use_after_close_and_undecodable_prompts(bundles):
    dec = SpecDecoder.load(bundles["lookup"])
    with pytest.raises(PromptError, match="not valid UTF-8"):
        dec.generate("abc\udcff", SamplingParams(max_new_tokens=2))  # what Python makes of bad bytes in argv
    dec.close()
    dec.close()
    with pytest.raises(OptionError, match="closed"):
        dec.generate("hi", SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC])
def test_read_only_or_full_disk_is_a_one_line_error_and_keeps_the_old_bundle(tiny_llama, tmp_path, monkeypatch, err):
    import specedge.export.bundle as b

    out = b.export_bundle(tiny_llama, "none", tmp_path / "b", b.ExportOptions(k=2, max_context=64, prefill_chunk=8)).out

    def fail(*a, **kw):
        raise OSError(err, os.strerror(err), str(tmp_path / ".b.tmp-x" / "manifest.json"))

    monkeypatch.setattr(b, "write_manifest", fail)
    with pytest.raises(BundleError, match=f"cannot write the bundle .*{os.strerror(err)}"):
        b.export_bundle(tiny_llama, "prompt-lookup", out, b.ExportOptions(k=2, max_context=64, prefill_chunk=8,
                                                                           overwrite=True))
    assert read_manifest(out).drafter == "none"


JUNK = [None, "2", 8.5, -1, 0, [], {}, True, "x" * 3, 10 ** 12, {"a": 1}, [1, "a"], float("nan")]


def _paths(node, prefix=()):  # noqa: ANN001
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def test_manifest_fuzz_finds_no_untyped_exception(editable):
    """Random type/value mutations of every field (seeded, bounded): each manifest loads and generates, or is
    refused with a SpecEdgeError — never another exception."""
    original = json.loads((editable / "manifest.json").read_text())
    paths = [p for p in _paths(original) if p]
    rnd = random.Random(int(os.environ.get("SPECEDGE_FUZZ_SEED", "0")))
    outcomes = {"refused": 0, "loaded": 0}
    for _ in range(int(os.environ.get("SPECEDGE_FUZZ_N", "250"))):
        m = json.loads(json.dumps(original))
        path = rnd.choice(paths)
        parent = m
        for key in path[:-1]:
            parent = parent[key]
        if rnd.random() < 0.15 and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = rnd.choice(JUNK)
        (editable / "manifest.json").write_text(json.dumps(m))
        try:
            dec = SpecDecoder.load(editable, verify="size")
            dec.generate("hi", SamplingParams(max_new_tokens=2))
            outcomes["loaded"] += 1
        except SpecEdgeError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 150, outcomes


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 10 ** 6), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=4), st.lists(st.text(max_size=3), max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop",
                                        "ignore_eos", "sampler"]), VALUES, max_size=4))
def test_sampling_params_fuzz_finds_no_untyped_exception(kwargs):
    try:
        p = SamplingParams(**kwargs)
    except SamplingParamsError:
        return
    logits = np.random.default_rng(0).normal(size=16).astype(np.float32)
    if not p.greedy and p.sampler == "keyed" and p.seed is None:
        p = SamplingParams(**{**kwargs, "seed": 1})
    assert 0 <= choose_next(logits, p, np.random.default_rng(0), position=3) < 16


def test_kv_mode_that_disagrees_with_the_graph_is_refused(editable):
    rewrite(editable, lambda m: {**m, "kv_mode": "ort-inplace"})  # the graph is portable
    with pytest.raises(BundleError, match=r"present\.0\.key has shape .*'T'.* implies .*'S_max'"):
        SpecDecoder.load(editable, verify="none")


def test_bench_prompt_file_with_non_string_content_is_refused_up_front(tmp_path):
    from specedge.runtime.bench.suites import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "fine"}\n{"messages": [{"role": "user", "content": ["a", "list"]}]}\n')
    with pytest.raises(PromptError, match=r"p.jsonl:2: message 0: 'role' and 'content' must be strings"):
        load_prompts(f)


def test_non_ascii_output_on_an_ascii_terminal_does_not_crash(bundles):
    """PYTHONIOENCODING=ascii: generated text that holds non-ASCII characters is printed with replacements."""
    import subprocess
    import sys

    prompt, n = "héllo wörld — ünïcödé ✓ 数据 データ", 60
    dec = SpecDecoder.load(bundles["lookup"])
    text = dec.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)).text
    assert any(ord(c) > 127 for c in text)  # precondition: this output cannot be written as ASCII
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    r = subprocess.run([sys.executable, "-m", "specedge.runtime.cli", "generate", str(bundles["lookup"]), prompt,
                        "--max-new-tokens", str(n)], capture_output=True, env=env)
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr.decode(errors="replace")[-500:]
    assert b"?" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--seed", "-1"], r"seed must be an int in 0..2\*\*63-1"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--k", "99"], r"k must be an integer in 0..8"),
    (["--threads", "100000"], r"100000 is not in the range 1<=x<=256"),
])
def test_cli_refuses_bad_options_in_one_line(bundles, args, message):
    import re

    from click.testing import CliRunner

    from specedge.runtime.cli import main

    r = CliRunner().invoke(main, ["generate", str(bundles["lookup"]), "hi", *args])
    assert r.exit_code == 2 and r.exception is None or isinstance(r.exception, SystemExit), r.output
    assert re.search(message, r.output), r.output
    assert "Traceback" not in r.output


# ---- damaged bundles and wrong arguments: each must end in a clear error, never a traceback, a hang or a silent
# wrong result


def damaged_copy(bundles, tmp_path, name: str, data: bytes) -> Path:
    """A copy of the lookup bundle with one file replaced by ``data`` and the manifest's entry for it (size and
    sampled hash) recorded from it, as an exporter's bug would leave it: the checks past the hashes must catch it."""
    dst = tmp_path / "damaged"
    shutil.copytree(bundles["lookup"], dst)
    (dst / name).write_bytes(data)
    rewrite(dst, lambda m: {**m, "files": {**m["files"], name: file_entry(dst / name)}})
    return dst


@pytest.mark.parametrize("data, message", [
    (bytes(random.Random(0).randrange(256) for _ in range(4096)), r"not a tokenizer the tokenizers library can read"),
    (b'{"hello": 1}', r"not a tokenizer the tokenizers library can read"),
])
def test_a_damaged_tokenizer_is_a_bundle_error(bundles, tmp_path, data, message):
    with pytest.raises(BundleError, match=message):
        SpecDecoder.load(damaged_copy(bundles, tmp_path, "tokenizer.json", data), verify="size")


def test_a_tokenizer_of_another_size_is_refused(editable):
    rewrite(editable, lambda m: {**m, "tokenizer": {**m["tokenizer"], "vocab_size": m["tokenizer"]["vocab_size"] - 1}})
    with pytest.raises(BundleError, match=r"tokens, the manifest's tokenizer.vocab_size says"):
        SpecDecoder.load(editable, verify="none")


def test_weights_that_decode_to_nan_are_an_error_not_an_empty_answer(bundles, tmp_path):
    size = (bundles["lookup"] / "target.onnx.data").stat().st_size
    dec = SpecDecoder.load(damaged_copy(bundles, tmp_path, "target.onnx.data", b"\xff" * size), verify="size")
    for params in (SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=4, temperature=0.8, seed=1)):
        with pytest.raises(BundleError, match=r"logits after the prompt are not finite .* `spec-export info"):
            dec.generate("The capital of France is", params)


@pytest.mark.parametrize("edit, message", [
    (lambda m: {**m, "k": 20}, r"k=20 needs a target width of K\+1=21 tokens with every row's logits"),
    (lambda m: {**m, "target": {**m["target"], "widths": [w for w in m["target"]["widths"] if w["role"] != "verify"]}},
     r"k=8 needs a target width of K\+1=9 tokens"),
])
def test_a_k_no_target_width_can_verify_is_refused_at_load(editable, edit, message):
    rewrite(editable, edit)
    with pytest.raises(BundleError, match=message):
        read_manifest(editable, verify="none")


def test_a_deeply_nested_manifest_is_a_bundle_error(editable):
    (editable / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BundleError, match="not valid JSON"):
        read_manifest(editable, verify="none")


def test_api_arguments_of_the_wrong_type_are_typed_errors_before_any_output(decoders):
    dec = decoders["lookup"]
    p = SamplingParams(max_new_tokens=4)
    with pytest.raises(PromptError, match="a prompt is a string or a list of chat messages, got int"):
        dec.generate(123, p)  # type: ignore[arg-type]
    for k in (2.5, "3", True):
        with pytest.raises(SamplingParamsError, match=r"k must be an integer in 0..8"):
            dec.stream("hi", p, k=k)  # raised by the call, not after a first event
    with pytest.raises(SamplingParamsError, match="drafter must be a name"):
        dec.stream("hi", p, drafter=["auto"])  # type: ignore[arg-type]
    with pytest.raises(PromptError, match=r"message 0's content is not valid UTF-8 text"):
        dec.generate([{"role": "user", "content": "a\ud800b"}], p)
    # numpy's scalars are numbers like any other
    a = dec.generate("hi", SamplingParams(max_new_tokens=np.int64(4), temperature=np.float32(0.5), seed=np.int64(3),
                                          top_k=np.int32(5)), k=np.int64(3))
    b = dec.generate("hi", SamplingParams(max_new_tokens=4, temperature=float(np.float32(0.5)), seed=3, top_k=5), k=3)
    assert a.token_ids == b.token_ids


def test_precision_is_checked_and_a_paused_stream_of_a_closed_decoder_says_so(bundles):
    with pytest.raises(OptionError, match=r"precision must be fp16 or bf16 .* got 'int4'; int8/int4 weights are "
                                          r"chosen at export"):
        SpecDecoder.load(bundles["lookup"], precision="int4")
    dec = SpecDecoder.load(bundles["lookup"])
    s = dec.stream("hi", SamplingParams(max_new_tokens=20, ignore_eos=True))
    next(s)
    dec.close()
    with pytest.raises(OptionError, match="closed while the stream was paused"):
        next(s)


def test_a_kv_cache_the_machine_cannot_allocate_is_an_out_of_memory_error(bundles, monkeypatch):
    import specedge.runtime.backends.ort as ort_backend
    from specedge.runtime.errors import OutOfMemoryError

    real = ort_backend.np.zeros

    def zeros(shape, dtype=float):  # noqa: ANN001 - the KV cache (rank 6) is what a too-large S_max cannot get
        if len(shape) == 6:
            raise MemoryError("Unable to allocate 45.0 GiB")
        return real(shape, dtype=dtype)

    monkeypatch.setattr(ort_backend.np, "zeros", zeros)
    with pytest.raises(OutOfMemoryError, match=r"KV cache at S_max=256 needs .* GiB.*smaller --max-context"):
        SpecDecoder.load(bundles["lookup"])


def test_export_refuses_an_oversized_context_and_options_it_would_ignore_before_any_work(tmp_path):
    from click.testing import CliRunner

    from specedge.export.bundle import ExportOptions
    from specedge.export.cli import main

    with pytest.raises(BundleError, match=r"--max-context 2000000 is over the most a bundle takes, 1048576"):
        ExportOptions(max_context=2_000_000)
    for args, message in ((["--draft", "none", "--draft-weights", "int8"], "--draft-weights is for a draft model"),
                          (["--draft", "prompt-lookup", "--draft-catchup-widths", "2,4", "--draft-lm-head", "int4"],
                           "--draft-lm-head, --draft-catchup-widths are for a draft model"),
                          (["--draft", "none", "--ngram-max", "5"], "--ngram-max is for prompt lookup's matching")):
        r = CliRunner().invoke(main, ["export", "--target", "no-such-model", *args, "--out", str(tmp_path / "o")])
        assert r.exit_code == 2 and message in r.output, r.output
        assert not (tmp_path / "o").exists()


def test_bench_refuses_a_plan_with_nothing_to_compare_and_a_bundle_as_its_output(bundles, tmp_path):
    from click.testing import CliRunner

    from specedge.runtime.cli import main

    b = str(bundles["lookup"])
    r = CliRunner().invoke(main, ["bench", b, "--k", "99", "--drafter", "prompt-lookup", "--suite", "code",
                                  "--per-suite", "1", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "nothing to compare with plain decoding" in r.output, r.output
    r = CliRunner().invoke(main, ["bench", b, "--suite", "code", "--per-suite", "1", "--out", b])
    assert r.exit_code == 2 and "is a bundle" in r.output, r.output


def test_a_chat_template_that_loops_without_end_is_stopped(editable):
    """The sandbox bounds each range() call, not nested ones: 99,999 x 99,999 steps held the request for good."""
    import time

    slow = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{{ messages[0].content }}"
    rewrite(editable, lambda m: {**m, "tokenizer": {**m["tokenizer"], "chat_template": slow}})
    dec = SpecDecoder.load(editable, verify="none")
    t0 = time.perf_counter()
    with pytest.raises(PromptError, match=r"chat template asks for over 100000 loop steps"):
        dec.generate([{"role": "user", "content": "hi"}], SamplingParams(max_new_tokens=2))
    assert time.perf_counter() - t0 < 10
    ok = "{% for i in range(3) %}{{ i }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    rewrite(editable, lambda m: {**m, "tokenizer": {**m["tokenizer"], "chat_template": ok}})
    assert SpecDecoder.load(editable, verify="none").codec.render_chat([{"role": "user", "content": "hi"}]) == "012hi"


def test_a_draft_that_fails_to_open_closes_the_target_it_opened(bundles, tmp_path, monkeypatch):
    """Device memory is not left to the garbage collector: on a Jetson a retry in the same process needs it."""
    import specedge.runtime.backends.ort as ort_backend

    dst = tmp_path / "b"
    shutil.copytree(bundles["model"], dst)
    (dst / "draft.onnx").write_bytes(b"not a graph")
    closed = []
    real = ort_backend.OrtRunner.close
    monkeypatch.setattr(ort_backend.OrtRunner, "close", lambda self: (closed.append(self.entry.graph), real(self)))
    with pytest.raises(BundleError, match="cannot load the draft graph"):
        SpecDecoder.load(dst, verify="none")
    assert closed == ["target.onnx"]


def test_board_fetch_cache_and_validate_tolerances_are_checked(tmp_path):
    from click.testing import CliRunner

    from specedge.export.cli import main as export_main
    from specedge.export.fetch import FetchError, fetch
    from specedge.runtime.memplan import Board

    for table in ({"memory_gb": float("nan")}, {"memory_gb": 1e308, "reserved_gb": float("inf")},
                  {"memory_gb": -5}, {"memory_gb": 8, "reserved_gb": 9}):
        with pytest.raises(SpecEdgeError, match=r"\[board\] of b: needs memory_gb"):
            Board.from_table("b", table)
    with pytest.raises(SpecEdgeError, match=r"\[board\] of b"):
        Board.from_table("b", 3)  # type: ignore[arg-type]
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(FetchError, match="cannot write the model cache .*SPECEDGE_CACHE"):
        fetch("smollm2-135m", afile / "sub")
    r = CliRunner().invoke(export_main, ["validate", str(tmp_path), "--logits-atol", "nan"])
    assert r.exit_code == 2 and "tolerances must be finite numbers >= 0" in r.output, r.output
    r = CliRunner().invoke(export_main, ["validate", str(tmp_path), "--report", str(tmp_path / "no" / "r.json")])
    assert r.exit_code == 2 and "does not exist" in r.output, r.output
