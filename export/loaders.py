"""Weight loaders: a Hugging Face directory (safetensors) or a GGUF file.

Both produce a :class:`WeightSource`: a :class:`ModelConfig` plus lazy access to
float32 weights under canonical names (``embed``, ``final_norm``, ``lm_head``,
``l{i}.q`` …, see :func:`families.layer_names`). Linear weights keep the
Hugging Face orientation [out, in]. Tensors are read one at a time (memory-mapped
files), so export never holds two copies of the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specedge.runtime.errors import BundleError, SpecEdgeError, UnsupportedModelError
from specedge.runtime.manifest import ModelDims

from .families import Family, ModelConfig, family_for_gguf, family_for_hf, layer_names


@dataclass
class WeightSource:
    config: ModelConfig
    path: Path
    kind: str  # "hf" | "gguf"
    _get: Callable[[str], np.ndarray]
    _names: frozenset[str]
    rope_freq_factors: np.ndarray | None = None
    meta: dict[str, Any] | None = None
    _raw: Callable[[str], tuple[str, np.ndarray]] | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # canonical name -> [out, in], unread
    float_types: dict[str, str] = field(default_factory=dict)  # a GGUF's F16 / BF16 matrices: name -> type

    def raw(self, name: str) -> tuple[str, np.ndarray] | None:
        """(GGUF type name, uint8 rows [out, row bytes]) for a block-quantized GGUF tensor in the
        [out, in] orientation (llama Q/K rows already un-permuted); None for float sources."""
        return self._raw(name) if self._raw is not None and name in self._names else None

    def has(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str) -> np.ndarray:
        """Float32 tensor under its canonical name (a fresh array, caller may drop it)."""
        if name not in self._names:
            raise BundleError(f"{self.path}: weight {name!r} is missing")
        return np.ascontiguousarray(self._get(name), dtype=np.float32)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), **(self.meta or {})}


# A fused projection's parts, by rows: q|k|v and gate|up, in that order (Phi-3's qkv_proj and gate_up_proj, llama.cpp's
# attn_qkv and an ffn_up of 2F rows)
def _fused_parts(d: ModelDims) -> dict[str, list[tuple[str, int, int]]]:
    q, kv = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
    return {"qkv": [("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)],
            "gate_up": [("gate", 0, d.ffn), ("up", d.ffn, 2 * d.ffn)]}


def split_fused(src: WeightSource) -> WeightSource:
    """The source with each fused projection's parts under their own names (``l{i}.q`` ... ``l{i}.up``): rows of
    the fused tensor, a GGUF's blocks as they are (a block never spans rows). The builder fuses q|k|v and gate|up
    again itself, so nothing else knows a file held them fused."""
    parts: dict[str, tuple[str, int, int]] = {}
    fused = _fused_parts(src.config.dims)
    for i in range(src.config.dims.n_layers):
        for whole, pieces in fused.items():
            name = f"l{i}.{whole}"
            if name in src._names:
                rows = src.shapes.get(name, (pieces[-1][2],))[0]
                if rows != pieces[-1][2]:
                    raise BundleError(f"{src.path}: fused tensor {name!r} has {rows} rows; the configuration's "
                                      f"dimensions ({src.config.dims}) say {pieces[-1][2]}")
                parts.update({f"l{i}.{p}": (name, a, b) for p, a, b in pieces})
    if not parts:
        return src
    get0, raw0 = src._get, src._raw

    def get(name: str) -> np.ndarray:
        if name not in parts:
            return get0(name)
        whole, a, b = parts[name]
        return get0(whole)[a:b]

    def raw(name: str) -> tuple[str, np.ndarray] | None:
        if name not in parts:
            return raw0(name)
        whole, a, b = parts[name]
        r = raw0(whole)
        return None if r is None else (r[0], r[1][a:b])

    wholes = {w for w, _, _ in parts.values()}
    shapes = {n: s for n, s in src.shapes.items() if n not in wholes}
    shapes.update({n: (b - a, src.shapes[w][1]) for n, (w, a, b) in parts.items() if w in src.shapes})
    floats = {n: t for n, t in src.float_types.items() if n not in wholes}
    floats.update({n: src.float_types[w] for n, (w, _, _) in parts.items() if w in src.float_types})
    return dataclasses.replace(src, _get=get, _names=frozenset((src._names - wholes) | set(parts)),
                               _raw=raw if raw0 is not None else None, shapes=shapes, float_types=floats)


def load_source(path: str | Path) -> WeightSource:
    p = Path(path).expanduser()
    if not p.exists():
        raise BundleError(f"model path {p} does not exist")
    if not p.is_dir() and not (p.is_file() and p.suffix == ".gguf"):
        raise UnsupportedModelError(f"{p}: expected a Hugging Face model directory or a .gguf file")
    try:
        src = split_fused(load_hf_dir(p) if p.is_dir() else load_gguf(p))
    except SpecEdgeError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError, IndexError, UnicodeDecodeError,
            struct.error, OSError, MemoryError) as e:  # a config or header field missing, of the wrong type, absurd
        raise BundleError(f"{p}: its configuration or weights cannot be read as a model ({type(e).__name__}: "
                          f"{e})") from None
    check_source(src)
    return src


# The shape [out, in] (numpy order) of each per-layer tensor, from the model's dimensions.
def _expected_shapes(d: ModelDims) -> dict[str, tuple[int, ...]]:
    q, kv = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
    return {"attn_norm": (d.hidden,), "mlp_norm": (d.hidden,), "q": (q, d.hidden), "k": (kv, d.hidden),
            "v": (kv, d.hidden), "o": (d.hidden, q), "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,),
            "q_norm": (d.head_dim,), "k_norm": (d.head_dim,), "post_attn_norm": (d.hidden,),
            "post_mlp_norm": (d.hidden,),
            "gate": (d.ffn, d.hidden), "up": (d.ffn, d.hidden), "down": (d.hidden, d.ffn)}


def check_source(src: WeightSource) -> None:
    """The configuration against the tensors, before minutes of export: every tensor's shape what the dimensions
    say, no layer beyond the declared count (llama.cpp refuses both; a file whose block count was lowered
    exported its first layers alone, silently), finite positive RoPE base and norm epsilon."""
    c, d = src.config, src.config.dims
    if not (math.isfinite(c.rope_theta) and c.rope_theta > 0 and math.isfinite(c.rms_eps) and c.rms_eps > 0):
        raise BundleError(f"{src.path}: rope base {c.rope_theta} and norm epsilon {c.rms_eps} must be finite and > 0")
    for name in ("embedding_scale", "residual_scale", "attention_scale", "logit_scale"):
        v = getattr(c, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise BundleError(f"{src.path}: the model's {name.replace('_', ' ')} is {v}; it must be finite and > 0")
    want = _expected_shapes(d)
    missing = [n for i in range(d.n_layers) for n in layer_names(i, c.family)
               if n not in src.shapes and not n.endswith("_bias")]  # a missing bias is zero
    if src.shapes and missing:
        raise BundleError(f"{src.path}: the configuration declares {d.n_layers} layers, and tensors "
                          f"{missing[:3]}{' ...' if len(missing) > 3 else ''} are missing")
    top = {"embed": (d.vocab, d.hidden), "lm_head": (d.vocab, d.hidden), "final_norm": (d.hidden,)}
    for name, shape in sorted(src.shapes.items()):
        layer, _, kind = name.partition(".")
        if kind:
            if not layer[1:].isdigit() or int(layer[1:]) >= d.n_layers:
                raise BundleError(f"{src.path}: tensor {name!r} is beyond the {d.n_layers} layers the configuration "
                                  f"declares: the file and its configuration disagree")
            expected = want.get(kind)
        else:
            expected = top.get(name)
        if expected is not None and tuple(shape) != expected:
            raise BundleError(f"{src.path}: tensor {name!r} has shape {tuple(shape)}, the configuration's dimensions "
                              f"({d}) say {expected}: the file and its configuration disagree")


# ---------------------------------------------------------------- HF directory
_HF_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v", "self_attn.o_proj.weight": "o", "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "post_attention_layernorm.weight": "mlp_norm", "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
    "self_attn.qkv_proj.weight": "qkv", "mlp.gate_up_proj.weight": "gate_up",  # fused (phi3): split_fused
}


# Gemma's layer: post_attention_layernorm normalizes the attention's output; the MLP's input norm is its own
_HF_GEMMA_LAYER = {**_HF_LAYER, "post_attention_layernorm.weight": "post_attn_norm",
                   "pre_feedforward_layernorm.weight": "mlp_norm", "post_feedforward_layernorm.weight": "post_mlp_norm"}


def _canonical_hf(name: str, family: Family) -> str | None:
    if name in _HF_TOP:
        return _HF_TOP[name]
    layer = _HF_GEMMA_LAYER if family.gemma else _HF_LAYER
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[3] in layer:
        return f"l{int(parts[2])}.{layer[parts[3]]}"
    return None


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def _read_safetensors_index(path: Path) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
    """name -> (file, dtype, shape, byte offset, byte length) from a safetensors header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise BundleError(f"{path}: its safetensors header declares {n} bytes, more than the file holds")
        header = json.loads(f.read(n))
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        if not 0 <= a <= b or 8 + n + b > size:
            raise BundleError(f"{path}: tensor {name!r} (bytes {a}..{b} of the data) lies past the end of the file: "
                              f"it is truncated")
        out[name] = (path, meta["dtype"], tuple(meta["shape"]), 8 + n + a, b - a)
    return out


