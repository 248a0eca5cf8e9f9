"""Weight loaders: a Hugging Face directory (safetensors) or a GGUF file.

Both produce a :class:`WeightSource`: a :class:`ModelConfig` plus lazy access to
float32 weights under canonical names (``embed``, ``final_norm``, ``lm_head``,
``l{i}.q`` …, see :func:`families.layer_names`). Linear weights keep the
Hugging Face orientation [out, in]. Tensors are read one at a time (memory-mapped
files), so export never holds two copies of the model.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from specedge.runtime.errors import BundleError, UnsupportedModelError
from specedge.runtime.manifest import ModelDims

from .families import ModelConfig, family_for_gguf, family_for_hf


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


def load_source(path: str | Path) -> WeightSource:
    p = Path(path).expanduser()
    if p.is_dir():
        return load_hf_dir(p)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p)
    if not p.exists():
        raise BundleError(f"model path {p} does not exist")
    raise UnsupportedModelError(f"{p}: expected a Hugging Face model directory or a .gguf file")


# ---------------------------------------------------------------- HF directory
_HF_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v", "self_attn.o_proj.weight": "o", "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias", "self_attn.v_proj.bias": "v_bias",
    "post_attention_layernorm.weight": "mlp_norm", "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
}


def _canonical_hf(name: str) -> str | None:
    if name in _HF_TOP:
        return _HF_TOP[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[3] in _HF_LAYER:
        return f"l{int(parts[2])}.{_HF_LAYER[parts[3]]}"
    return None


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def _read_safetensors_index(path: Path) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
    """name -> (file, dtype, shape, byte offset, byte length) from a safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
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
    family = family_for_hf(cfg.get("architectures") or [])
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise BundleError(f"{d} has no *.safetensors weights (pytorch .bin files are not supported)")
    index: dict[str, Any] = {}
    for f in files:
        for name, entry in _read_safetensors_index(f).items():
            canon = _canonical_hf(name)
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
    config = ModelConfig(
        family=family, dims=dims, rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        rope_scaling=_hf_rope_scaling(cfg), tie_embeddings=tie,
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
    )
    return WeightSource(config, d, "hf", lambda n: _load_st_tensor(index[n]), frozenset(index),
                        meta={"architecture": cfg.get("architectures")})


def _hf_rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    sc = cfg.get("rope_scaling") or cfg.get("rope_parameters")
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
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise BundleError(f"{path} is not a readable GGUF file: {e}") from e
    arch = gguf_field(reader, "general.architecture")
    family = family_for_gguf(arch)
    tensors = {t.name: t for t in reader.tensors}
    index = {c: tensors[n] for n in tensors if (c := _canonical_gguf(n)) is not None}
    if "embed" not in index:
        raise BundleError(f"{path}: GGUF has no token_embd.weight")
    n_heads = int(gguf_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(gguf_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    hidden = int(gguf_field(reader, f"{arch}.embedding_length"))
    vocab = int(index["embed"].shape[-1])  # GGUF ne order: [hidden, vocab]
    dims = ModelDims(
        n_layers=int(gguf_field(reader, f"{arch}.block_count")), hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=int(gguf_field(reader, f"{arch}.attention.key_length", hidden // n_heads)),
        ffn=int(gguf_field(reader, f"{arch}.feed_forward_length")), vocab=vocab,
    )
    scaling_type = gguf_field(reader, f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type and scaling_type not in ("none",):
        if scaling_type != "linear":
            raise UnsupportedModelError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported")
        rope_scaling = {"rope_type": "linear", "factor": float(gguf_field(reader, f"{arch}.rope.scaling.factor"))}
    config = ModelConfig(
        family=family, dims=dims,
        rms_eps=float(gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling, tie_embeddings="lm_head" not in index,
        max_positions=int(gguf_field(reader, f"{arch}.context_length", 2048)),
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
                        meta={"architecture": arch, "tensor_types": types}, _raw=raw)
