"""ai.specedge::SekRowAttention: a step of rows that each name their sequence's KV slot and position.

Each real row's output, and every cache row it writes, has the bits SekAttention gives that row in a step of its
slot alone (a [1, H_kv, S_max, D] cache holding the same rows), whatever else the step carries and in whatever order.
"""

from __future__ import annotations

import sys

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specedge.runtime.errors import BackendUnavailableError
from specedge.runtime.kernels import library_path
from tests.runtime.test_sek_kernel import _attention_model, _session, _windowed_reference

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the kernels are built with a POSIX C compiler")

PAD = -1  # row_slot of a padding row


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    try:
        library_path()
    except BackendUnavailableError as e:
        pytest.skip(f"specedge's kernels cannot be built here: {e}")


KV_TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.int8: TensorProto.INT8}  # caches'
ALL_KV = list(KV_TYPES)


def quantize_rows(x: np.ndarray) -> np.ndarray:
    """The int8 cache rows of fp32 rows x [..., d]: [..., d + 4] int8, d values then the row's fp32 scale (its
    largest magnitude / 127; values x / scale rounded to nearest even; a row of zeros scale 0, a row with an infinity
    or a NaN scale NaN and values 0), written in numpy as the kernel's contract (runtime/csrc/sek.h) says."""
    x = np.asarray(x, np.float32)
    a = np.abs(x)
    finite = np.all(a <= np.finfo(np.float32).max, axis=-1, keepdims=True)
    scale = np.where(finite, np.where(finite, a, 0).max(axis=-1, keepdims=True) / np.float32(127), np.nan)
    scale = scale.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.clip(np.rint(x / scale), -127, 127), 0).astype(np.int8)
    return np.concatenate([q, scale.view(np.int8)], axis=-1)


def dequantize_rows(r: np.ndarray) -> np.ndarray:
    """int8 cache rows [..., d + 4] as the fp32 values they hold: q * scale."""
    r = np.ascontiguousarray(r)
    return r[..., :-4].astype(np.float32) * r[..., -4:].copy().view(np.float32)


def cache_width(d: int, kv) -> int:
    """A cache row's last dimension: d elements, or d int8 values and their 4-byte scale."""
    return d + 4 if kv in (np.int8, TensorProto.INT8) else d