def _load_st_tensor(entry: tuple[Path, str, tuple[int, ...], int, int]) -> np.ndarray:
    path, dtype, shape, off, length = entry
    if dtype not in _ST_DTYPES:
        raise UnsupportedModelError(f"{path}: safetensors dtype {dtype} is not supported (F32, F16, BF16 are)")
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=off, shape=(length,))
    arr = raw.view(_ST_DTYPES[dtype]).reshape(shape)
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def load_hf_dir(d: Path) -> WeightSource:
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise BundleError(f"{d} has no config.json: not a Hugging Face model directory")
    cfg = json.loads(cfg_path.read_text())
    if not isinstance(cfg, dict):
        raise BundleError(f"{cfg_path} is not a JSON object")
    archs = cfg.get("architectures") or []
    family = family_for_hf([archs] if isinstance(archs, str) else archs)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise BundleError(f"{d} has no *.safetensors weights (pytorch .bin files are not supported)")
    index: dict[str, Any] = {}
    for f in files:
        for name, entry in _read_safetensors_index(f).items():
            canon = _canonical_hf(name, family)
            if canon is not None:
                index[canon] = entry
    n_heads = cfg["num_attention_heads"]
    dims = ModelDims(
        n_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_heads,
        ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"],
    )
    tie = bool(cfg.get("tie_word_embeddings", family.default_tie_embeddings)) or "lm_head" not in index
    local_types = "sliding_attention" in (cfg.get("layer_types") or ["sliding_attention"])  # gemma3: any local layer
    config = ModelConfig(
        family=family, dims=dims, rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta") or _hf_global_rope(cfg).get("rope_theta", 10000.0)),
        rope_scaling=_hf_rope_scaling(cfg), tie_embeddings=tie,
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
        rotary_dim=_rotary_dim(float(cfg.get("partial_rotary_factor") or _hf_global_rope(cfg).get(
            "partial_rotary_factor", 1.0)), dims.head_dim),
        sliding_window=(cfg.get("sliding_window") if cfg.get("use_sliding_window", True)
                        and (not family.gemma or local_types) else None),
        **_hf_layer_quirks(cfg, family, dims.n_layers),
    )
    def get(name: str) -> np.ndarray:
        w = _load_st_tensor(index[name])
        if family.gemma and name.endswith("norm"):  # Gemma's RMSNorm scales by 1 + w, in float32
            w = w.astype(np.float32) + np.float32(1.0)
        return w

    return WeightSource(config, d, "hf", get, frozenset(index),
                        meta={"architecture": cfg.get("architectures")},
                        shapes={n: tuple(int(x) for x in e[2]) for n, e in index.items()})


