"""Shared fixtures: a tiny BPE tokenizer, tiny random HF models, and bundles exported from them."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

# every test decoder times its own steps (SpecDecoder.cost_model); the cache of step costs is tested on its own
os.environ["SPECEDGE_COST_CACHE"] = "off"

CORPUS = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris.",
    "import numpy as np\nx = np.arange(10)\nprint(x.sum())\n",
    "Speculative decoding lets a cheap draft propose tokens that the target verifies.",
    "héllo wörld — ünïcödé ✓ 数据 データ",
] * 20
VOCAB = 320
DRAFT_HEAD = 160  # the "model-head" bundle's draft head: ids 0..159
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
         "add_bos_token": False}))


# What each family's tiny model sets beyond the shared dimensions: values far from 1 and from the defaults, so that
# a multiplier or a layer quirk the export dropped shows in the logits.
FAMILY_EXTRAS = {
    "llama": {}, "qwen2": {},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "qwen3": {"head_dim": 32},  # Qwen3's head_dim is its own, not hidden / heads
    "granite": {"embedding_multiplier": 3.0, "residual_multiplier": 0.4, "attention_multiplier": 0.09,
                "logits_scaling": 2.5},
    # 6 layers of gemma3: five local ones, then a global one (llama.cpp's rule); a window no step reaches
    "gemma3": {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 128, "pad_token_id": 0},
    # 4 layers of gemma2: local, global, local, global; caps far below the real ones (50, 30), so that they bite
    "gemma2": {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 128, "pad_token_id": 0,
               "attn_logit_softcapping": 1.5, "final_logit_softcapping": 2.0},
    "smollm3": {"pad_token_id": 0},  # every 4th layer without RoPE: the config's default, and llama.cpp's rule
    # phi3 (Phi-4-mini's shape of layer): fused q|k|v and gate|up, RoPE on half of each head's 32 dims, LongRoPE
    # trained at 32 positions, so that every graph here (S_max 96 and up) takes its long factors
    # (the factors, one per rotated pair: make_hf_model)
    "phi3": {"num_attention_heads": 2, "num_key_value_heads": 1, "partial_rotary_factor": 0.5, "pad_token_id": 0,
             "original_max_position_embeddings": 32},
    "mistral": {},
}


def make_hf_model(path: Path, family: str = "llama", layers: int = 2, hidden: int = 64, seed: int = 0,
                  init: float = 0.2, tie: bool = False, **config) -> Path:
    import torch
    import transformers

    names = {"llama": "Llama", "llama3": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "granite": "Granite",
             "smollm3": "SmolLM3", "gemma3": "Gemma3", "gemma2": "Gemma2", "mistral": "Mistral", "phi3": "Phi3"}[family]
    config_cls = getattr(transformers, f"{names}TextConfig" if family == "gemma3" else f"{names}Config")
    model_cls = getattr(transformers, f"{names}ForCausalLM")
    extras = {**FAMILY_EXTRAS[family], **config}  # config: the family's own keys overridden (a sliding window)
    torch.manual_seed(seed)
    base = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=tie, initializer_range=init, bos_token_id=1, eos_token_id=2,
                # gemma3: its own two bases, 10^6 for the global layers and 10^4 for the local ones
                **({} if family in ("gemma3", "phi3") else {"rope_theta": 10000.0}))
    kw = {**base, **extras}
    if family == "phi3":  # LongRoPE's short and long factors, one per rotated pair of a head's dims
        pairs = int(hidden // kw["num_attention_heads"] * kw["partial_rotary_factor"]) // 2
        kw["rope_scaling"] = {"rope_type": "longrope", "rope_theta": 10000.0,
                              "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
                              "long_factor": [1.5 + 0.4 * i for i in range(pairs)]}
    cfg = config_cls(**kw)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # norm weights away from 1 (their init): a norm applied to the wrong values shows
        for name, p in model.named_parameters():
            if "norm" in name and family not in ("llama", "qwen2"):
                p.add_(torch.randn_like(p) * 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    make_tokenizer(path)
    if family in ("gemma2", "gemma3"):  # else transformers takes Gemma's own tokenizer class, which adds its own tokens
        cfg_path = path / "tokenizer_config.json"
        tok_cfg = {**json.loads(cfg_path.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}
        cfg_path.write_text(json.dumps(tok_cfg))
    if family == "phi3":  # llama.cpp's converter reads a Phi-3/4 vocabulary as GPT-2's BPE when the config says so
        cfg_path = path / "tokenizer_config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("llama") / "m", "llama")


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("qwen") / "m", "qwen2", tie=True)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("draft") / "m", "llama", layers=1, hidden=32, seed=1)


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, tiny_llama, tiny_draft) -> dict[str, Path]:
    """Bundles over the tiny llama target: K=8, S_max=256, P=16."""
    from specedge.export.bundle import ExportOptions, export_bundle

    root = tmp_path_factory.mktemp("bundles")
    opts = ExportOptions(k=8, max_context=256, prefill_chunk=16)
    out = {}
    for name, draft in {"lookup": "prompt-lookup", "model": tiny_draft, "self": tiny_llama}.items():
        out[name] = export_bundle(tiny_llama, draft, root / name, opts).out
    # the same draft with half a head (--draft-vocab): it can never propose ids 160..319, half the target's tokens
    out["model-head"] = export_bundle(tiny_llama, tiny_draft, root / "model-head",
                                      dataclasses.replace(opts, draft_vocab=DRAFT_HEAD)).out
    return out


@pytest.fixture(scope="session")
def decoders(bundles):
    from specedge.runtime import SpecDecoder

    return {name: SpecDecoder.load(path) for name, path in bundles.items()}
