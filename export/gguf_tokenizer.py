"""GGUF tokenizer metadata -> ``tokenizer.json``, with ``gguf`` + ``tokenizers`` only (no transformers, no torch).

The reading follows llama.cpp's own interpretation of the metadata (``src/llama-vocab.cpp``), because that is
what the GGUF's authors tested against:

* ``tokenizer.huggingface.json``, when present, is already a tokenizer.json and is written as is.
* ``tokenizer.ggml.model``: ``gpt2`` -> byte-level BPE, merges from ``tokenizer.ggml.merges`` (each split at the
  first space after position 0; rank = index); ``llama`` -> SentencePiece-style BPE with byte fallback, merges
  derived from ``tokenizer.ggml.scores`` (a merge's priority is the score of the piece it makes), ``▁`` for
  spaces and a ``▁`` prefix per ``add_space_prefix`` (default on).
* ``tokenizer.ggml.token_type``: 3 CONTROL -> special added tokens (2 UNKNOWN too); 4 USER_DEFINED -> non-special
  added tokens (always split out, as llama.cpp does); 1 NORMAL, 5 UNUSED, 6 BYTE -> vocabulary only. Every id
  keeps its index, so ids stay aligned with the embedding rows.
* ``tokenizer.ggml.pre`` selects the split rules (:data:`PRE_TOKENIZERS`); an unknown or missing one is refused.
* ``add_bos_token`` falls back to llama.cpp's default for the model/pre-tokenizer when the key is absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specedge.runtime.errors import BundleError

# Token types (gguf-py's TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class PreTokenizer:
    """How a byte-level BPE vocabulary splits text before merging (one entry of llama.cpp's pre-type table)."""

    splits: tuple[str, ...]  # regexes applied in order; every match becomes its own piece
    nfc: bool = False  # NFC-normalize first (Qwen2's own tokenizer does)
    ignore_merges: bool = False  # a piece that is itself a token is taken whole (llama3)
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token


_LLAMA3_PT = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PT = PreTokenizer((_QWEN2,), nfc=True)
_DIGITS_PT = PreTokenizer((r"\p{N}", _GPT2))
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "llama3": _LLAMA3_PT, "llama-v3": _LLAMA3_PT, "llama-bpe": _LLAMA3_PT,
    "qwen2": _QWEN2_PT, "deepseek-r1-qwen": _QWEN2_PT,
    "smollm": _DIGITS_PT, "starcoder": _DIGITS_PT, "refact": _DIGITS_PT,
    "gpt-2": PreTokenizer((_GPT2,)),
}
MODELS = ("gpt2", "llama")


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer fields of a GGUF, read once."""

    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    fields: dict[str, Any]  # every other tokenizer.* scalar/string field, by key

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"tokenizer.ggml.{key}", default)


def read_vocab(path: Path) -> GgufVocab:
    import gguf

    reader = gguf.GGUFReader(str(path))
    f: dict[str, Any] = {}
    arrays: dict[str, list] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        (arrays if isinstance(value, list) else f)[key] = value
    model = f.get("tokenizer.ggml.model")
    tokens = arrays.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise BundleError(f"{path.name}: no tokenizer in the GGUF metadata (tokenizer.ggml.model/tokens missing)")
    types = arrays.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise BundleError(f"{path.name}: {len(tokens)} tokens but {len(types)} token types")
    return GgufVocab(model, f.get("tokenizer.ggml.pre"), tokens, [int(t) for t in types],
                     arrays.get("tokenizer.ggml.scores"), arrays.get("tokenizer.ggml.merges"), f)


def default_add_bos(v: GgufVocab) -> bool:
    """llama.cpp's add_bos when the GGUF does not say: on for SentencePiece and the llama3 family, else off."""
    if v.model == "llama":
        return True
    pt = PRE_TOKENIZERS.get(v.pre or "")
    return bool(pt and pt.add_bos)


def special_ids(v: GgufVocab) -> dict[str, int | None]:
    """bos / eos / eot / eom / unk / pad ids (llama.cpp's defaults for SentencePiece where a key is absent)."""
    spm = v.model == "llama"
    out: dict[str, int | None] = {}
    for name, key, spm_default in (("bos", "bos_token_id", 1), ("eos", "eos_token_id", 2),
                                   ("eot", "eot_token_id", None), ("eom", "eom_token_id", None),
                                   ("unk", "unknown_token_id", 0),
                                   ("pad", "padding_token_id", None)):
        val = v.get(key, spm_default if spm else None)
        out[name] = int(val) if val is not None and 0 <= int(val) < len(v.tokens) else None
    return out