def _hf_layer_quirks(cfg: dict[str, Any], family: Family, n_layers: int) -> dict[str, Any]:
    """ModelConfig's multipliers and RoPE layers from a Hugging Face config (granite's four multipliers, smollm3's
    ``no_rope_layers``: 1 where the layer rotates, 0 where it does not)."""
    out: dict[str, Any] = {}
    if family.name == "granite":
        out = {"embedding_scale": float(cfg.get("embedding_multiplier", 1.0)),
               "residual_scale": float(cfg.get("residual_multiplier", 1.0)),
               "attention_scale": float(cfg.get("attention_multiplier", 1.0)),
               "logit_scale": float(cfg.get("logits_scaling", 1.0))}
    flags = cfg.get("no_rope_layers") if family.name == "smollm3" else None
    if flags is not None:
        if len(flags) != n_layers:
            raise BundleError(f"no_rope_layers has {len(flags)} entries for {n_layers} layers")
        out["rope_layers"] = tuple(bool(f) for f in flags)
    elif family.name == "smollm3":  # the config class's default: every n-th layer without RoPE
        every = int(cfg.get("no_rope_layer_interval", 4))
        out["rope_layers"] = tuple((i + 1) % every != 0 for i in range(n_layers))
    if out.get("rope_layers") is not None and all(out["rope_layers"]):
        out["rope_layers"] = None
    if not family.gemma and cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        types = cfg.get("layer_types")
        if types is None and "max_window_layers" in cfg:  # Qwen2's rule: the layers from max_window_layers on
            types = ["sliding_attention" if i >= int(cfg["max_window_layers"]) else "full_attention"
                     for i in range(n_layers)]
        if types is not None:
            if len(types) != n_layers:
                raise BundleError(f"layer_types has {len(types)} entries for {n_layers} layers")
            out["window_layers"] = tuple(t == "sliding_attention" for t in types)
    if family.gemma:
        for key, field_name in SOFTCAP_KEYS:
            if cfg.get(key):
                out[field_name] = float(cfg[key])
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional attention (an embedding model) is not supported")
        out["embedding_scale"] = float(np.float32(cfg["hidden_size"] ** 0.5))  # as transformers casts it
        out["attention_scale"] = float(cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256))) ** -0.5
        types = cfg.get("layer_types")
        if not types:  # older configs: every n-th layer global (sliding_window_pattern, else the family's rule)
            n = int(cfg.get("sliding_window_pattern") or family.gguf_local_pattern)
            types = ["full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(n_layers)]
        if len(types) != n_layers:
            raise BundleError(f"layer_types has {len(types)} entries for {n_layers} layers")
        local = tuple(t == "sliding_attention" for t in types)
        if any(local):
            out["local_layers"] = local
            rp = (cfg.get("rope_parameters") or {}).get("sliding_attention") or {}
            if rp.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"local layers' rope scaling {rp.get('rope_type')!r} is not supported")
            out["local_rope_theta"] = (float(rp.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
                                       if family.local_rope_base else
                                       float(cfg.get("rope_theta") or _hf_global_rope(cfg).get("rope_theta", 10000.0)))
    return out


# Gemma 2's soft caps: the HF config's key (the GGUF's {arch}.KEY) -> ModelConfig's field
SOFTCAP_KEYS = (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap"))


def _hf_global_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of the global layers: ``rope_parameters`` itself, or its ``full_attention`` entry where
    it holds one per layer type (gemma3)."""
    rp = cfg.get("rope_parameters") or {}
    return rp.get("full_attention", rp) if isinstance(rp.get("full_attention"), dict) else rp


def _rotary_dim(factor: float, head_dim: int) -> int | None:
    """The dims RoPE rotates for a partial_rotary_factor (None: all of them)."""
    r = int(head_dim * factor)
    if r >= head_dim:
        return None
    if r < 2 or r % 2:
        raise UnsupportedModelError(f"a partial rotary of {factor} x head_dim {head_dim} = {r} dims; an even number "
                                    "of at least 2 is needed")
    return r


def _hf_rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    sc = cfg.get("rope_scaling") or _hf_global_rope(cfg)
    if sc and sc.get("rope_type", sc.get("type")) in ("longrope", "su"):  # phi3: its factors and trained context
        return {"rope_type": "longrope", "short_factor": list(sc["short_factor"]),
                "long_factor": list(sc["long_factor"]), "attention_factor": sc.get("attention_factor"),
                "original_max_position_embeddings": int(sc.get("original_max_position_embeddings")
                                                        or cfg["original_max_position_embeddings"])}
    if not sc:
        return None
    kind = sc.get("rope_type", sc.get("type", "default"))
    return None if kind == "default" else dict(sc)


# ------------------------------------------------------------------------ GGUF
_GGUF_TOP = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_GGUF_LAYER = {
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v",
    "attn_output.weight": "o", "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias",
    "ffn_norm.weight": "mlp_norm", "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm", "post_ffw_norm.weight": "post_mlp_norm",
    "attn_qkv.weight": "qkv",  # fused (phi3): split_fused
}


def _canonical_gguf(name: str) -> str | None:
    if name in _GGUF_TOP:
        return _GGUF_TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER:
        return f"l{int(parts[1])}.{_GGUF_LAYER[parts[2]]}"
    return None


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE -> rotate-half RoPE).

    The converter did ``w.reshape(n, 2, rows/n/2, in).swapaxes(1, 2)``; this is its inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path) -> WeightSource:
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError as e:  # pragma: no cover - export extra missing
        raise UnsupportedModelError("reading GGUF needs the export extra: pip install 'specedge[export]'") from e
    check_gguf_counts(path)  # before gguf's reader, which loops on a count past the end of the file
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise BundleError(f"{path} is not a readable GGUF file: {type(e).__name__}: {e}") from e
    check_gguf_layout(path, reader)
    arch = gguf_field(reader, "general.architecture")
    family = family_for_gguf(arch)
    tensors = {t.name: t for t in reader.tensors}
    index = {c: tensors[n] for n in tensors if (c := _canonical_gguf(n)) is not None}
    for name in [n for n in index if n.endswith(".up") and n[:-2] + "gate" not in index]:
        index[name[:-2] + "gate_up"] = index.pop(name)  # an ffn_up without an ffn_gate holds gate|up (phi3)
    if "embed" not in index:
        raise BundleError(f"{path}: GGUF has no token_embd.weight")
    need = lambda key: _gguf_int(path, reader, f"{arch}.{key}")  # noqa: E731
    n_heads = need("attention.head_count")
    n_kv = _gguf_int(path, reader, f"{arch}.attention.head_count_kv", n_heads)
    hidden = need("embedding_length")
    if n_heads < 1:
        raise BundleError(f"{path}: {arch}.attention.head_count is {n_heads}; a model has at least one head")
    vocab = int(index["embed"].shape[-1])  # GGUF ne order: [hidden, vocab]
    dims = ModelDims(
        n_layers=need("block_count"), hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=_gguf_int(path, reader, f"{arch}.attention.key_length", hidden // n_heads),
        ffn=need("feed_forward_length"), vocab=vocab,
    )
    scaling_type = gguf_field(reader, f"{arch}.rope.scaling.type")
    rope_scaling = None
    if "rope_factors_long.weight" in tensors:  # phi3's LongRoPE: both factor sets, the trained context
        rope_scaling = {"rope_type": "longrope",
                        "short_factor": np.asarray(tensors["rope_factors_short.weight"].data, np.float64).tolist(),
                        "long_factor": np.asarray(tensors["rope_factors_long.weight"].data, np.float64).tolist(),
                        "attention_factor": gguf_field(reader, f"{arch}.rope.scaling.attn_factor"),
                        "original_max_position_embeddings": _gguf_int(
                            path, reader, f"{arch}.rope.scaling.original_context_length")}
    elif scaling_type and scaling_type not in ("none",):
        if scaling_type != "linear":
            raise UnsupportedModelError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported")
        rope_scaling = {"rope_type": "linear", "factor": float(gguf_field(reader, f"{arch}.rope.scaling.factor"))}
    config = ModelConfig(
        family=family, dims=dims,
        rms_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling, tie_embeddings="lm_head" not in index,
        max_positions=int(gguf_field(reader, f"{arch}.context_length", 2048)),
        rotary_dim=_gguf_rotary_dim(path, reader, arch, dims.head_dim),
        **_gguf_layer_quirks(path, reader, arch, family, dims.n_layers),
    )
    factors = None
    if "rope_freqs.weight" in tensors:
        factors = np.asarray(dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type))
        factors = factors.reshape(-1)

    def get(name: str) -> np.ndarray:
        t = index[name]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(x) for x in reversed(t.shape)))  # GGUF ne is [in, out]; numpy is [out, in]
        if family.gguf_permute_qk and name.endswith((".q", ".k")):
            w = unpermute_qk(w, n_heads if name.endswith(".q") else n_kv)
        return w

    def raw(name: str) -> tuple[str, np.ndarray] | None:
        t = index[name]
        if t.tensor_type.name in ("F32", "F16", "BF16") or len(t.shape) != 2:
            return None
        rows = np.asarray(t.data).reshape(int(t.shape[1]), -1)  # [out, bytes per row]
        if family.gguf_permute_qk and name.endswith((".q", ".k")):
            rows = unpermute_qk(rows, n_heads if name.endswith(".q") else n_kv)
        return t.tensor_type.name, rows

    types = sorted({t.tensor_type.name for t in reader.tensors})
    return WeightSource(config, path, "gguf", get, frozenset(index), rope_freq_factors=factors,
                        meta={"architecture": arch, "tensor_types": types}, _raw=raw,
                        float_types={n: t.tensor_type.name for n, t in index.items()
                                     if t.tensor_type.name in ("F16", "BF16") and len(t.shape) == 2},
                        shapes={n: tuple(int(x) for x in reversed(t.shape)) for n, t in index.items()})


def _gguf_rotary_dim(path: Path, reader: Any, arch: str, head_dim: int) -> int | None:
    """{arch}.rope.dimension_count, where it is less than the head's dims (a partial rotary)."""
    r = _gguf_int(path, reader, f"{arch}.rope.dimension_count", head_dim)
    return _rotary_dim(r / head_dim, head_dim)


def _gguf_layer_quirks(path: Path, reader: Any, arch: str, family: Family, n_layers: int) -> dict[str, Any]:
    """ModelConfig's multipliers and RoPE layers from GGUF metadata, under the keys llama.cpp's converter writes
    (``{arch}.embedding_scale``, ``.residual_scale``, ``.attention.scale``, ``.logit_scale``)."""
    out: dict[str, Any] = {}
    for key, field_name in (("embedding_scale", "embedding_scale"), ("residual_scale", "residual_scale"),
                            ("attention.scale", "attention_scale"), ("logit_scale", "logit_scale")):
        v = gguf_field(reader, f"{arch}.{key}")
        if v is not None:
            out[field_name] = float(v)  # check_source: finite and > 0
    if family.gguf_nope_every:
        out["rope_layers"] = tuple((i + 1) % family.gguf_nope_every != 0 for i in range(n_layers))
    if family.gguf_window_all and gguf_field(reader, f"{arch}.attention.sliding_window"):  # phi3: every layer
        out["sliding_window"] = int(gguf_field(reader, f"{arch}.attention.sliding_window"))
    if family.gemma:
        for key, field_name in SOFTCAP_KEYS:
            if gguf_field(reader, f"{arch}.{key}"):
                out[field_name] = float(gguf_field(reader, f"{arch}.{key}"))
        out["embedding_scale"] = float(np.float32(_gguf_int(path, reader, f"{arch}.embedding_length") ** 0.5))
        window = gguf_field(reader, f"{arch}.attention.sliding_window")
        if window:
            listed = gguf_field(reader, f"{arch}.attention.sliding_window_pattern")
            n = family.gguf_local_pattern if listed is None or isinstance(listed, list) else int(listed)
            local = (tuple(bool(x) for x in listed) if isinstance(listed, list)
                     else tuple(n == 0 or i % n < n - 1 for i in range(n_layers)))
            out["local_layers"] = local
            out["local_rope_theta"] = float(gguf_field(reader, f"{arch}.rope.freq_base_swa", 10000.0)
                                            if family.local_rope_base else
                                            gguf_field(reader, f"{arch}.rope.freq_base", 10000.0))
            out["sliding_window"] = int(window)
    return out


def _gguf_int(path: Path, reader: Any, key: str, default: int | None = None) -> int:
    v = gguf_field(reader, key, default)
    if v is None:
        raise BundleError(f"{path}: GGUF metadata {key!r} is missing")
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise BundleError(f"{path}: GGUF metadata {key!r} must be an integer, got {v!r}")
    return int(v)


# GGUF value types (gguf's GGUFValueType) and the bytes of one scalar of each; 8: string, 9: array
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def check_gguf_counts(path: Path) -> None:
    """Walk a GGUF file's metadata and check every declared count (keys, strings, arrays, tensors) against the
    bytes left: gguf's reader loops over a numeric array's declared count, past the end of the file, forever (a
    count of 2^60 grew the exporter by 50 MB a second until the machine ran out). Memory-mapped: values are
    skipped, not read."""
    size = path.stat().st_size
    if size < 24:
        raise BundleError(f"{path} is not a GGUF file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        at = 0

        def skip(n: int, what: str) -> int:
            nonlocal at
            if at + n > size:
                raise BundleError(f"{path}: GGUF {what} at byte {at} runs past the end of the file ({size} bytes): "
                                  f"the file is truncated or damaged")
            at += n
            return at - n

        def u(n: int, what: str) -> int:
            start = skip(n, what)
            return int.from_bytes(buf[start: at], "little")

        def value(kind: int, what: str) -> None:
            if kind in _GGUF_SCALAR:
                skip(_GGUF_SCALAR[kind], what)
            elif kind == 8:
                skip(u(8, what + " length"), what)
            elif kind == 9:
                inner, count = u(4, what + " type"), u(8, what + " count")
                if inner in _GGUF_SCALAR:
                    skip(count * _GGUF_SCALAR[inner], f"{what} ({count} values)")
                elif count > (size - at) // 8:  # every element at least a length
                    raise BundleError(f"{path}: GGUF {what} declares {count} values, more than the file holds")
                else:
                    for _ in range(count):
                        value(inner, what)
            else:
                raise BundleError(f"{path}: GGUF {what} has value type {kind}, which no GGUF version defines")

        if buf[:4] != b"GGUF":
            raise BundleError(f"{path} is not a GGUF file (no GGUF magic)")
        skip(8, "magic and version")
        n_tensors, n_kv = u(8, "tensor count"), u(8, "metadata count")
        if n_tensors > size // 24 or n_kv > size // 12:  # a tensor's info takes > 24 bytes, a key-value > 12
            raise BundleError(f"{path}: GGUF declares {n_tensors} tensors and {n_kv} metadata keys, more than its "
                              f"{size} bytes can hold: the file is damaged")
        for i in range(n_kv):
            start = skip(u(8, f"key {i} length"), f"key {i}")
            key = buf[start: at].decode("utf-8", "replace")
            value(u(4, f"{key!r} type"), repr(key))


def check_gguf_layout(path: Path, reader: Any) -> None:
    """Every tensor's data inside the file, on the file's alignment and apart from the others: a tensor whose type
    or offset was changed reads its neighbour's bytes (NaN weights, exported without a word)."""
    align = int(gguf_field(reader, "general.alignment", 32) or 32)
    size = path.stat().st_size
    spans = sorted((int(t.data_offset), int(t.n_bytes), t.name) for t in reader.tensors)
    end, last = 0, None
    for off, n, name in spans:
        if off % align or off + n > size:
            where = f"not on the file alignment {align}" if off % align else "past the end of the file"
            raise BundleError(f"{path}: tensor {name!r} at byte {off} ({n} bytes) is {where}: the file is damaged")
        if off < end:
            raise BundleError(f"{path}: tensors {last!r} and {name!r} overlap (their types or offsets were changed): "
                              f"the file is damaged")
        end, last = off + n, name
