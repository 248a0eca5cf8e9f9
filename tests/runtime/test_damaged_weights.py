"""Damaged or replaced weights are an error that says so, never an empty or wrong answer, never a crash: a fresh
load checks each file's sampled hash, the first logits are checked for zeroed weights, and a decoder refuses
requests once the files it loaded change on disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from specedge.runtime import BundleError, SamplingParams, SpecDecoder
from specedge.runtime.bundle_files import SAMPLE_BLOCK, sample_stride

PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
DATA = "target.onnx.data"


@pytest.fixture
def bundle(bundles, tmp_path):
    out = tmp_path / "b"
    shutil.copytree(bundles["lookup"], out)
    return out


def _zero(path, start: int, length: int) -> None:
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\0" * length)


def _drop_samples(bundle) -> None:
    """The manifest as a bundle without sampled hashes has it."""
    m = json.loads((bundle / "manifest.json").read_text())
    for meta in m["files"].values():
        meta.pop("sample", None)
    (bundle / "manifest.json").write_text(json.dumps(m))


def test_every_file_has_a_sampled_hash_that_covers_it(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    for name, meta in m["files"].items():
        assert meta["sample"]["stride"] == sample_stride(meta["bytes"]), name
    assert sample_stride(100 * SAMPLE_BLOCK) == SAMPLE_BLOCK  # a small file is read whole
    assert sample_stride(1 << 30) == 1 << 20  # a GiB: a block every MiB


def test_a_file_of_zeros_of_the_right_size_is_refused_at_load(bundle):
    size = (bundle / DATA).stat().st_size
    _zero(bundle / DATA, 0, size)
    with pytest.raises(BundleError, match="sampled hash"):
        SpecDecoder.load(bundle)


def test_a_zeroed_region_in_the_middle_is_refused_at_load(bundle):
    size = (bundle / DATA).stat().st_size
    _zero(bundle / DATA, size // 3, max(size // 10, sample_stride(size) + SAMPLE_BLOCK))
    with pytest.raises(BundleError, match=f"{DATA}.*sampled hash"):
        SpecDecoder.load(bundle)


def test_zeroed_weights_without_sampled_hashes_are_refused_at_the_first_request(bundle):
    size = (bundle / DATA).stat().st_size
    _zero(bundle / DATA, 0, size)
    _drop_samples(bundle)
    dec = SpecDecoder.load(bundle)  # sizes agree
    with pytest.raises(BundleError, match="all equal.*damaged"):
        dec.generate("def fib(n):", PARAMS)
    dec.close()


def test_a_malformed_sample_entry_is_refused(bundle):
    m = json.loads((bundle / "manifest.json").read_text())
    m["files"][DATA]["sample"] = {"stride": 0, "sha256": "x"}
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match=f"files.{DATA}.sample must be"):
        SpecDecoder.load(bundle)


@pytest.mark.parametrize("change", ["replace", "zero in place", "touch", "remove"])
def test_a_decoder_refuses_requests_once_its_files_change(bundle, change):
    dec = SpecDecoder.load(bundle)
    want = dec.generate("def fib(n):", PARAMS).token_ids
    data = bundle / DATA
    if change == "replace":  # what an atomic re-export or `mv` does: a new file under the name
        tmp = bundle / "new"
        shutil.copyfile(data, tmp)
        os.replace(tmp, data)
    elif change == "zero in place":
        _zero(data, 0, 4096)
    elif change == "touch":
        os.utime(data, ns=(0, 0))
    else:
        data.unlink()
    with pytest.raises(BundleError, match=f"{DATA} in .* changed on disk.*load the bundle again"):
        dec.generate("def fib(n):", PARAMS)
    dec.close()
    if change != "remove":
        again = SpecDecoder.load(bundle, verify="none")
        if change in ("replace", "touch"):  # the same bytes: the same answer once loaded again
            assert again.generate("def fib(n):", PARAMS).token_ids == want
        again.close()


def test_a_weights_file_truncated_under_a_running_decoder_does_not_crash_it(bundle):
    """ONNX Runtime left to itself maps the weights file: truncating it (``cp`` over it) under a running process
    killed that process with SIGBUS. The weights are read, not mapped, so the process lives and says what changed."""
    script = textwrap.dedent(f"""
        from specedge.runtime import BundleError, SamplingParams, SpecDecoder
        dec = SpecDecoder.load({str(bundle)!r})
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        dec.generate("def fib(n):", params)
        open({str(bundle / DATA)!r}, "r+b").truncate(0)
        try:
            dec.generate("def fib(n):", params)
        except BundleError as e:
            print("refused:", e)
        # what the runner holds is its own: a step run directly still works
        dec.target.step([1, 2], 0, all_logits=True)
        print("alive")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert "refused:" in run.stdout and "changed on disk" in run.stdout and "alive" in run.stdout


