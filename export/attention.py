"""The two attention forms a graph can carry, chosen per bundle by its KV mode.

Both take the fused projection ``qkv`` [B, T, (Hq + 2 Hkv) D] of layer i (bias added) and
return the attention output [B, T, Hq D]; both write ``present.{i}.key|value``.

* ``portable`` (every backend, TensorRT included): plain ONNX ops. Scores against the whole
  cache [.., T, S_max] are masked to positions < past_len and joined with the causal scores
  against the T new rows for one softmax; the cache is read, never concatenated or repeated
  (GQA through a broadcast group axis G = Hq / Hkv). ``present`` holds only the T new rows;
  the runtime copies them into the cache. Cost grows with S_max, not with the valid length.
* ``ort-inplace`` (ONNX Runtime only): ``com.microsoft.GroupQueryAttention`` with the cache
  bound as both ``past_key_values.{i}.*`` and ``present.{i}.*`` (one buffer, [B, Hkv, S_max,
  D]). The op writes the T new rows at past_len itself, applies RoPE from cos/sin tables, and
  reads only the valid past_len + T rows. ``seqlens_k`` = past_len + T - 1 and
  ``total_sequence_length`` = past_len + T are computed in the graph from ``past_len``.
  In the specedge weight form the same contract is served by specedge's own op,
  ``ai.specedge.SekAttention`` (runtime/csrc/sek_attn.c), whose rows are the same at width 1
  as inside a wider step — GroupQueryAttention computes a lone row by other kernels.
* ``rows`` (the specedge form): ``ai.specedge.SekRowAttention`` over a pool of KV slots, each row of a step naming its
  slot and position (``row_slot``, ``row_pos`` instead of ``past_len``): rows of several sequences in one step.
"""

from __future__ import annotations

import functools

import numpy as np
from onnx import TensorProto, helper

from specedge.runtime.manifest import (
    KV_MODES,  # noqa: F401  (re-exported: the modes defined here)
    SEK_DOMAIN,
)


def rope_tables(w, inv_freq: np.ndarray, max_positions: int, prefix: str = "rope",
                mscale: float = 1.0) -> tuple[str, str]:
    """The cos and sin tables [positions, R/2] the in-place attentions rotate by (rotate-half over a head's first R
    dims: all of them but for a partial rotary), times LongRoPE's attention factor where it has one."""
    freqs = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq.astype(np.float64))  # [S_max, R/2]
    cos, sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
    if mscale != 1.0:
        cos, sin = cos * np.float32(mscale), sin * np.float32(mscale)
    return w.add(f"{prefix}.cos_cache", cos), w.add(f"{prefix}.sin_cache", sin)


def mean_rotation(inv_freq: np.ndarray, max_positions: int, mscale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The rotary tables' cos and sin averaged over positions 0 .. max_positions - 1 ([R/2] each)."""
    freqs = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq.astype(np.float64))
    return np.cos(freqs).mean(0) * mscale, np.sin(freqs).mean(0) * mscale


def key_shift(bias: np.ndarray, n_kv_heads: int, rot: int, mean_cos: np.ndarray, mean_sin: np.ndarray) -> np.ndarray:
    """A constant key bias rotated as the cache's rows are (rotate-half over the first ``rot`` dims of a head) and
    averaged over the positions: [Hkv * D] float32, the part of every cached key that the key bias fixes.

    A query's scores all move by q . shift when the shift is subtracted from every key, so its softmax is the same;
    an fp16 or int8 cache then holds what varies between keys. Qwen2's first layers carry biases of several hundred
    in their slowest-turning dims (a rotation of a few hundredths of a radian over 32k positions), against keys
    that vary by tens: the shift removes nearly all of it."""
    b = np.asarray(bias, np.float64).reshape(n_kv_heads, -1)
    h = rot // 2
    out = b.copy()
    out[:, :h] = b[:, :h] * mean_cos - b[:, h:rot] * mean_sin
    out[:, h:rot] = b[:, h:rot] * mean_cos + b[:, :h] * mean_sin
    return out.reshape(-1).astype(np.float32)


def identity_tables(w, half: int, max_positions: int) -> tuple[str, str]:
    """cos 1, sin 0 at every position: the tables of a layer without RoPE (smollm3's NoPE layers). The ops compute
    x cos + rot(x) sin, which is x exactly with these."""
    return (w.add("rope.identity_cos", np.ones((max_positions, half), np.float32)),
            w.add("rope.identity_sin", np.zeros((max_positions, half), np.float32)))


