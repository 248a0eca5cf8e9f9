"""Model families as data: every quirk the graph builder needs, registered per family.

Adding a family means adding a row to FAMILIES, not an elif in the builder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from specedge.runtime.errors import UnsupportedModelError
from specedge.runtime.manifest import ModelDims


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool  # q/k/v projections carry a bias (qwen2)
    gguf_permute_qk: bool  # llama.cpp's converter permuted Q/K rows for interleaved RoPE
    hf_architectures: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    default_tie_embeddings: bool
    qk_norm: bool = False  # each head's q and k RMS-normalized (over head_dim) before RoPE (qwen3)
    # a GGUF without per-layer RoPE metadata: every n-th layer (1-based) attends without RoPE, as llama.cpp's own
    # model code hard-codes it (smollm3: 4); 0: every layer rotates
    gguf_nope_every: int = 0
    # gemma3: the embedding rows times sqrt(hidden); an RMSNorm weight w applied as (1 + w) (llama.cpp's converter
    # stores 1 + w); a norm after attention and after the MLP besides the ones before; GeGLU (tanh GELU)
    gemma: bool = False
    # the local (sliding-window) layers where the file does not list them, by llama.cpp's and transformers' rule:
    # layer il is local unless il % n == n - 1 (gemma3: 6, gemma2: 2)
    gguf_local_pattern: int = 0
    # the local layers' own RoPE base ({arch}.rope.freq_base_swa, rope_local_base_freq; else 10000): gemma3. Without
    # one (gemma2) they rotate as the global layers do
    local_rope_base: bool = False
    # a GGUF's {arch}.attention.sliding_window (> 0) applies to every layer, as llama.cpp reads it (phi3)
    gguf_window_all: bool = False


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", qkv_bias=False, gguf_permute_qk=True,
               hf_architectures=("LlamaForCausalLM",), gguf_architectures=("llama",),
               default_tie_embeddings=False),
        Family("qwen2", qkv_bias=True, gguf_permute_qk=False,
               hf_architectures=("Qwen2ForCausalLM",), gguf_architectures=("qwen2",),
               default_tie_embeddings=False),
        # Mistral: every layer attends over its config's sliding window (ModelConfig.window)
        Family("mistral", qkv_bias=False, gguf_permute_qk=True,
               hf_architectures=("MistralForCausalLM",), gguf_architectures=(),
               default_tie_embeddings=False),
        Family("qwen3", qkv_bias=False, gguf_permute_qk=False,
               hf_architectures=("Qwen3ForCausalLM",), gguf_architectures=("qwen3",),
               default_tie_embeddings=False, qk_norm=True),
        # Granite 3: llama layers with four multipliers (ModelConfig's embedding/residual/attention/logit scales)
        Family("granite", qkv_bias=False, gguf_permute_qk=True,
               hf_architectures=("GraniteForCausalLM",), gguf_architectures=("granite",),
               default_tie_embeddings=True),
        # Gemma 3 text models: local layers (a sliding window, their own RoPE base) between global ones
        Family("gemma3", qkv_bias=False, gguf_permute_qk=False,
               hf_architectures=("Gemma3ForCausalLM",), gguf_architectures=("gemma3",),
               default_tie_embeddings=True, qk_norm=True, gemma=True, gguf_local_pattern=6, local_rope_base=True),
        # Gemma 2: Gemma 3's layer without q/k norm, every other layer local (one RoPE base), the attention scores
        # and the logits soft-capped (ModelConfig.attn_softcap, final_softcap)
        Family("gemma2", qkv_bias=False, gguf_permute_qk=False,
               hf_architectures=("Gemma2ForCausalLM",), gguf_architectures=("gemma2",),
               default_tie_embeddings=True, gemma=True, gguf_local_pattern=2),
        # Phi-3 / Phi-4-mini: fused q|k|v and gate|up projections (split at load), LongRoPE scaling, partial rotary
        Family("phi3", qkv_bias=False, gguf_permute_qk=False,
               hf_architectures=("Phi3ForCausalLM",), gguf_architectures=("phi3",),
               default_tie_embeddings=False, gguf_window_all=True),
        # SmolLM3: llama layers, some without RoPE (ModelConfig.rope_layers)
        Family("smollm3", qkv_bias=False, gguf_permute_qk=True,
               hf_architectures=("SmolLM3ForCausalLM",), gguf_architectures=("smollm3",),
               default_tie_embeddings=True, gguf_nope_every=4),
    )
}


def _supported() -> str:
    hf = sorted(a for f in FAMILIES.values() for a in f.hf_architectures)
    gg = sorted(a for f in FAMILIES.values() for a in f.gguf_architectures)
    return f"Hugging Face architectures {', '.join(hf)}; GGUF architectures {', '.join(gg)}"


def family_for_hf(architectures: list[str]) -> Family:
    for f in FAMILIES.values():
        if any(a in f.hf_architectures for a in architectures):
            return f
    raise UnsupportedModelError(f"unsupported architecture {architectures}; supported: {_supported()}")


def family_for_gguf(arch: str) -> Family:
    for f in FAMILIES.values():
        if arch in f.gguf_architectures:
            return f
    raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}; supported: {_supported()}")


@dataclass(frozen=True)
class ModelConfig:
    """What the graph builder needs to know about one model, whatever its source."""

    family: Family
    dims: ModelDims
    rms_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_embeddings: bool
    max_positions: int
    sliding_window: int | None = None
    embedding_scale: float = 1.0  # the gathered embedding rows times this (granite)
    residual_scale: float = 1.0  # each block's output times this before it joins the residual stream (granite)
    attention_scale: float | None = None  # the scores' scale; None: 1 / sqrt(head_dim) (granite sets its own)
    logit_scale: float = 1.0  # the logits divided by this (granite)
    rope_layers: tuple[bool, ...] | None = None  # per layer: whether it applies RoPE (None: every layer; smollm3)
    # per layer: whether it is a local one, attending over the last ``sliding_window`` positions with RoPE base
    # ``local_rope_theta`` and no scaling (None: no local layers; gemma3)
    local_layers: tuple[bool, ...] | None = None
    local_rope_theta: float = 10000.0
    # per layer: whether ``sliding_window`` applies to it (None: the local layers where there are some, else every
    # layer; Qwen2's ``max_window_layers``, a config's ``layer_types``)
    window_layers: tuple[bool, ...] | None = None
    rotary_dim: int | None = None  # RoPE on the first rotary_dim of each head's dims (None: all; phi3's partial)
    attn_softcap: float | None = None  # scores s -> c tanh(s / c) before the softmax (gemma2)
    final_softcap: float | None = None  # logits z -> c tanh(z / c) (gemma2)

    def scores_scale(self) -> float:
        return float(1.0 / np.sqrt(self.dims.head_dim)) if self.attention_scale is None else float(self.attention_scale)

    def rotates(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

    def is_local(self, layer: int) -> bool:
        return self.local_layers is not None and self.local_layers[layer]

    def window(self, layer: int, max_positions: int | None = None) -> int:
        """The sliding window of the layer's attention, in positions: a query at p attends to p - window + 1 .. p;
        0 for full attention, and for a window that reaches over all ``max_positions``."""
        layers = self.window_layers if self.window_layers is not None else self.local_layers
        w = self.sliding_window or 0
        if w <= 0 or (layers is not None and not layers[layer]) or (max_positions is not None and w >= max_positions):
            return 0
        return int(w)

    def local_inv_freq(self) -> np.ndarray:
        d = self.dims.head_dim
        return (1.0 / (self.local_rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))).astype(np.float32)

    def plain_layers(self) -> bool:
        """Whether the model is llama's layer exactly: no q/k norm, no multipliers, RoPE in every layer."""
        return (not self.family.qk_norm and not self.family.gemma and self.rope_layers is None
                and self.local_layers is None and self.attention_scale is None
                and (self.embedding_scale, self.residual_scale, self.logit_scale) == (1.0, 1.0, 1.0))

    def rot_dim(self) -> int:
        """The dims of a head that RoPE rotates (rotate-half over the first rot_dim; the rest pass through)."""
        return self.rotary_dim or self.dims.head_dim

    def rope_mscale(self) -> float:
        """The factor on the rotary tables' cos and sin (LongRoPE's attention factor; 1 otherwise)."""
        sc = self.rope_scaling or {}
        if sc.get("rope_type", sc.get("type")) != "longrope":
            return 1.0
        if sc.get("attention_factor") is not None:
            return float(sc["attention_factor"])
        orig = int(sc["original_max_position_embeddings"])
        factor = self.max_positions / orig
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))

    def inv_freq(self, rope_freq_factors: np.ndarray | None = None, max_positions: int | None = None) -> np.ndarray:
        """RoPE inverse frequencies [rot_dim/2] (float32), with the configured scaling applied. LongRoPE takes its
        long factors for a graph of more positions than the model was trained at (``max_positions`` >
        original_max_position_embeddings), its short ones otherwise: as llama.cpp chooses by its context size, and
        as transformers does for a sequence of that length."""
        d = self.rot_dim()
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if rope_freq_factors is not None:  # GGUF stores llama3 scaling as per-frequency divisors
            return (inv / rope_freq_factors.astype(np.float64)).astype(np.float32)
        sc = self.rope_scaling
        kind = (sc or {}).get("rope_type", (sc or {}).get("type", "default"))
        if sc is None or kind == "default":
            return inv.astype(np.float32)
        if kind == "linear":
            return (inv / float(sc["factor"])).astype(np.float32)
        if kind == "llama3":
            return _llama3_inv_freq(inv, sc).astype(np.float32)
        if kind == "longrope":
            long = max_positions is not None and max_positions > int(sc["original_max_position_embeddings"])
            ext = np.asarray(sc["long_factor" if long else "short_factor"], np.float64)
            if ext.shape != inv.shape:
                raise UnsupportedModelError(f"longrope's factors hold {ext.size} values; the rotary dims want "
                                            f"{inv.size}")
            # transformers: 1 / (ext * base ** (2i / d)), in float32 (its ext_factors and powers are float32)
            shape = (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d))
            inv32 = np.float32(1.0) / (ext.astype(np.float32) * np.float32(self.rope_theta) ** shape)
            return inv32.astype(np.float32)
        raise UnsupportedModelError(f"rope scaling {kind!r} is not supported (default, linear, llama3, longrope are)")


def _llama3_inv_freq(inv: np.ndarray, sc: dict[str, Any]) -> np.ndarray:
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def layer_names(i: int, family: Family) -> list[str]:
    """Canonical per-layer weight names every loader provides for a family."""
    names = [f"l{i}.attn_norm", f"l{i}.q", f"l{i}.k", f"l{i}.v", f"l{i}.o",
             f"l{i}.mlp_norm", f"l{i}.gate", f"l{i}.up", f"l{i}.down"]
    if family.qkv_bias:
        names += [f"l{i}.q_bias", f"l{i}.k_bias", f"l{i}.v_bias"]
    if family.qk_norm:
        names += [f"l{i}.q_norm", f"l{i}.k_norm"]
    if family.gemma:
        names += [f"l{i}.post_attn_norm", f"l{i}.post_mlp_norm"]
    return names
