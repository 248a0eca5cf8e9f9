"""Row-addressed graphs (the specedge form): a step's rows name their KV slot and position, so the rows of several
sequences share one step, and every row's logits are the bits the same tokens give their sequence alone."""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
import pytest

from specedge.export.graph import build_model_graph
from specedge.export.loaders import load_source
from specedge.export.quant import WeightFormat
from specedge.runtime.errors import UnsupportedModelError
from specedge.runtime.kernels import register
from specedge.runtime.manifest import ROWS_KV_MODE

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the kernels are built with a POSIX C compiler")
S = 96
SPECEDGE = WeightFormat("int4", form="specedge")


class Graph:
    def __init__(self, path, slots: int, dims):
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        register(so)
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.names = [f"{i}.{k}" for i in range(dims.n_layers) for k in ("key", "value")]
        self.cache = {n: np.zeros((slots, dims.n_kv_heads, S, dims.head_dim), np.float32) for n in self.names}

    def run(self, ids, **where) -> np.ndarray:
        """All rows' logits [T, V]; the caches take the step's rows (a rows graph's rows have no parent unless
        row_parent is given)."""
        if "row_slot" in where:
            where.setdefault("row_parent", [-1] * len(ids))
        feeds = {"input_ids": np.asarray([ids], np.int64), "logits_at": np.arange(len(ids), dtype=np.int64)[None],
                 **{k: np.asarray(v, np.int64) for k, v in where.items()},
                 **{f"past_key_values.{n}": c for n, c in self.cache.items()}}
        names = ["logits"] + [f"present.{n}" for n in self.names]
        out = self.session.run(names, feeds)
        self.cache = dict(zip(self.names, out[1:]))
        return out[0][0]


@pytest.fixture(scope="module")
def graphs(tiny_llama, tmp_path_factory):
    src = load_source(tiny_llama)
    out = tmp_path_factory.mktemp("rows")
    inplace = build_model_graph(src, out, "inplace", fmt=SPECEDGE, kv_mode="ort-inplace", max_positions=S)[0]
    rows = build_model_graph(src, out, "rows", fmt=SPECEDGE, kv_mode=ROWS_KV_MODE, max_positions=S)[0]
    return inplace, rows, src.config.dims


def alone(graphs, chunks: list[list[int]]) -> list[np.ndarray]:
    """A sequence fed chunk by chunk through the single-sequence graph: each chunk's logits."""
    inplace, _, dims = graphs
    g, past, got = Graph(inplace, 1, dims), 0, []
    for ids in chunks:
        got.append(g.run(ids, past_len=[past]))
        past += len(ids)
    return got


def test_one_sequence_in_slot_0_gives_the_single_sequence_graphs_bits(graphs):
    chunks = [[5, 9, 17, 33, 2], [40, 41, 42], [7]]
    want = alone(graphs, chunks)
    g, past = Graph(graphs[1], 2, graphs[2]), 0
    for ids, w in zip(chunks, want):
        got = g.run(ids, row_slot=[0] * len(ids), row_pos=list(range(past, past + len(ids))))
        past += len(ids)
        assert np.array_equal(got, w)


def test_rows_of_several_sequences_in_one_step_give_each_its_own_bits(graphs):
    a, b, c = [[5, 9, 17, 33, 2], [40, 41, 42]], [[11, 12, 13, 14, 15, 16, 17], [90, 91]], [[3], [4]]
    want = {name: alone(graphs, seq) for name, seq in (("a", a), ("b", b), ("c", c))}
    g = Graph(graphs[1], 3, graphs[2])
    for slot, seq in enumerate((a, b, c)):  # each prompt alone, in its slot
        first = seq[0]
        assert np.array_equal(g.run(first, row_slot=[slot] * len(first), row_pos=list(range(len(first)))),
                              want["abc"[slot]][0])
    # one step: c's next token, b's next two, padding, a's next three (any order)
    ids = [4, 90, 91, 0, 40, 41, 42]
    slot = [2, 1, 1, -1, 0, 0, 0]
    pos = [1, 7, 8, 0, 5, 6, 7]
    got = g.run(ids, row_slot=slot, row_pos=pos)
    assert np.array_equal(got[4:7], want["a"][1])
    assert np.array_equal(got[1:3], want["b"][1])
    assert np.array_equal(got[0:1], want["c"][1])


def test_rows_need_the_specedge_form(tiny_llama, tmp_path):
    with pytest.raises(UnsupportedModelError, match="specedge weight form"):
        build_model_graph(load_source(tiny_llama), tmp_path, "rows", fmt=WeightFormat("int4"), kv_mode=ROWS_KV_MODE,
                          max_positions=S)
