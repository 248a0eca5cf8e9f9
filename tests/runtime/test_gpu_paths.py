"""GPU-path defects that can be shown and checked without a GPU (issue: GPU deployment that survives its first
run): an uninitialized cache poisons portable attention, the device cache is zeroed once, engines load from a
memory map, TensorRT older than 10.3 is refused with the JetPack that brings a new enough one."""

from __future__ import annotations

import numpy as np
import pytest

from specedge.runtime.backends import tensorrt_version_problem
from specedge.runtime.backends.ort import OrtRunner, zero_device_cache
from specedge.runtime.manifest import read_manifest


def test_garbage_in_unused_cache_rows_poisons_portable_attention(bundles):
    """Why ort-cuda must zero its cache: masked probabilities are exactly 0, and 0 * NaN = NaN."""
    m = read_manifest(bundles["lookup"])
    assert m.kv_mode == "portable"
    r = OrtRunner(bundles["lookup"], m, "target")
    ids = np.array([5, 6, 7])
    clean = r.step(ids, 0, all_logits=True).copy()
    r.kv[...] = np.nan  # what uninitialized device memory may hold
    assert np.isnan(r.step(ids, 0, all_logits=True)).all()
    r.kv[...] = 0.0
    np.testing.assert_array_equal(r.step(ids, 0, all_logits=True), clean)


def test_device_cache_is_zeroed_once_per_tensor():
    calls = []

    class FakeCuda:
        def memset(self, ptr, value, nbytes, stream=0):
            calls.append((ptr, value, nbytes))

        def synchronize(self, stream=0):
            calls.append("sync")

    class Val:
        def __init__(self, p):
            self.p = p

        def data_ptr(self):
            return self.p

    zero_device_cache(FakeCuda(), [Val(4096), Val(8192)], 1234)
    assert calls == [(4096, 0, 1234), (8192, 0, 1234), "sync"]


@pytest.mark.parametrize("version, ok", [("8.6.1.6", False), ("10.2.0", False), ("10.3.0.30", True),
                                         ("10.15.1", True), ("11.0.0", True), ("weird", False)])
def test_tensorrt_version_gate(version, ok):
    why = tensorrt_version_problem(version)
    assert (why is None) == ok
    if not ok and version != "weird":
        assert "needs TensorRT >= 10.3" in why and "JetPack 6.1" in why


def test_engine_is_deserialized_from_a_memory_map(tmp_path):
    from specedge.runtime.backends.trt import deserialize_mapped

    plan = tmp_path / "t.engine"
    plan.write_bytes(b"ENGINE-BYTES" * 1000)
    seen = {}

    class FakeRuntime:
        def deserialize_cuda_engine(self, buf):
            seen["type"] = type(buf).__name__
            seen["bytes"] = bytes(memoryview(buf)[:12])
            return "engine"

    assert deserialize_mapped(FakeRuntime(), plan) == "engine"
    assert seen == {"type": "mmap", "bytes": b"ENGINE-BYTES"}  # a map of the file, not a bytes copy