def test_a_server_whose_bundle_changed_says_so_on_health_and_to_every_request(bundle):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from tests.runtime.test_server import Running

    srv = Running(bundle)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert srv.post("/v1/chat/completions", body)[0] == 200
        os.utime(bundle / DATA, ns=(0, 0))
        status, reply, _ = srv.post("/v1/chat/completions", body)
        assert status == 500 and "changed on disk" in reply["error"]["message"], reply
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(srv.url + "/health", timeout=30)
        assert e.value.code == 503
        health = json.loads(e.value.read())
        assert health["status"] == "bundle changed on disk" and health["changed"] == [DATA]
    finally:
        srv.close()


def test_the_tensorrt_execution_provider_keeps_reading_the_model_from_its_file(bundle):
    """ONNX Runtime's TensorRT execution provider parses the model file itself, so it is not handed the weights;
    the CPU and CUDA providers are."""
    from specedge.runtime.backends.ort import open_session

    class FakeOptions:
        def __init__(self):
            self.given = []

        def add_external_initializers_from_files_in_memory(self, names, buffers, lengths):
            self.given.append((list(names), list(lengths)))

    class FakeOrt:
        @staticmethod
        def InferenceSession(path, so, providers):  # noqa: N802
            return path

    empty = bundle / "empty.onnx"
    (bundle / "empty.onnx.data").write_bytes(b"")  # nothing to hand over (and nothing an mmap could map)
    so = FakeOptions()
    assert open_session(FakeOrt, empty, so, ["CPUExecutionProvider"]) == str(empty) and so.given == []
    size = (bundle / DATA).stat().st_size
    for providers, handed in ((["CPUExecutionProvider"], True),
                              ([("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"], True),
                              ([("TensorrtExecutionProvider", {}), "CPUExecutionProvider"], False)):
        so = FakeOptions()
        assert open_session(FakeOrt, bundle / "target.onnx", so, providers) == str(bundle / "target.onnx")
        assert so.given == ([([DATA], [size])] if handed else []), providers


@pytest.mark.skipif(not os.path.isfile("/proc/self/maps"), reason="reads the process's mappings (Linux)")
def test_the_specedge_form_reads_each_weights_file_once_and_maps_none(tiny_llama, tiny_draft, tmp_path):
    """The specedge form's manifest lists every tensor of each weights file: the runtime reads them itself and ONNX
    Runtime takes them as initializers, so no file is mapped, even while the session is made (a load's peak is the
    weights once, not the mapped file and ONNX Runtime's copy at once)."""
    from specedge.export.bundle import ExportOptions, export_bundle
    from specedge.export.quant import WeightFormat
    from specedge.runtime.manifest import ROWS_KV_MODE, read_manifest

    opts = ExportOptions(k=4, max_context=128, prefill_chunk=16, kv_mode=ROWS_KV_MODE,
                         weights=WeightFormat("int4", form="specedge"))
    out = export_bundle(tiny_llama, tiny_draft, tmp_path / "b", opts).out
    m = read_manifest(out)
    for e in (m.target, m.draft):  # every tensor of the file: only the 64-byte alignment between them
        spans = sorted((offset, offset + length) for offset, length, *_ in e.tensors.values())
        ends = [0] + [end for _, end in spans]
        assert all(0 <= a - end < 64 for (a, _), end in zip(spans, ends)), spans
        assert 0 <= (out / e.weights).stat().st_size - ends[-1] < 64
    dec = SpecDecoder.load(out, threads=1)
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
        assert ".onnx.data" not in maps
        assert dec.generate("def fib(n):", PARAMS, drafter="model").token_ids == \
            dec.generate("def fib(n):", PARAMS, drafter="none").token_ids
    finally:
        dec.close()
