"""Activation smoothing for the integer-GEMM form (SmoothQuant, Xiao et al. 2023), folded into the weights.

An integer-GEMM linear quantizes its input per row to 8 bits (graph.py, ``_row_quantized``): one outlier channel
sets the row's scale and the other channels keep a few levels. Smoothing moves part of each input channel's range
into the weights: x' = x / s and W' = W * s (column j times s_j), so x' W'^T = x W^T exactly in real arithmetic,
with s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) from activation maxima measured on a calibration text.

The division by s is folded into the op that produces the input, so the graph is unchanged and the model is the
same function before quantization:

* q|k|v input: the attention RMSNorm's weight / s, the q, k, v columns * s;
* gate|up input: the MLP RMSNorm's weight / s, the gate, up columns * s;
* down input silu(gate) * up: the up rows (its output channels) / s, the down columns * s;
* o input (the attention output, a convex combination of V rows): the v rows and bias / s, the o columns * s —
  one factor per key/value channel, shared by the query heads of its group.

Exactness (speculative == plain) does not depend on any of this: it changes the weights a bundle carries, and every
step of that bundle runs the same ones. What it changes is how close the bundle is to the fp32 model, which
``tools/quant_accuracy.py`` measures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from .loaders import WeightSource

# A mixed text (prose, code, JSON, a list, numbers) for the activation maxima. Not one of the benchmark suites'
# prompts: those measure accuracy and speed, and calibrating on them would flatter both.
CALIBRATION_TEXT = """\
The lighthouse keeper wrote in his log every evening: wind from the north-east, 14 knots; two fishing boats \
returned before dusk; the lamp was cleaned and its wick trimmed. In winter the entries grew shorter, but he never \
missed a day in thirty-one years.

def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    \"\"\"Merge overlapping closed intervals, sorted by start.\"\"\"
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out

{"order_id": 48213, "customer": {"name": "Ana Souza", "city": "Porto"}, "items": [{"sku": "A-17", "qty": 3, \
"price": 12.5}, {"sku": "C-02", "qty": 1, "price": 99.0}], "paid": true}

Steps to replace a bicycle chain: 1. Shift to the smallest cog. 2. Open the old chain at its quick link. \
3. Count the links and cut the new chain to match. 4. Thread it through the derailleur and close the link.

SELECT region, COUNT(*) AS orders, AVG(total) FROM sales WHERE year = 2024 GROUP BY region ORDER BY orders DESC;
"""
MAX_CALIBRATION_TOKENS = 512


def activation_maxima(src: WeightSource, ids: list[int], progress: Callable[[str], None] | None = None,
                      weight_maxima: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Per layer i, per input channel: max |x| over the calibration tokens at the inputs of the fused linears —
    ``l{i}.qkv_in`` [H], ``l{i}.o_in`` [Hq D], ``l{i}.gate_up_in`` [H], ``l{i}.down_in`` [F] — from a float32
    numpy forward pass of the model (causal attention over ``ids`` from position 0, RoPE as the graph applies it).
    ``weight_maxima``, if given, is filled with every linear's per-input-column max |W| (``l{i}.q`` …) from the
    weights the pass reads anyway, so that smoothing_factors need not read (for a GGUF: dequantize) them again."""
    cfg = src.config
    d = cfg.dims
    D, Hq, Hkv = d.head_dim, d.n_heads, d.n_kv_heads
    G = Hq // Hkv
    T = len(ids)
    say = progress or (lambda s: None)
    x = src.get("embed")[np.asarray(ids)]  # [T, H]
    freqs = np.arange(T, dtype=np.float32)[:, None] * cfg.inv_freq(src.rope_freq_factors)[None]  # [T, D/2]
    cos, sin = np.cos(np.concatenate([freqs, freqs], -1)), np.sin(np.concatenate([freqs, freqs], -1))
    causal = np.triu(np.full((T, T), -np.inf, np.float32), 1)

    def rmsnorm(v: np.ndarray, w: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.rms_eps) * w

    def rope(v: np.ndarray) -> np.ndarray:  # [T, heads, D], rotate-half
        half = D // 2
        rot = np.concatenate([-v[..., half:], v[..., :half]], -1)
        return v * cos[:, None] + rot * sin[:, None]

    def linear(v: np.ndarray, name: str) -> np.ndarray:
        w = src.get(f"l{i}.{name}")
        if weight_maxima is not None:
            weight_maxima[f"l{i}.{name}"] = np.abs(w).max(0)
        y = v @ w.T
        return y + src.get(f"l{i}.{name}_bias") if cfg.family.qkv_bias and name in ("q", "k", "v") else y

    out: dict[str, np.ndarray] = {}
    for i in range(d.n_layers):
        say(f"calibration: layer {i + 1}/{d.n_layers}")
        h = rmsnorm(x, src.get(f"l{i}.attn_norm"))
        out[f"l{i}.qkv_in"] = np.abs(h).max(0)
        q = rope(linear(h, "q").reshape(T, Hq, D))
        k = rope(linear(h, "k").reshape(T, Hkv, D))
        v = linear(h, "v").reshape(T, Hkv, D)
        scores = np.einsum("tgqd,sgd->gqts", q.reshape(T, Hkv, G, D), k) / np.sqrt(D) + causal  # [Hkv, G, T, T]
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        attn = np.einsum("gqts,sgd->tgqd", p, v).reshape(T, Hq * D)
        out[f"l{i}.o_in"] = np.abs(attn).max(0)
        x = x + linear(attn, "o")
        h = rmsnorm(x, src.get(f"l{i}.mlp_norm"))
        out[f"l{i}.gate_up_in"] = np.abs(h).max(0)
        gate, up = linear(h, "gate"), linear(h, "up")
        act = gate / (1.0 + np.exp(-gate)) * up
        out[f"l{i}.down_in"] = np.abs(act).max(0)
        x = x + linear(act, "down")
    return out


