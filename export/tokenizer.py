"""Tokenizer for the bundle: ``tokenizer.json`` + chat template + bos/eos, and the draft check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from specedge.runtime.errors import BundleError, SpecEdgeError, VocabularyMismatchError
from specedge.runtime.manifest import TokenizerInfo

from .gguf_tokenizer import write_gguf_tokenizer
from .loaders import WeightSource

TOKENIZER_FILE = "tokenizer.json"
# End-of-turn tokens that chat models emit besides their declared eos.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "</s>")


def write_tokenizer(src: WeightSource, out_dir: Path) -> TokenizerInfo:
    """Write tokenizer.json into out_dir and return what the manifest records."""
    from tokenizers import Tokenizer

    dst = Path(out_dir) / TOKENIZER_FILE
    try:
        if src.kind == "hf":
            info = _from_hf_dir(src.path, dst)
        else:
            info = write_gguf_tokenizer(src.path, dst)  # gguf + tokenizers only: no torch
        tok = Tokenizer.from_file(str(dst))
    except SpecEdgeError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers raises bare Exceptions; a damaged vocabulary, not our bug
        raise BundleError(f"{src.path}: its tokenizer cannot be read ({type(e).__name__}: {str(e)[:200]})") from None
    eos = list(info["eos_ids"])
    for t in _END_TOKENS:
        tid = tok.token_to_id(t)
        if tid is not None and tid not in eos:
            eos.append(tid)
    named = {k: v for k, v in info.get("chat_templates", {}).items() if k != "default"}
    return TokenizerInfo(file=TOKENIZER_FILE, chat_template=info["chat_template"], bos_id=info["bos_id"],
                         eos_ids=tuple(eos), add_bos=info["add_bos"], vocab_size=tok.get_vocab_size(),
                         chat_templates=named)


def _from_hf_dir(d: Path, dst: Path) -> dict[str, Any]:
    from tokenizers import Tokenizer

    src = d / TOKENIZER_FILE
    if not src.is_file():
        raise BundleError(f"{d} has no tokenizer.json (a fast tokenizer file is required)")
    shutil.copyfile(src, dst)
    tok = Tokenizer.from_file(str(dst))
    tc = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").is_file() else {}
    gen = json.loads((d / "generation_config.json").read_text()) if (d / "generation_config.json").is_file() else {}
    template = tc.get("chat_template")
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()

    def tid(v: Any) -> int | None:
        if isinstance(v, dict):
            v = v.get("content")
        return tok.token_to_id(v) if isinstance(v, str) else None

    eos: list[int] = []
    g_eos = gen.get("eos_token_id")
    eos += g_eos if isinstance(g_eos, list) else ([g_eos] if isinstance(g_eos, int) else [])
    if (e := tid(tc.get("eos_token"))) is not None and e not in eos:
        eos.append(e)
    bos = gen.get("bos_token_id") if isinstance(gen.get("bos_token_id"), int) else tid(tc.get("bos_token"))
    return {"chat_template": template, "bos_id": bos, "eos_ids": eos, "add_bos": bool(tc.get("add_bos_token", False))}


def check_same_vocab(target_json: Path, draft_json: Path) -> None:
    """Refuse a draft whose token -> id map differs from the target's."""
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(target_json)).get_vocab(with_added_tokens=True)
    d = Tokenizer.from_file(str(draft_json)).get_vocab(with_added_tokens=True)
    if t == d:
        return
    diff = [tok for tok in t if d.get(tok) != t[tok]]
    extra = [tok for tok in d if tok not in t]
    raise VocabularyMismatchError(
        f"the draft's tokenizer differs from the target's: {len(diff)} of {len(t)} target tokens map to another id "
        f"or are missing in the draft (e.g. {diff[:3]}), {len(extra)} draft tokens are unknown to the target "
        f"(e.g. {extra[:3]}); speculative decoding needs one shared tokenizer"
    )