def _row_model(hq: int, hkv: int, d: int, width: int | str | None = None, tree: bool = False,
               kv=np.float32, window: int = 0, k_shift=None) -> bytes:
    """One SekRowAttention node; qkv's width (H_q + 2 H_kv) D unless `width` names another (a symbol: any); with
    `tree`, the optional row_parent input too; caches of element type kv; a sliding window (0: none); a key shift
    (H_kv x D values; None: none)."""
    F, I64, K = TensorProto.FLOAT, TensorProto.INT64, KV_TYPES[kv]
    node = helper.make_node("SekRowAttention", ["qkv", "pk", "pv", "row_slot", "row_pos", "cos", "sin",
                                                *(["row_parent"] if tree else [])],
                            ["out", "presk", "presv"], domain="ai.specedge", num_heads=hq, kv_num_heads=hkv,
                            scale=float(1 / np.sqrt(d)), **({"window": window} if window else {}),
                            **({"k_shift": [float(x) for x in np.ravel(k_shift)]} if k_shift is not None else {}))
    vi = helper.make_tensor_value_info
    D = cache_width(d, kv)
    inputs = [vi("qkv", F, [1, "R", width or (hq + 2 * hkv) * d]), vi("pk", K, ["N", hkv, "S", D]),
              vi("pv", K, ["N", hkv, "S", D]), vi("row_slot", I64, ["R"]), vi("row_pos", I64, ["R"]),
              vi("cos", F, ["P", d // 2]), vi("sin", F, ["P", d // 2])]
    inputs += [vi("row_parent", I64, ["R"])] if tree else []
    g = helper.make_graph([node], "g", inputs, [vi("out", F, None), vi("presk", K, None), vi("presv", K, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.specedge", 1)]
                             ).SerializeToString()


def _bits(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    return x.view({1: np.uint8, 2: np.uint16}.get(x.dtype.itemsize, np.uint32))  # bitwise, NaN rows included


def _rope_tables(S: int, d: int):
    ang = np.arange(S)[:, None] / (10000 ** (np.arange(d // 2) / (d // 2)))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)  # [S, D/2] each


def _caches(rng, N: int, hkv: int, S: int, d: int, filled: list[int], kv=np.float32):
    """k and v caches [N, H_kv, S, D] of kv: slot n holds filled[n] random rows, NaN after them (rows no query may
    read; int8 rows of scale NaN)."""
    caches = [np.full((N, hkv, S, d), np.nan, np.float32 if kv == np.int8 else kv) for _ in range(2)]
    for c in caches:
        for n, f in enumerate(filled):
            c[n, :, :f] = rng.standard_normal((hkv, f, d))
    return [quantize_rows(c) for c in caches] if kv == np.int8 else caches


class Step:
    """A step's rows: (slot, pos) per row, and qkv [1, R, (H_q + 2 H_kv) D] for them."""

    def __init__(self, rows: list[tuple[int, int]], qkv: np.ndarray):
        self.rows, self.qkv = rows, qkv

    @property
    def slot(self) -> np.ndarray:
        return np.array([s for s, _ in self.rows], np.int64)  # [R]

    @property
    def pos(self) -> np.ndarray:
        return np.array([p for _, p in self.rows], np.int64)  # [R]

    def shuffled(self, rng) -> Step:
        order = rng.permutation(len(self.rows))
        return Step([self.rows[i] for i in order], self.qkv[:, order])


def _step(rng, rows: list[tuple[int, int]], hq: int, hkv: int, d: int) -> Step:
    return Step(rows, (2.0 * rng.standard_normal((1, len(rows), (hq + 2 * hkv) * d))).astype(np.float32))


def _run_rows(sess, step: Step, caches, cos, sin):
    return sess.run(None, {"qkv": step.qkv, "pk": caches[0], "pv": caches[1], "row_slot": step.slot,
                           "row_pos": step.pos, "cos": cos, "sin": sin})


def _run_alone(sess, step: Step, slot: int, caches, cos, sin):
    """SekAttention on `slot` alone: a [1, H_kv, S, D] copy of its caches, its rows in position order (consecutive),
    past_len = the first position -> (out [1, T, H_q D], present_key, present_value, the rows' indices in step)."""
    idx = sorted((i for i, (s, _) in enumerate(step.rows) if s == slot), key=lambda i: step.rows[i][1])
    pos = [step.rows[i][1] for i in idx]
    assert pos == list(range(pos[0], pos[0] + len(pos))), pos
    out, pk, pv = sess.run(None, {"qkv": step.qkv[:, idx], "pk": caches[0][slot:slot + 1].copy(),
                                  "pv": caches[1][slot:slot + 1].copy(), "cos": cos, "sin": sin,
                                  "past_len": np.array([pos[0]], np.int64)})
    return out, pk, pv, idx


HEADS = [(4, 2, 64), (8, 1, 64), (4, 2, 128), (8, 1, 128), (12, 2, 128)]  # (H_q, H_kv, D)


@pytest.mark.parametrize("kv", ALL_KV)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_every_row_has_the_bits_of_its_slot_run_alone(hq, hkv, d, kv):
    """Rows of three slots and padding, in three orders: each row's output and each slot's cache equal
    SekAttention's on that slot alone, bitwise (slot 2's rows read three 64-position chunks), with fp32, fp16 and
    int8 caches."""
    N, S = 3, 160
    rng = np.random.default_rng(hq * 1000 + hkv * 10 + d)
    caches = _caches(rng, N, hkv, S, d, [5, 0, 130], kv)
    before = [c.copy() for c in caches]
    cos, sin = _rope_tables(S, d)
    rows = [(0, 5), (0, 6), (0, 7), (2, 130), (2, 131), (1, 0), (PAD, 0), (PAD, 3), (PAD, 0)]
    step = _step(rng, rows, hq, hkv, d)
    sek = _session(_attention_model("SekAttention", hq, hkv, d, KV_TYPES[kv]))
    row_op = _session(_row_model(hq, hkv, d, kv=kv))
    alone = {s: _run_alone(sek, step, s, caches, cos, sin) for s in range(N)}
    for order in (step, step.shuffled(np.random.default_rng(1)), step.shuffled(np.random.default_rng(2))):
        out, pk, pv = _run_rows(row_op, order, caches, cos, sin)
        assert out.shape == (1, len(rows), hq * d) and pk.shape == pv.shape == caches[0].shape
        for s, (ref, rk, rv, idx) in alone.items():
            assert np.isfinite(ref).all()  # no query read a NaN row
            assert np.array_equal(_bits(pk[s:s + 1]), _bits(rk)) and np.array_equal(_bits(pv[s:s + 1]), _bits(rv)), s
            for t, i in enumerate(idx):
                r = order.rows.index(step.rows[i])  # where that row sits in this order
                assert np.array_equal(_bits(out[0, r]), _bits(ref[0, t])), (s, step.rows[i])
        for r, (s, _) in enumerate(order.rows):
            if s == PAD:
                assert not out[0, r].any()
    for c, b in zip(caches, before):  # present is not bound to the past here: the past stays as it was
        assert np.array_equal(_bits(c), _bits(b))


@pytest.mark.parametrize("kv", ALL_KV)
def test_a_slots_rows_in_one_step_equal_them_in_two_steps(kv):
    """The chain: a slot's rows at positions 70..74 in one step, or 70, 71 then 72..74 (other slots' rows and
    padding around them), give the same outputs and caches, bitwise."""
    hq, hkv, d, N, S = 8, 2, 64, 2, 128
    rng = np.random.default_rng(3)
    caches = _caches(rng, N, hkv, S, d, [70, 20], kv)
    cos, sin = _rope_tables(S, d)
    sess = _session(_row_model(hq, hkv, d, kv=kv))
    whole = _step(rng, [(0, 70), (0, 71), (0, 72), (0, 73), (0, 74)], hq, hkv, d)
    out, pk, pv = _run_rows(sess, whole, caches, cos, sin)
    other = _step(rng, [(1, 20), (PAD, 0)], hq, hkv, d)
    first = Step(whole.rows[:2] + other.rows, np.concatenate([whole.qkv[:, :2], other.qkv], axis=1))
    o1, k1, v1 = _run_rows(sess, first, caches, cos, sin)
    second = Step([(PAD, 5)] + whole.rows[2:], np.concatenate([other.qkv[:, 1:], whole.qkv[:, 2:]], axis=1))
    o2, k2, v2 = _run_rows(sess, second, [k1, v1], cos, sin)
    assert np.array_equal(_bits(o1[0, :2]), _bits(out[0, :2]))
    assert np.array_equal(_bits(o2[0, 1:]), _bits(out[0, 2:]))
    assert np.array_equal(_bits(k2[0]), _bits(pk[0])) and np.array_equal(_bits(v2[0]), _bits(pv[0]))
    assert np.array_equal(_bits(k2[1, :, :21]), _bits(k1[1, :, :21]))  # slot 1's row 20 from the first step, kept


def test_padding_rows_give_zeros_and_write_nothing():
    hq, hkv, d, N, S = 4, 2, 64, 2, 96
    rng = np.random.default_rng(6)
    caches = _caches(rng, N, hkv, S, d, [10, 30])
    cos, sin = _rope_tables(S, d)
    sess = _session(_row_model(hq, hkv, d))
    pad = _step(rng, [(PAD, 0), (PAD, -7), (PAD, 10 ** 12)], hq, hkv, d)  # a padding row's position is not read
    out, pk, pv = _run_rows(sess, pad, caches, cos, sin)
    assert out.shape == (1, 3, hq * d) and not out.any()
    assert np.array_equal(_bits(pk), _bits(caches[0])) and np.array_equal(_bits(pv), _bits(caches[1]))
    mixed = _step(rng, [(PAD, 4), (1, 30), (PAD, 30)], hq, hkv, d)
    out, pk, pv = _run_rows(sess, mixed, caches, cos, sin)
    assert not out[0, 0].any() and not out[0, 2].any() and np.isfinite(out[0, 1]).all() and out[0, 1].any()
    assert np.array_equal(_bits(pk[0]), _bits(caches[0][0]))
    assert np.array_equal(_bits(np.delete(pk[1], 30, axis=1)), _bits(np.delete(caches[0][1], 30, axis=1)))
    empty = _run_rows(sess, _step(rng, [], hq, hkv, d), caches, cos, sin)
    assert empty[0].shape == (1, 0, hq * d) and np.array_equal(_bits(empty[1]), _bits(caches[0]))


@pytest.mark.parametrize("kv", ALL_KV)
def test_the_cache_bound_as_present_is_written_in_place(kv):
    """present bound to the past's buffers (as the runtime binds them): the step writes the caches themselves, with
    the bits of a step whose present is a copy."""
    hq, hkv, d, N, S = 4, 1, 64, 2, 64
    rng = np.random.default_rng(9)
    caches = _caches(rng, N, hkv, S, d, [3, 8], kv)
    cos, sin = _rope_tables(S, d)
    sess = _session(_row_model(hq, hkv, d, kv=kv))
    step = _step(rng, [(1, 8), (0, 3), (PAD, 0), (1, 9)], hq, hkv, d)
    ref, rk, rv = _run_rows(sess, step, caches, cos, sin)
    kv = [c.copy() for c in caches]
    io = sess.io_binding()
    values = [ort.OrtValue.ortvalue_from_numpy(c) for c in kv]
    out = np.zeros((1, 4, hq * d), np.float32)
    for name, arr in (("qkv", step.qkv), ("row_slot", step.slot), ("row_pos", step.pos), ("cos", cos), ("sin", sin)):
        io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
    io.bind_ortvalue_input("pk", values[0])
    io.bind_ortvalue_input("pv", values[1])
    io.bind_ortvalue_output("out", ort.OrtValue.ortvalue_from_numpy(out))
    io.bind_ortvalue_output("presk", values[0])
    io.bind_ortvalue_output("presv", values[1])
    sess.run_with_iobinding(io)
    assert np.array_equal(_bits(out), _bits(ref))
    assert np.array_equal(_bits(kv[0]), _bits(rk)) and np.array_equal(_bits(kv[1]), _bits(rv))


def test_bad_rows_are_refused_with_what_was_given_and_what_is_allowed():
    hq, hkv, d, N, S = 4, 2, 64, 3, 96
    rng = np.random.default_rng(10)
    caches = _caches(rng, N, hkv, S, d, [10, 10, 10])
    cos, sin = _rope_tables(S, d)
    sess = _session(_row_model(hq, hkv, d))

    def run(rows, tables=(cos, sin)):
        return _run_rows(sess, _step(rng, rows, hq, hkv, d), caches, *tables)

    with pytest.raises(Exception, match=r"row 1 names KV slot 3; the caches hold 3 slots \(0\.\.2\), and -1 marks"):
        run([(0, 10), (3, 0)])
    with pytest.raises(Exception, match=r"row 0 names KV slot -2"):
        run([(-2, 10)])
    with pytest.raises(Exception, match=r"row 1 \(slot 2\) is at position 96; positions are 0\.\.95 \(the caches "
                                        r"hold 96 rows, the rotary tables 96\)"):
        run([(0, 10), (2, 96)])
    with pytest.raises(Exception, match=r"row 0 \(slot 0\) is at position -1"):
        run([(0, -1)])
    with pytest.raises(Exception, match=r"position 50; positions are 0\.\.39 \(the caches hold 96 rows, the rotary "
                                        r"tables 40\)"):
        run([(1, 50)], (cos[:40], sin[:40]))
    with pytest.raises(Exception, match=r"rows 0 and 2 both write slot 1 at position 12"):
        run([(1, 12), (0, 12), (1, 12), (PAD, 12), (PAD, 12)])
    with pytest.raises(Exception, match=r"row_slot holds 2 values and row_pos 2; qkv has 3 rows"):
        sess.run(None, {"qkv": _step(rng, [(0, 10)] * 3, hq, hkv, d).qkv, "pk": caches[0], "pv": caches[1],
                        "row_slot": np.array([0, 0], np.int64), "row_pos": np.array([10, 11], np.int64),
                        "cos": cos, "sin": sin})
    any_width = _session(_row_model(hq, hkv, d, width="W"))
    with pytest.raises(Exception, match=r"qkv width 500, caches \[3, 2, 96, 64\]"):  # (4 + 2 x 2) x 64 is 512
        any_width.run(None, {"qkv": np.zeros((1, 1, 500), np.float32), "pk": caches[0], "pv": caches[1],
                             "row_slot": np.zeros(1, np.int64), "row_pos": np.zeros(1, np.int64), "cos": cos,
                             "sin": sin})
    with pytest.raises(Exception, match=r"num_heads 6 must be a multiple of kv_num_heads 4"):
        _session(_row_model(6, 4, d))


# A tree of 8 nodes under a root r: node (parent, token's qkv row). Depths: a, b, c 1; d, e 2; f 3; g 4; h 2.
TREE = [(-1, "r"), (0, "a"), (0, "b"), (1, "d"), (0, "c"), (1, "e"), (3, "f"), (6, "g"), (2, "h")]


def _tree_paths(parents: list[int]) -> list[list[int]]:
    """Every node's path from the root (the root's own: [0])."""
    paths = []
    for i, p in enumerate(parents):
        paths.append([i] if p < 0 else paths[p] + [i])
    return paths


@pytest.mark.parametrize("hq,hkv,d,kv", [(4, 2, 64, np.float32), (8, 1, 128, np.float32), (12, 2, 128, np.float32),
                                         (12, 2, 128, np.float16), (12, 2, 128, np.int8)])
@pytest.mark.parametrize("root", [0, 5, 60, 63, 64, 127, 130])
def test_a_tree_row_has_the_bits_of_its_path_decoded_as_a_chain(hq, hkv, d, kv, root):
    """Tree rows (row_parent): each node's output, and the K/V it writes, equal bitwise those of its path from the
    root run as a chain at consecutive positions; the root sits at any position (its rows read up to three chunks,
    the tree's rows fall on both sides of a chunk boundary), the nodes are written at rows past it in step order, and
    another slot's chain shares the step."""
    N, S = 2, 200
    rng = np.random.default_rng(root * 7 + d)
    caches = _caches(rng, N, hkv, S, d, [root, 40], kv)
    cos, sin = _rope_tables(S, d)
    sess, plain = _session(_row_model(hq, hkv, d, tree=True, kv=kv)), _session(_row_model(hq, hkv, d, kv=kv))
    parents = [p for p, _ in TREE]
    qkv = (2.0 * rng.standard_normal((1, len(TREE), (hq + 2 * hkv) * d))).astype(np.float32)
    other = _step(rng, [(1, 40), (1, 41)], hq, hkv, d)
    step = Step([(0, root + i) for i in range(len(TREE))] + other.rows, np.concatenate([qkv, other.qkv], axis=1))
    feeds = {"qkv": step.qkv, "pk": caches[0], "pv": caches[1], "row_slot": step.slot, "row_pos": step.pos,
             "row_parent": np.array(parents + [-1, -1], np.int64), "cos": cos, "sin": sin}
    out, pk, pv = sess.run(None, feeds)
    for path in _tree_paths(parents):
        chain = Step([(0, root + j) for j in range(len(path))], qkv[:, path])
        co, ck, cv = _run_rows(plain, chain, caches, cos, sin)
        node = path[-1]
        assert np.isfinite(co).all()
        assert np.array_equal(_bits(out[0, node]), _bits(co[0, -1])), path
        at, there = root + node, root + len(path) - 1  # where the tree wrote the node; where the chain did
        assert np.array_equal(_bits(pk[0, :, at]), _bits(ck[0, :, there])), path
        assert np.array_equal(_bits(pv[0, :, at]), _bits(cv[0, :, there])), path
    alone = _run_rows(plain, other, caches, cos, sin)  # the other slot's rows: as they are without the tree
    assert np.array_equal(_bits(out[0, len(TREE):]), _bits(alone[0][0]))
    flat = dict(feeds, row_parent=np.full(len(step.rows), -1, np.int64))  # row_parent all -1: the plain rows op
    assert np.array_equal(_bits(sess.run(None, flat)[0]), _bits(_run_rows(plain, step, caches, cos, sin)[0]))


@pytest.mark.parametrize("kv", ALL_KV)
@pytest.mark.parametrize("window", [7, 20, 64, 100])
def test_with_a_sliding_window_every_row_and_tree_node_keeps_its_bits(kv, window):
    """A sliding window (a local layer's): rows of three slots and padding each equal SekAttention's with the same
    window on that slot alone, and tree nodes their path decoded as a chain, bitwise; the window changes what a
    row attends to wherever it is shorter than the row's context."""
    hq, hkv, d, N, S = 8, 2, 64, 3, 200
    rng = np.random.default_rng(window)
    caches = _caches(rng, N, hkv, S, d, [5, 70, 130], kv)
    cos, sin = _rope_tables(S, d)
    rows = [(0, 5), (0, 6), (2, 130), (2, 131), (2, 132), (1, 70), (PAD, 0)]
    step = _step(rng, rows, hq, hkv, d)
    sek = _session(_attention_model("SekAttention", hq, hkv, d, KV_TYPES[kv], window=window))
    row_op = _session(_row_model(hq, hkv, d, kv=kv, window=window))
    out = _run_rows(row_op, step.shuffled(np.random.default_rng(3)), caches, cos, sin)[0]
    order = step.shuffled(np.random.default_rng(3))
    full = _run_rows(_session(_row_model(hq, hkv, d, kv=kv)), order, caches, cos, sin)[0]
    for s in range(N):
        ref, _, _, idx = _run_alone(sek, step, s, caches, cos, sin)
        for t, i in enumerate(idx):
            r = order.rows.index(step.rows[i])
            assert np.array_equal(_bits(out[0, r]), _bits(ref[0, t])), (s, step.rows[i])
            assert np.array_equal(out[0, r], full[0, r]) == (step.rows[i][1] < window), step.rows[i]
    tree = _session(_row_model(hq, hkv, d, tree=True, kv=kv, window=window))
    plain = row_op
    parents = [p for p, _ in TREE]
    root = 130
    qkv = (2.0 * rng.standard_normal((1, len(TREE), (hq + 2 * hkv) * d))).astype(np.float32)
    tstep = Step([(2, root + i) for i in range(len(TREE))], qkv)
    tout = tree.run(None, {"qkv": qkv, "pk": caches[0], "pv": caches[1], "row_slot": tstep.slot,
                           "row_pos": tstep.pos, "row_parent": np.array(parents, np.int64), "cos": cos,
                           "sin": sin})[0]
    for path in _tree_paths(parents):
        chain = Step([(2, root + j) for j in range(len(path))], qkv[:, path])
        co = _run_rows(plain, chain, caches, cos, sin)[0]
        assert np.array_equal(_bits(tout[0, path[-1]]), _bits(co[0, -1])), path


def test_bad_tree_rows_are_refused_with_what_was_given_and_what_is_allowed():
    hq, hkv, d, N, S = 4, 2, 64, 2, 160
    rng = np.random.default_rng(11)
    caches = _caches(rng, N, hkv, S, d, [10, 10])
    cos, sin = _rope_tables(S, d)
    sess = _session(_row_model(hq, hkv, d, tree=True))

    def run(rows, parents):
        step = _step(rng, rows, hq, hkv, d)
        return sess.run(None, {"qkv": step.qkv, "pk": caches[0], "pv": caches[1], "row_slot": step.slot,
                               "row_pos": step.pos, "row_parent": np.array(parents, np.int64), "cos": cos, "sin": sin})

    allowed = r"a parent is -1 \(none\) or an earlier row of the same slot at a lower position"
    with pytest.raises(Exception, match=r"row 1 \(slot 0, position 11\) names row 1 as its parent; " + allowed):
        run([(0, 10), (0, 11)], [-1, 1])
    with pytest.raises(Exception, match=r"row 0 \(slot 0, position 10\) names row 1 as its parent"):
        run([(0, 10), (0, 11)], [1, -1])
    with pytest.raises(Exception, match=r"row 1 \(slot 1, position 11\) names row 0"):
        run([(0, 10), (1, 11)], [-1, 0])
    with pytest.raises(Exception, match=r"row 1 \(slot 0, position 9\) names row 0"):
        run([(0, 10), (0, 9)], [-1, 0])
    with pytest.raises(Exception, match=r"names row -2"):
        run([(0, 10), (0, 11)], [-1, -2])
    with pytest.raises(Exception, match=r"row 65 lies 65 rows below its root; tree rows lie at most 64 below it"):
        run([(0, 10 + i) for i in range(67)], [-1] + list(range(66)))
    with pytest.raises(Exception, match=r"row_parent holds 1 values \(rank 1\); qkv has 2 rows"):
        run([(0, 10), (0, 11)], [-1])


# fp32 values and the fp16 each must become, rounded to nearest even: ties, subnormals, the edges of the range
_F16_EDGES = np.array([0.0, -0.0, 1.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -11 + 2 ** -20, 2 ** -14, 2 ** -15,
                       2 ** -24, 2 ** -25, 1.5 * 2 ** -25, 3 * 2 ** -25, 2 ** -26, 2 ** -14 - 2 ** -25, 1e-40, -1e-30,
                       65504.0, 65519.0, 65519.996, 65520.0, 1e10, -1e10, np.inf, -np.inf, -3.0, 6.1e-5],
                      np.float32)


def test_an_fp16_cache_holds_each_new_row_rounded_to_nearest_even():
    """A step over fp16 caches writes each new k (rotated) and v row as the fp32 step's row rounded to the nearest
    fp16, ties to even, bitwise numpy's rounding: ties, subnormals, overflow to infinity and the signs of zero and
    infinity included; a NaN stays a NaN."""
    hq, hkv, d, S, past, T = 4, 2, 64, 96, 20, 3
    rng = np.random.default_rng(21)
    caches = [np.zeros((1, hkv, S, d), np.float16) for _ in range(2)]
    for c in caches:
        c[:, :, :past] = rng.standard_normal((1, hkv, past, d))
    cos, sin = _rope_tables(S, d)
    qkv = (rng.standard_normal((1, T, (hq + 2 * hkv) * d)) * 10.0 ** rng.integers(-7, 5, (1, T, 1))).astype(np.float32)
    v = qkv[0, 0, (hq + hkv) * d:].copy()  # row 0's v: the edge values, then NaN, in every kv head
    v[: len(_F16_EDGES)], v[len(_F16_EDGES)] = _F16_EDGES, np.nan
    v[d: d + len(_F16_EDGES)] = -_F16_EDGES
    qkv[0, 0, (hq + hkv) * d:] = v
    feeds = {"qkv": qkv, "cos": cos, "sin": sin, "past_len": np.array([past], np.int64)}
    half = _session(_attention_model("SekAttention", hq, hkv, d, TensorProto.FLOAT16))
    full = _session(_attention_model("SekAttention", hq, hkv, d))
    _, k16, v16 = half.run(None, {**feeds, "pk": caches[0], "pv": caches[1]})
    _, k32, v32 = full.run(None, {**feeds, "pk": caches[0].astype(np.float32), "pv": caches[1].astype(np.float32)})
    assert k16.dtype == v16.dtype == np.float16
    for got, ref, before, nans in ((k16, k32, caches[0], 0), (v16, v32, caches[1], 1)):
        new, want = got[:, :, past: past + T], ref[:, :, past: past + T].astype(np.float16)
        nan = np.isnan(want)
        assert nan.sum() == nans and np.array_equal(np.isnan(new), nan)
        assert np.array_equal(_bits(np.where(nan, 0, new)), _bits(np.where(nan, 0, want)))
        assert np.array_equal(_bits(got[:, :, :past]), _bits(before[:, :, :past]))
    edges = v16[0, 0, past, : len(_F16_EDGES)]
    assert np.isposinf(edges[19]) and edges[18] == 65504 and edges[9] == 0 and edges[11] == 2 ** -23  # ties: even
    assert np.signbit(edges[1]) and np.isneginf(v16[0, 1, past, 19])


def fp16_against_fp32(hq: int, hkv: int, d: int, seed: int) -> tuple[bool, float]:
    """SekAttention over fp16 caches and over fp32 caches holding the same values, a 5-row step at 250 past rows:
    (whether the outputs are bitwise equal when the step's new rows are fp16 values too (their rotation the identity:
    cos 1, sin 0), the largest difference relative to the fp32 output when they are not (a real rotation))."""
    S, past, T = 320, 250, 5
    rng = np.random.default_rng(seed)
    c16 = [rng.standard_normal((1, hkv, S, d)).astype(np.float16) for _ in range(2)]
    cos, sin = _rope_tables(S, d)
    qkv = (2.0 * rng.standard_normal((1, T, (hq + 2 * hkv) * d))).astype(np.float16).astype(np.float32)
    half = _session(_attention_model("SekAttention", hq, hkv, d, TensorProto.FLOAT16))
    full = _session(_attention_model("SekAttention", hq, hkv, d))

    def both(cos, sin):
        feeds = {"qkv": qkv, "cos": cos, "sin": sin, "past_len": np.array([past], np.int64)}
        o16 = half.run(None, {**feeds, "pk": c16[0].copy(), "pv": c16[1].copy()})[0]
        o32 = full.run(None, {**feeds, "pk": c16[0].astype(np.float32), "pv": c16[1].astype(np.float32)})[0]
        assert o16.dtype == np.float32 and np.isfinite(o16).all()
        return o16, o32

    still_c, still_s = cos.copy(), sin.copy()
    still_c[past: past + T], still_s[past: past + T] = 1.0, 0.0
    o16, o32 = both(still_c, still_s)
    exact = np.array_equal(o16.view(np.uint32), o32.view(np.uint32))
    o16, o32 = both(cos, sin)
    return exact, float(np.abs(o16 - o32).max() / np.abs(o32).max())


@pytest.mark.parametrize("hq,hkv,d", [(12, 2, 128), (8, 1, 64), (4, 4, 80)])
def test_an_fp16_cache_attends_as_fp32_does_over_the_same_values(hq, hkv, d):
    """Queries read an fp16 cache exactly: over fp16 rows the output has the bits of the same step over an fp32
    cache holding those values; with rows it rounds (the step's own, rotated) it stays near."""
    exact, rel = fp16_against_fp32(hq, hkv, d, seed=d + hq)
    assert exact
    assert 0 < rel < 2e-3, rel


def test_an_int8_cache_holds_each_new_row_quantized_as_its_contract_says():
    """A step over int8 caches writes each new k (rotated) and v row as the fp32 step's row quantized (quantize_rows,
    numpy's rounding to nearest even), bitwise: halves that tie, a row of zeros (scale 0), a row with an infinity
    and one with a NaN (scale NaN) among rows of magnitudes from 1e-30 to 1e30; the rows before stay as they were."""
    hq, hkv, d, S, past, T = 4, 2, 64, 96, 20, 6
    rng = np.random.default_rng(22)
    cos, sin = _rope_tables(S, d)
    qkv = rng.standard_normal((1, T, (hq + 2 * hkv) * d)) * 10.0 ** rng.integers(-30, 30, (1, T, 1))
    qkv = qkv.astype(np.float32)
    v = qkv[0, :, (hq + hkv) * d:]  # each row's v: [T, hkv d]
    v[0, :d] = np.resize([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 3.25], d)  # scale 1: ties go to even
    v[0, d:] = np.arange(d)  # scale 63 / 127: the largest 127 units
    v[1, :d], v[2, 3], v[3, d + 5] = 0.0, np.inf, np.nan
    feeds = {"qkv": qkv, "cos": cos, "sin": sin, "past_len": np.array([past], np.int64)}
    before = _caches(rng, 1, hkv, S, d, [past], np.int8)
    _, k8, v8 = _session(_attention_model("SekAttention", hq, hkv, d, TensorProto.INT8)).run(
        None, {**feeds, "pk": before[0], "pv": before[1]})
    _, k32, v32 = _session(_attention_model("SekAttention", hq, hkv, d)).run(
        None, {**feeds, "pk": np.zeros((1, hkv, S, d), np.float32), "pv": np.zeros((1, hkv, S, d), np.float32)})
    assert k8.dtype == v8.dtype == np.int8 and k8.shape == (1, hkv, S, d + 4)
    for got, ref, was in ((k8, k32, before[0]), (v8, v32, before[1])):
        assert np.array_equal(_bits(got[:, :, past: past + T]), _bits(quantize_rows(ref[:, :, past: past + T])))
        assert np.array_equal(_bits(got[:, :, :past]), _bits(was[:, :, :past]))
    rows = dequantize_rows(v8[0, :, past: past + T])  # [hkv, T, d]
    assert list(v8[0, 0, past, :8]) == [127, 2, -4, 0, 0, 2, -126, 3] and v8[0, 1, past, d - 1] == 127
    assert not rows[0, 1].any() and v8[0, 0, past + 1, d:].view(np.float32) == 0
    assert np.isnan(rows[0, 2]).all() and np.isnan(rows[1, 3]).all() and np.isfinite(rows[1, 2]).all()


def int8_against_fp32(hq: int, hkv: int, d: int, seed: int) -> tuple[bool, float]:
    """SekAttention over int8 caches and over fp32 caches holding the values they hold, a 5-row step at 250 past
    rows: (whether the outputs are bitwise equal when the step's new rows are themselves int8 rows' values (steps
    of 1/16, 127 of them the largest: requantized exactly) and unrotated, the largest difference relative to the
    fp32 output over the rows themselves (the fp32 cache holding them unquantized) when they are random and
    rotated)."""
    S, past, T = 320, 250, 5
    rng = np.random.default_rng(seed)
    c8 = [quantize_rows(rng.standard_normal((1, hkv, S, d))) for _ in range(2)]
    cos, sin = _rope_tables(S, d)
    i8 = _session(_attention_model("SekAttention", hq, hkv, d, TensorProto.INT8))
    full = _session(_attention_model("SekAttention", hq, hkv, d))

    def both(qkv, cos, sin):
        feeds = {"qkv": qkv, "cos": cos, "sin": sin, "past_len": np.array([past], np.int64)}
        o8 = i8.run(None, {**feeds, "pk": c8[0].copy(), "pv": c8[1].copy()})[0]
        o32 = full.run(None, {**feeds, "pk": dequantize_rows(c8[0]), "pv": dequantize_rows(c8[1])})[0]
        assert o8.dtype == np.float32 and np.isfinite(o8).all()
        return o8, o32

    exact_rows = rng.integers(-126, 127, (1, T, (hq + 2 * hkv) * d)).astype(np.float32)
    exact_rows.reshape(1, T, -1, d)[..., 0] = 127  # every head's row: its largest value 127 steps
    still_c, still_s = cos.copy(), sin.copy()
    still_c[past: past + T], still_s[past: past + T] = 1.0, 0.0
    o8, o32 = both(exact_rows / np.float32(16), still_c, still_s)
    exact = np.array_equal(o8.view(np.uint32), o32.view(np.uint32))
    o8, o32 = both((2.0 * rng.standard_normal((1, T, (hq + 2 * hkv) * d))).astype(np.float32), cos, sin)
    return exact, float(np.abs(o8 - o32).max() / np.abs(o32).max())


@pytest.mark.parametrize("hq,hkv,d", [(12, 2, 128), (8, 1, 64), (4, 4, 80)])
def test_an_int8_cache_attends_as_fp32_does_over_the_values_it_holds(hq, hkv, d):
    """Queries read an int8 cache as q * scale: over rows it holds exactly the output has the bits of the same step
    over an fp32 cache holding those values; with rows it quantizes (the step's own, rotated) it stays near."""
    exact, rel = int8_against_fp32(hq, hkv, d, seed=d + hq)
    assert exact
    assert 0 < rel < 3e-2, rel


def _biased_keys(rng, hq: int, hkv: int, d: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """qkv [1, T, (H_q + 2 H_kv) D] whose keys carry a fixed bias of a few hundred in each head's slowest-turning
    dims, as Qwen2's first layers do, over keys that vary by about 2; and the bias [H_kv D]."""
    bias = np.zeros((hkv, d), np.float32)
    for half in (0, d // 2):
        bias[:, half + d // 2 - 6: half + d // 2] = rng.uniform(-350, 350, (hkv, 6))
    qkv = (2.0 * rng.standard_normal((1, T, (hq + 2 * hkv) * d))).astype(np.float32)
    qkv[0, :, hq * d: (hq + hkv) * d] += bias.reshape(-1)
    return qkv, bias.reshape(-1)


@pytest.mark.parametrize("kv", [np.float16, np.int8])
def test_a_key_shift_keeps_the_attention_and_gives_a_small_cache_what_varies(kv):
    """A key shift (the keys' bias rotated as the cache's rows are and averaged over the positions, export's
    key_shift) is subtracted from every key stored: the softmax is the same (fp32 output within rounding, rows
    stored less the shift), and an fp16 or int8 cache, whose rows now hold what varies between keys, comes far
    nearer the fp32 output than without it. Every row keeps its bits alone and through SekRowAttention."""
    from specedge.export.attention import key_shift

    hq, hkv, d, S, T = 12, 2, 128, 320, 260
    rng = np.random.default_rng(31)
    cos, sin = _rope_tables(S, d)
    qkv, bias = _biased_keys(rng, hq, hkv, d, T)
    shift = key_shift(bias, hkv, d, cos.astype(np.float64).mean(0), sin.astype(np.float64).mean(0))
    assert shift.shape == (hkv * d,) and np.abs(shift).max() > 100
    b, c, s_ = bias.reshape(hkv, 1, d).astype(np.float64), cos.astype(np.float64), sin.astype(np.float64)
    lo, hi = b[..., :d // 2], b[..., d // 2:]
    turned = np.concatenate([lo * c - hi * s_, hi * c + lo * s_], -1)
    assert np.allclose(shift, turned.mean(1).reshape(-1), atol=1e-3)  # the bias as each position turns it, averaged

    def run(k, shift_=None, rows=False):
        F = KV_TYPES[k]
        caches = [np.zeros((1, hkv, S, cache_width(d, k)), k) for _ in range(2)]
        if rows:
            return _session(_row_model(hq, hkv, d, kv=k, k_shift=shift_)).run(None, {
                "qkv": qkv, "pk": caches[0], "pv": caches[1], "row_slot": np.zeros(T, np.int64),
                "row_pos": np.arange(T, dtype=np.int64), "cos": cos, "sin": sin})
        return _session(_attention_model("SekAttention", hq, hkv, d, F, k_shift=shift_)).run(
            None, {"qkv": qkv, "pk": caches[0], "pv": caches[1], "cos": cos, "sin": sin,
                   "past_len": np.array([0], np.int64)})

    plain, rk, rv = run(np.float32)
    ref = _windowed_reference(qkv, rk, rv, cos, sin, hq, hkv, d, 0, 0)  # float64 over the unshifted keys

    def err(x):
        return float(np.abs(x[0] - ref).max() / np.abs(ref).max())

    out, sk, _ = run(np.float32, shift)
    assert err(out) < 1e-5 and err(out) <= 2 * err(plain), (err(out), err(plain))  # scores of thousands: fp32's ulps
    assert np.allclose(sk[:, :, :T], rk[:, :, :T] - shift.reshape(1, hkv, 1, d), atol=1e-4)
    small, _, _ = run(kv)
    shifted, kc, vc = run(kv, shift)
    assert err(shifted) < 0.2 * err(small), (err(small), err(shifted))
    assert np.array_equal(_bits(run(kv, shift, rows=True)[0]), _bits(shifted))
    sek = _session(_attention_model("SekAttention", hq, hkv, d, KV_TYPES[kv], k_shift=shift))
    for t in (0, 63, 64, T - 1):  # alone over the rows the step stored: its bits
        o = sek.run(None, {"qkv": qkv[:, t:t + 1], "pk": kc.copy(), "pv": vc.copy(), "cos": cos, "sin": sin,
                           "past_len": np.array([t], np.int64)})[0]
        assert np.array_equal(_bits(o[0, 0]), _bits(shifted[0, t])), t


def test_a_bad_key_shift_is_refused_with_what_is_allowed():
    hq, hkv, d = 4, 2, 64
    with pytest.raises(Exception, match="not all finite"):
        _session(_attention_model("SekAttention", hq, hkv, d, k_shift=np.full(hkv * d, np.nan)))
    with pytest.raises(Exception, match="not allowed with softcap"):
        _session(_attention_model("SekAttention", hq, hkv, d, softcap=30.0, k_shift=np.ones(hkv * d)))
    cos, sin = _rope_tables(16, d)
    caches = [np.zeros((1, hkv, 16, d), np.float32) for _ in range(2)]
    qkv = np.ones((1, 2, (hq + 2 * hkv) * d), np.float32)
    with pytest.raises(Exception, match=r"k_shift holds 64 values; kv_num_heads x head dim is 128"):
        _session(_attention_model("SekAttention", hq, hkv, d, k_shift=np.ones(d))).run(None, {
            "qkv": qkv, "pk": caches[0], "pv": caches[1], "cos": cos, "sin": sin, "past_len": np.array([0])})
    with pytest.raises(Exception, match=r"k_shift holds 64 values; kv_num_heads x head dim is 128"):
        _session(_row_model(hq, hkv, d, k_shift=np.ones(d))).run(None, {
            "qkv": qkv, "pk": caches[0], "pv": caches[1], "row_slot": np.zeros(2, np.int64),
            "row_pos": np.arange(2, dtype=np.int64), "cos": cos, "sin": sin})


def test_caches_of_two_element_types_are_refused():
    """A node whose key and value caches differ in element type is refused when the session loads it (each
    attention op is registered for fp32, fp16 and int8 caches, both of one type)."""
    hq, hkv, d, S = 4, 2, 64, 32
    F, H = TensorProto.FLOAT, TensorProto.FLOAT16
    vi = helper.make_tensor_value_info
    node = helper.make_node("SekAttention", ["qkv", "pk", "pv", "past_len", "cos", "sin"], ["out", "presk", "presv"],
                            domain="ai.specedge", num_heads=hq, kv_num_heads=hkv, scale=0.125)
    g = helper.make_graph([node], "g", [vi("qkv", F, [1, 1, (hq + 2 * hkv) * d]), vi("pk", H, [1, hkv, S, d]),
                                        vi("pv", F, [1, hkv, S, d]), vi("past_len", TensorProto.INT64, [1]),
                                        vi("cos", F, [S, d // 2]), vi("sin", F, [S, d // 2])],
                          [vi("out", F, None), vi("presk", H, None), vi("presv", F, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.specedge", 1)])
    with pytest.raises(Exception, match=r"no kernel def matches node inputs for Op: SekAttention"):
        _session(model.SerializeToString())