def _factors(a_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    """s = a^alpha / w^(1 - alpha) per channel; 1 where either side is zero (nothing to balance)."""
    ok = (a_max > 0) & (w_max > 0)
    s = np.ones_like(a_max, dtype=np.float64)
    s[ok] = a_max[ok].astype(np.float64) ** alpha / w_max[ok].astype(np.float64) ** (1.0 - alpha)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def smoothing_factors(src: WeightSource, maxima: dict[str, np.ndarray], alpha: float,
                      weight_maxima: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Per layer: ``l{i}.qkv`` [H], ``l{i}.gate_up`` [H], ``l{i}.down`` [F] and ``l{i}.v`` [Hkv D] (the o input's
    factor per key/value channel: the largest of its group's query heads on both sides). The weights' column
    maxima come from ``weight_maxima`` (activation_maxima fills it) or are read from ``src``."""
    d = src.config.dims
    G = d.n_heads // d.n_kv_heads

    def col_max(names: list[str]) -> np.ndarray:
        return np.max([weight_maxima[n] if weight_maxima is not None else np.abs(src.get(n)).max(0) for n in names],
                      axis=0)

    out = {}
    for i in range(d.n_layers):
        out[f"l{i}.qkv"] = _factors(maxima[f"l{i}.qkv_in"], col_max([f"l{i}.q", f"l{i}.k", f"l{i}.v"]), alpha)
        out[f"l{i}.gate_up"] = _factors(maxima[f"l{i}.gate_up_in"], col_max([f"l{i}.gate", f"l{i}.up"]), alpha)
        out[f"l{i}.down"] = _factors(maxima[f"l{i}.down_in"], col_max([f"l{i}.down"]), alpha)
        grouped = lambda v: v.reshape(d.n_kv_heads, G, d.head_dim).max(1).reshape(-1)  # noqa: E731
        out[f"l{i}.v"] = _factors(grouped(maxima[f"l{i}.o_in"]), grouped(col_max([f"l{i}.o"])), alpha)
    return out


def smoothed(src: WeightSource, factors: dict[str, np.ndarray]) -> WeightSource:
    """``src`` with the factors folded in (module docstring); float weights only (no GGUF blocks to carry: every
    matrix is re-quantized from the smoothed floats)."""
    d = src.config.dims
    G = d.n_heads // d.n_kv_heads
    base = src.get

    def get(name: str) -> np.ndarray:
        w = base(name)
        layer, _, part = name.partition(".")
        if not layer.startswith("l") or not layer[1:].isdigit():
            return w
        f = lambda key: factors[f"{layer}.{key}"]  # noqa: E731
        if part == "attn_norm":
            return w / f("qkv")
        if part in ("q", "k"):
            return w * f("qkv")[None]
        if part == "v":
            return w * f("qkv")[None] / f("v")[:, None]
        if part == "v_bias":
            return w / f("v")
        if part == "o":
            s = np.broadcast_to(f("v").reshape(d.n_kv_heads, 1, d.head_dim), (d.n_kv_heads, G, d.head_dim))
            return w * s.reshape(1, -1)
        if part == "mlp_norm":
            return w / f("gate_up")
        if part == "gate":
            return w * f("gate_up")[None]
        if part == "up":
            return w * f("gate_up")[None] / f("down")[:, None]
        if part == "down":
            return w * f("down")[None]
        return w

    return dataclasses.replace(src, _get=get, _raw=None)
