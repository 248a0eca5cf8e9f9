"""A request's state between rounds, the events a stream yields, and how committed tokens become text: eos,
max_new_tokens and stop strings end a request exactly where plain decoding would, however a round grouped them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import ContextLengthError, PromptError
from .manifest import Manifest
from .sampling import SamplingParams
from .stats import Stats
from .text import IncrementalDetokenizer


@dataclass
class StreamEvent:
    text: str  # new text since the previous event (may be "")
    token_ids: list[int]  # tokens committed in this event
    finished: bool = False
    finish_reason: str | None = None  # "eos" | "stop" | "length"
    stats: Stats | None = None  # on the final event


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats


@dataclass
class Request:
    """One request's state between rounds: its committed tokens, sampling state, text and statistics."""

    tokens: np.ndarray  # [S_max] int64, committed tokens in tokens[:n]
    n: int
    n_prompt: int
    params: SamplingParams
    rng: np.random.Generator
    stats: Stats
    detok: IncrementalDetokenizer
    text: str = ""
    emitted_chars: int = 0
    finish: str | None = None
    stop_hold: int = 0  # the most chars held back while they could start a stop string (longest stop - 1)
    pending: list[int] = field(default_factory=list)
    slot: int = 0  # the target cache's slot its rows are in (SpecDecoder.slots)

    @property
    def generated(self) -> int:
        return self.n - self.n_prompt



def check_fits(manifest: Manifest, n_prompt: int, params: SamplingParams) -> None:
    """A request fits the bundle's KV buffers: its prompt, its new tokens and one verify step."""
    if n_prompt == 0:
        raise PromptError("the prompt encodes to zero tokens")
    S, K = manifest.max_context, manifest.k
    need = n_prompt + params.max_new_tokens + K + 1
    if need > S:
        raise ContextLengthError(
            f"bundle built for S_max={S}, request needs {need} (prompt {n_prompt} + max_new "
            f"{params.max_new_tokens} + K+1 {K + 1}); shorten the prompt, lower max_new_tokens, "
            f"or re-export with a larger --max-context")


def stop_prefix_len(text: str, stops: tuple[str, ...], start: int = 0) -> int:
    """The length of the longest suffix of ``text[start:]`` that is a proper prefix of a stop string: the text a
    stream must hold back, since the next tokens could complete a stop string there. Everything before it can
    never be part of a match (a stop string already complete in ``text`` was found before), so it streams now."""
    best = 0
    for s in stops:
        i = text.find(s[0], max(start, len(text) - len(s) + 1))
        while 0 <= i and len(text) - i > best:  # left to right: the first that fits is this string's longest
            if s.startswith(text[i:]):
                best = len(text) - i
                break
            i = text.find(s[0], i + 1)
    return best


def commit(req: Request, eos_ids: tuple[int, ...], new: list[int]) -> StreamEvent:
    """Append accepted tokens, apply eos / max_new / stop strings, and produce the event. With stop strings
    the tokens are detokenized one at a time, so a round that accepted several tokens stops exactly where
    plain decoding would (no token past the one that completes a stop string); without, in one push. A request
    that ends by eos or length ends its text with the detokenizer's held-back tail: the text is the ids'
    decoding whichever rounds committed them."""
    p = req.params
    out: list[int] = []
    for t in new:
        if not p.ignore_eos and t in eos_ids:
            req.finish = "eos"
            break
        out.append(t)
        if req.generated + len(out) >= p.max_new_tokens:
            req.finish = "length"
            break
    stop_at = None  # index in req.text where the first stop string starts
    if p.stop:
        for j, t in enumerate(out):
            req.text += req.detok.push([t])
            # with what push held back: a token that completes a stop string and starts a character ends here
            seen = req.text + req.detok.held if req.detok.held else req.text
            hits = [i for s in p.stop if (i := seen.find(s, max(0, req.emitted_chars - len(s)))) >= 0]
            if hits:
                stop_at, req.finish, out, req.text = min(hits), "stop", out[: j + 1], seen
                break
    else:
        req.text += req.detok.push(out)
    if req.finish in ("eos", "length"):  # the held-back tail ends the text, however the rounds grouped tokens
        req.text += req.detok.flush()
    req.tokens[req.n: req.n + len(out)] = out
    req.n += len(out)
    if stop_at is not None:
        req.text = req.text[:stop_at]
        emit_to = stop_at
    elif p.stop and req.finish is None:  # hold back only what could still begin a stop string
        start = max(req.emitted_chars, len(req.text) - req.stop_hold)
        emit_to = len(req.text) - stop_prefix_len(req.text, p.stop, start)
    else:
        emit_to = len(req.text)
    emit_to = max(emit_to, req.emitted_chars)
    piece = req.text[req.emitted_chars: emit_to]
    req.emitted_chars = emit_to
    done = req.finish is not None
    if done:
        req.stats.finish_reason = req.finish
    req.stats.new_tokens = req.generated
    return StreamEvent(piece, out, done, req.finish, req.stats if done else None)