def chat_templates(v: GgufVocab) -> dict[str, str]:
    """{"default": tokenizer.chat_template, name: tokenizer.chat_template.<name>, ...} (only those present)."""
    out = {}
    if isinstance(t := v.fields.get("tokenizer.chat_template"), str):
        out["default"] = t
    for key, val in v.fields.items():
        if key.startswith("tokenizer.chat_template.") and isinstance(val, str):
            out[key.removeprefix("tokenizer.chat_template.")] = val
    return out


def build_tokenizer_json(path: Path) -> tuple[str, GgufVocab]:
    """The tokenizer.json text for a GGUF file, and the vocabulary it was built from."""
    v = read_vocab(path)
    hf = v.fields.get("tokenizer.huggingface.json")
    if isinstance(hf, str) and hf.strip():
        return hf, v
    if v.model == "gpt2":
        tok = _byte_level_bpe(v, path.name)
    elif v.model == "llama":
        tok = _sentencepiece_bpe(v)
    else:
        raise BundleError(f"{path.name}: tokenizer model {v.model!r} is not supported; supported: {', '.join(MODELS)} "
                          f"(or a GGUF that carries tokenizer.huggingface.json)")
    _add_tokens(tok, v)
    return tok.to_str(), v


def _vocab(v: GgufVocab) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(v.tokens):
        vocab.setdefault(t, i)  # a duplicate text keeps its first id; the later id stays unreachable by encoding
    return vocab


def _byte_level_bpe(v: GgufVocab, name: str):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    pt = PRE_TOKENIZERS.get(v.pre or "")
    if pt is None:
        raise BundleError(f"{name}: pre-tokenizer {v.pre!r} is not supported (llama.cpp warns that output quality "
                          f"degrades without the right one); supported: {', '.join(PRE_TOKENIZERS)}")
    if not v.merges:
        raise BundleError(f"{name}: a gpt2 tokenizer needs tokenizer.ggml.merges, which this GGUF lacks")
    merges = []
    for m in v.merges:
        i = m.find(" ", 1)
        if i < 0:
            raise BundleError(f"{name}: malformed merge {m!r} (expected 'left right')")
        merges.append((m[:i], m[i + 1:]))
    tok = Tokenizer(models.BPE(_vocab(v), merges, ignore_merges=pt.ignore_merges))
    if pt.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pt.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(v: GgufVocab, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece merges from scores: every split of a piece into two known pieces, ranked by the piece's
    score (higher first), so BPE's lowest-rank-first equals SentencePiece's highest-score-first."""
    assert v.scores is not None
    ranked = []
    for piece, pid in vocab.items():
        if v.types[pid] != NORMAL or len(piece) < 2:
            continue
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                ranked.append((-float(v.scores[pid]), pid, i, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(v: GgufVocab):
    from tokenizers import Tokenizer, decoders, models, normalizers

    if v.scores is None or len(v.scores) != len(v.tokens):
        raise BundleError("a llama (SentencePiece) tokenizer needs one tokenizer.ggml.scores entry per token")
    vocab = _vocab(v)
    unk = special_ids(v)["unk"]
    tok = Tokenizer(models.BPE(vocab, _spm_merges(v, vocab), unk_token=v.tokens[unk] if unk is not None else None,
                               fuse_unk=True, byte_fallback=True))
    prefix = bool(v.get("add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _add_tokens(tok, v: GgufVocab) -> None:  # noqa: ANN001
    """CONTROL/UNKNOWN -> special added tokens, USER_DEFINED -> added tokens matched whole in raw text."""
    from tokenizers import AddedToken

    special, user = [], []
    for _i, (t, ty) in enumerate(zip(v.tokens, v.types)):
        if ty in (CONTROL, UNKNOWN) and t:
            special.append(AddedToken(t, special=True, normalized=False))
        elif ty == USER_DEFINED and t:
            user.append(AddedToken(t, special=False, normalized=False))
    if user:
        tok.add_tokens(user)
    if special:
        tok.add_special_tokens(special)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n != len(v.tokens):  # added tokens are existing vocab entries: nothing may be appended
        raise BundleError(f"tokenizer build produced {n} ids for {len(v.tokens)} GGUF tokens (duplicate token texts?)")


def write_gguf_tokenizer(path: Path, dst: Path) -> dict[str, Any]:
    """Write ``dst`` (tokenizer.json) from a GGUF and return bos/eos/add_bos/chat template for the manifest."""
    text, v = build_tokenizer_json(path)
    dst.write_text(text, encoding="utf-8")
    ids = special_ids(v)
    add_bos = v.get("add_bos_token")
    eos = [i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None]
    templates = chat_templates(v)
    return {"chat_template": templates.get("default"), "chat_templates": templates, "bos_id": ids["bos"],
            "eos_ids": list(dict.fromkeys(eos)),
            "add_bos": bool(add_bos) if add_bos is not None else default_add_bos(v)}