class PortableAttention:
    def __init__(self, g, w, cfg, inv_freq: np.ndarray):
        d = cfg.dims
        self.g, self.D, self.Hq, self.Hkv = g, d.head_dim, d.n_heads, d.n_kv_heads
        self.G = self.Hq // self.Hkv
        # ---- prologue shared by all layers: masks and RoPE tables ----
        T = g.op("Gather", g.op("Shape", "input_ids"), g.const(1), axis=0)  # scalar
        S = g.op("Gather", g.op("Shape", "past_key_values.0.key"), g.const(2), axis=0)  # scalar S_max
        ar_T = g.op("Range", g.const(0), T, g.const(1))  # [T]
        ar_S = g.op("Range", g.const(0), S, g.const(1))  # [S_max]
        past_col = g.op("Unsqueeze", "past_len", g.const([1]))  # [B, 1]
        mask_past = g.op("Less", g.op("Unsqueeze", ar_S, g.const([0])), past_col)  # [B, S_max]
        self.mask_past = g.op("Unsqueeze", mask_past, g.const([1, 2, 3]))  # [B, 1, 1, 1, S_max]
        mask_new = g.op("LessOrEqual", g.op("Unsqueeze", ar_T, g.const([0])), g.op("Unsqueeze", ar_T, g.const([1])))
        self.mask_new = g.op("Unsqueeze", mask_new, g.const([0, 1, 2]))  # [1, 1, 1, T, T]  (col j <= row t)
        self.neg_inf = g.const(-np.inf, np.float32)
        self.split_past_new = g.op("Concat", g.op("Unsqueeze", S, g.const([0])), g.op("Unsqueeze", T, g.const([0])),
                                   axis=0)  # [S_max, T]
        positions = g.op("Add", past_col, g.op("Unsqueeze", ar_T, g.const([0])))  # [B, T]
        pos_f = g.op("Unsqueeze", g.op("Cast", positions, to=TensorProto.FLOAT), g.const([2]))  # [B, T, 1]

        mscale = cfg.rope_mscale()

        def cos_sin(name: str, inv: np.ndarray) -> tuple[str, str]:
            freqs = g.op("Mul", pos_f, w.add(name, inv))  # [B, T, R/2]
            emb = g.op("Concat", freqs, freqs, axis=-1)  # [B, T, R]
            cos, sin = g.op("Cos", emb), g.op("Sin", emb)
            if mscale != 1.0:  # LongRoPE's attention factor on both
                m = g.const(np.float32(mscale), np.float32)
                cos, sin = g.op("Mul", cos, m), g.op("Mul", sin, m)
            return g.op("Unsqueeze", cos, g.const([2])), g.op("Unsqueeze", sin, g.const([2]))  # [B, T, 1, R]

        self.cos, self.sin = cos_sin("rope.inv_freq", inv_freq)
        self.local = (cos_sin("rope.local_inv_freq", cfg.local_inv_freq())
                      if any(cfg.is_local(i) for i in range(d.n_layers)) else None)
        self.is_local = cfg.is_local
        self.R = cfg.rot_dim()
        self.half = g.const([self.R // 2, self.R // 2])
        self.rot_pass = g.const([self.R, self.D - self.R]) if self.R < self.D else None
        self.qkv_split = g.const([self.Hq * self.D, self.Hkv * self.D, self.Hkv * self.D])
        self.scale = g.const(cfg.scores_scale(), np.float32)
        self.softcap = g.const(np.float32(cfg.attn_softcap), np.float32) if cfg.attn_softcap else None
        self.rotates = cfg.rotates
        self.window, self._windowed = cfg.window, {}
        self._t_minus_s = g.op("Sub", g.op("Unsqueeze", ar_T, g.const([1])), g.op("Unsqueeze", ar_S, g.const([0])))
        self._t_minus_t = g.op("Sub", g.op("Unsqueeze", ar_T, g.const([1])), g.op("Unsqueeze", ar_T, g.const([0])))
        self._past_col = past_col

    def _masks(self, window: int) -> tuple[str, str]:
        """The (past, new) masks of a layer with a sliding window of `window` positions (row t at position
        past_len + t sees cache position j where past_len + t - j < window), or of full attention (0)."""
        if not window:
            return self.mask_past, self.mask_new
        if window not in self._windowed:
            g, w = self.g, self.g.const(window)
            # past: j < past_len and t - j < window - past_len, [B, 1, 1, T, S_max]
            near = g.op("Less", self._t_minus_s, g.op("Unsqueeze", g.op("Sub", w, self._past_col), g.const([2])))
            past = g.op("And", self.mask_past, g.op("Unsqueeze", near, g.const([1, 2])))
            new = g.op("And", self.mask_new, g.op("Unsqueeze", g.op("Less", self._t_minus_t, w), g.const([0, 1, 2])))
            self._windowed[window] = (past, new)
        return self._windowed[window]

    def _rope(self, x: str, cos: str, sin: str) -> str:  # x [B, T, heads, D], rotate-half convention
        g = self.g
        if self.rot_pass is not None:  # a partial rotary: the first R dims rotate, the rest pass through
            x, rest = g.op("Split", x, self.rot_pass, axis=-1, n_out=2)
        x1, x2 = g.op("Split", x, self.half, axis=-1, n_out=2)
        rot = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
        out = g.op("Add", g.op("Mul", x, cos), g.op("Mul", rot, sin))
        return out if self.rot_pass is None else g.op("Concat", out, rest, axis=-1)

    def __call__(self, i: int, qkv: str) -> str:
        g, D, Hq, Hkv, G = self.g, self.D, self.Hq, self.Hkv, self.G
        q, k, v = g.op("Split", qkv, self.qkv_split, axis=-1, n_out=3)
        cos, sin = self.local if self.is_local(i) else (self.cos, self.sin)
        rope = (lambda x: self._rope(x, cos, sin)) if self.rotates(i) else (lambda x: x)
        q = rope(g.op("Reshape", q, g.const([0, 0, Hq, D])))  # [B, T, Hq, D]
        k = rope(g.op("Reshape", k, g.const([0, 0, Hkv, D])))  # [B, T, Hkv, D]
        v = g.op("Reshape", v, g.const([0, 0, Hkv, D]))
        k_new = g.op("Transpose", k, perm=[0, 2, 1, 3])  # [B, Hkv, T, D]
        v_new = g.op("Transpose", v, perm=[0, 2, 1, 3])
        g.nodes.append(helper.make_node("Identity", [k_new], [f"present.{i}.key"]))
        g.nodes.append(helper.make_node("Identity", [v_new], [f"present.{i}.value"]))

        q = g.op("Reshape", q, g.const([0, 0, Hkv, G, D]))
        q = g.op("Mul", g.op("Transpose", q, perm=[0, 2, 3, 1, 4]), self.scale)  # [B, Hkv, G, T, D]
        cap = (lambda s: g.op("Mul", g.op("Tanh", g.op("Div", s, self.softcap)), self.softcap)) if self.softcap else (
            lambda s: s)  # gemma2: scores c tanh(s / c)
        k_past = g.op("Unsqueeze", f"past_key_values.{i}.key", g.const([2]))  # [B, Hkv, 1, S_max, D]
        v_past = g.op("Unsqueeze", f"past_key_values.{i}.value", g.const([2]))
        s_past = cap(g.op("MatMul", q, g.op("Transpose", k_past, perm=[0, 1, 2, 4, 3])))  # [B, Hkv, G, T, S_max]
        s_new = cap(g.op("MatMul", q, g.op("Unsqueeze", g.op("Transpose", k, perm=[0, 2, 3, 1]), g.const([2]))))
        mask_past, mask_new = self._masks(self.window(i))
        s_past = g.op("Where", mask_past, s_past, self.neg_inf)
        s_new = g.op("Where", mask_new, s_new, self.neg_inf)  # [B, Hkv, G, T, T]
        probs = g.op("Softmax", g.op("Concat", s_past, s_new, axis=-1), axis=-1)
        p_past, p_new = g.op("Split", probs, self.split_past_new, axis=-1, n_out=2)
        attn = g.op("Add", g.op("MatMul", p_past, v_past),
                    g.op("MatMul", p_new, g.op("Unsqueeze", v_new, g.const([2]))))  # [B, Hkv, G, T, D]
        return g.op("Reshape", g.op("Transpose", attn, perm=[0, 3, 1, 2, 4]), g.const([0, 0, Hq * D]))


class _TableAttention:
    """What the in-place attentions share: the rotary tables (identity ones for a layer without RoPE) and the
    scores' scale."""

    def _tables(self, w, cfg, inv_freq: np.ndarray, max_positions: int) -> None:
        d = cfg.dims
        self.scores_scale = cfg.scores_scale()
        self.softcap = {"softcap": float(cfg.attn_softcap)} if cfg.attn_softcap else {}  # both ops' attribute
        self.cos, self.sin = rope_tables(w, inv_freq, max_positions, mscale=cfg.rope_mscale())
        self.rotates, self.is_local = cfg.rotates, cfg.is_local
        layers = range(d.n_layers)
        self.identity = (identity_tables(w, cfg.rot_dim() // 2, max_positions)
                         if not all(cfg.rotates(i) for i in layers) else None)
        self.local = (rope_tables(w, cfg.local_inv_freq(), max_positions, "rope.local")
                      if any(cfg.is_local(i) for i in layers) else None)
        self.window = lambda i: cfg.window(i, max_positions)  # noqa: E731
        self.rot = cfg.rot_dim()
        means = {  # each kind of layer's tables averaged over the positions, computed once when a layer asks
            "none": lambda: (np.ones(self.rot // 2), np.zeros(self.rot // 2)),
            "local": lambda: mean_rotation(cfg.local_inv_freq(), max_positions),
            "global": lambda: mean_rotation(inv_freq, max_positions, cfg.rope_mscale())}
        self.mean_rotation = functools.cache(lambda kind: means[kind]())
        self.table_kind = lambda i: "none" if not cfg.rotates(i) else "local" if cfg.is_local(i) else "global"  # noqa: E731

    def tables(self, i: int) -> tuple[str, str]:
        if not self.rotates(i):
            return self.identity
        return self.local if self.is_local(i) else (self.cos, self.sin)


class InplaceGqaAttention(_TableAttention):
    def __init__(self, g, w, cfg, inv_freq: np.ndarray, max_positions: int):
        d = cfg.dims
        self.g, self.D, self.Hq, self.Hkv = g, d.head_dim, d.n_heads, d.n_kv_heads
        T = g.op("Gather", g.op("Shape", "input_ids"), g.const(1), axis=0)  # scalar
        total = g.op("Add", "past_len", T)  # [B] past_len + T
        self.seqlens_k = g.op("Cast", g.op("Sub", total, g.const(1)), to=TensorProto.INT32)  # [B]
        self.total_len = g.op("Cast", g.op("ReduceMax", total, keepdims=0), to=TensorProto.INT32)  # scalar
        self._tables(w, cfg, inv_freq, max_positions)

    def __call__(self, i: int, qkv: str) -> str:
        g = self.g
        g._n += 1
        out = f"gqa_{g._n}"
        g.nodes.append(helper.make_node(
            "GroupQueryAttention",
            [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value", self.seqlens_k, self.total_len,
             *self.tables(i)],
            [out, f"present.{i}.key", f"present.{i}.value"], name=f"GroupQueryAttention_{g._n}",
            domain="com.microsoft", num_heads=self.Hq, kv_num_heads=self.Hkv, do_rotary=1, rotary_interleaved=0,
            scale=self.scores_scale, **self.softcap,
            **({"local_window_size": self.window(i)} if self.window(i) else {})))
        return out  # [B, T, Hq D]


class SekInplaceAttention(InplaceGqaAttention):
    """The ort-inplace contract (cache bound as past and present, new rows written at past_len, RoPE from the
    tables) through specedge's own attention op: every row's arithmetic is the same whatever the step's width,
    width 1 included (runtime/csrc/sek_attn.c), so with specedge's matmul the whole step is batch-invariant."""

    op, where, prefix = "SekAttention", ("past_len",), "sek_attn"  # the op, what places the rows, output names
    after: tuple[str, ...] = ()  # inputs after the rotary tables

    def __call__(self, i: int, qkv: str, k_bias: np.ndarray | None = None) -> str:
        """Layer i's attention over the fused qkv. k_bias (the layer's key bias, [Hkv * D]): its rotated mean is
        subtracted from the keys the cache stores (``key_shift``), which leaves the softmax as it is; not with a
        softcap."""
        g = self.g
        g._n += 1
        out = f"{self.prefix}_{g._n}"
        shift = {}
        if k_bias is not None and not self.softcap:
            shift = {"k_shift": key_shift(k_bias, self.Hkv, self.rot,
                                          *self.mean_rotation(self.table_kind(i))).tolist()}
        g.nodes.append(helper.make_node(
            self.op, [qkv, f"past_key_values.{i}.key", f"past_key_values.{i}.value", *self.where, *self.tables(i),
                      *self.after],
            [out, f"present.{i}.key", f"present.{i}.value"], name=f"{self.op}_{g._n}",
            domain=SEK_DOMAIN, num_heads=self.Hq, kv_num_heads=self.Hkv, scale=self.scores_scale, **self.softcap,
            **({"window": self.window(i)} if self.window(i) else {}), **shift))
        return out  # [B, T, Hq D]


class SekRowAttention(SekInplaceAttention):
    """Row-addressed steps through ``ai.specedge.SekRowAttention``: each of a step's T rows names its sequence's KV
    slot (``row_slot``, -1 for padding) and its position (``row_pos``), so the rows of several sequences share one
    step; a row attends over its slot's rows up to its position, the step's earlier rows of that slot included. A
    tree row names the row its token follows (``row_parent``, -1: none) and attends to its root's rows and its
    ancestors' only, at its depth's position (several continuations verified in one step). Every
    other operator of the graph works row by row, so a row's logits are the same bits whatever else the step holds."""

    op, where, prefix = "SekRowAttention", ("row_slot", "row_pos"), "sek_row_attn"
    after = ("row_parent",)  # tree rows: the step's row each row's token follows (-1: none)

    def __init__(self, g, w, cfg, inv_freq: np.ndarray, max_positions: int):  # no past_len: only the rotary tables
        d = cfg.dims
        self.g, self.D, self.Hq, self.Hkv = g, d.head_dim, d.n_heads, d.n_kv_heads
        self._tables(w, cfg, inv_freq, max_positions)
