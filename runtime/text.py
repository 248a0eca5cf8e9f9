"""Text in and out: tokenizer, chat template (jinja2, no transformers), incremental detokenization."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import BundleError, PromptError
from .manifest import TokenizerInfo

CHAT_ROLES = ("system", "user", "assistant", "tool")
_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"  # private-use characters around a message index while rendering
_MARK_RE = re.compile("\ue000(\\d+)\ue001")


# Loop steps a chat template's range() calls may take in one rendering, all together: the sandbox bounds each call
# (100,000), not their product, and two nested loops of that length held a request (and the server) for good.
# Real templates loop over the messages, not over ranges.
RANGE_BUDGET = 100_000


def _budgeted_range(budget: int = RANGE_BUDGET) -> Any:
    left = [budget]

    def bounded(*args: int) -> range:
        r = range(*args)
        left[0] -= len(r)
        if left[0] < 0:
            raise PromptError(f"the bundle's chat template asks for over {budget} loop steps (range) in one "
                              f"rendering; it is not a chat template specedge runs")
        return r
    return bounded


def check_text(text: str, what: str) -> None:
    """PromptError unless ``text`` is encodable text (a lone surrogate, e.g. from undecodable bytes passed through
    surrogateescape or a JSON "\\ud800", is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"{what} is not valid UTF-8 text (a lone surrogate or undecodable byte at character "
                          f"{e.start}); pass text, not raw bytes") from None


class TextCodec:
    def __init__(self, bundle_dir: Path, info: TokenizerInfo):
        from tokenizers import Tokenizer

        self.info = info
        path = Path(bundle_dir) / info.file
        try:
            self.tok = Tokenizer.from_file(str(path))
            # A second instance that never parses special-token text: user content is encoded with it, so a literal
            # "<|im_end|>" typed by a user stays text and cannot forge a turn (its own object: the flag is per
            # tokenizer, and encoding runs outside the decoder's lock).
            self._tok_text = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise BundleError(f"{path} is not a tokenizer the tokenizers library can read ({e}); the bundle is "
                              f"damaged: export it again") from None
        if self.tok.get_vocab_size() != info.vocab_size:
            raise BundleError(f"{path} has {self.tok.get_vocab_size()} tokens, the manifest's "
                              f"tokenizer.vocab_size says {info.vocab_size}: the file is not this bundle's tokenizer")
        self._tok_text.encode_special_tokens = True
        self._template = None
        if info.chat_template:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg: str) -> None:
                raise PromptError(f"chat template: {msg}")

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(info.chat_template)
            except jinja2.TemplateError as e:
                raise BundleError(f"the bundle's chat template does not compile: {type(e).__name__}: {e}") from None

    def token_text(self, tid: int) -> str:
        return self.tok.id_to_token(tid) or ""

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if (self.info.add_bos if add_bos is None else add_bos) and self.info.bos_id is not None:
            if not ids or ids[0] != self.info.bos_id:
                ids = [self.info.bos_id] + ids
        return ids

    def encode_prompt(self, prompt: str | Sequence[dict[str, Any]], chat: bool | None = None) -> list[int]:
        """A prompt as text (through the chat template as a user message where ``chat``) or chat messages."""
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("the prompt is empty")
            check_text(prompt, "the prompt")
            if chat:
                return self.encode_chat([{"role": "user", "content": prompt}])
            return self.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise PromptError(f"a prompt is a string or a list of chat messages, got {type(prompt).__name__}")
        return self.encode_chat(prompt)

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Render the chat template and encode it, with special tokens parsed only in the template's own markup:
        each message's content is encoded as plain text (see ``_tok_text``)."""
        self._check_messages(messages)
        marked = [{**m, "content": f"{_MARK_OPEN}{i}{_MARK_CLOSE}"} for i, m in enumerate(messages)]
        rendered = self._render(marked)
        ids: list[int] = []
        for j, part in enumerate(_MARK_RE.split(rendered)):
            if j % 2 == 0:  # template markup
                ids += self.tok.encode(part, add_special_tokens=False).ids if part else []
            else:  # the content of message int(part)
                content = messages[int(part)]["content"]
                ids += self._tok_text.encode(content, add_special_tokens=False).ids if content else []
        return ids

    def _check_messages(self, messages: Sequence[dict[str, Any]]) -> None:
        if isinstance(messages, (str, bytes)) or not messages or any(
                not isinstance(m, dict) or "role" not in m or "content" not in m for m in messages):
            raise PromptError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if m["role"] not in CHAT_ROLES:
                raise PromptError(f"message {i}: role {m['role']!r} is not allowed; roles: {', '.join(CHAT_ROLES)}")
            if not isinstance(m["content"], str):
                raise PromptError(f"message {i}: content must be a string, got {type(m['content']).__name__}")
            check_text(m["content"], f"message {i}'s content")
            if _MARK_OPEN in m["content"] or _MARK_CLOSE in m["content"]:
                raise PromptError(f"message {i}: content holds U+E000/U+E001, which specedge reserves")

    def render_chat(self, messages: Sequence[dict[str, Any]]) -> str:
        self._check_messages(messages)
        return self._render(messages)

    def _render(self, messages: Sequence[dict[str, Any]]) -> str:
        if self._template is None:
            raise PromptError("this bundle has no chat template; pass a plain string prompt")
        bos = self.token_text(self.info.bos_id) if self.info.bos_id is not None else ""
        eos = self.token_text(self.info.eos_ids[0]) if self.info.eos_ids else ""
        try:
            return self._template.render(messages=list(messages), add_generation_prompt=True,
                                         bos_token=bos, eos_token=eos, range=_budgeted_range())
        except PromptError:
            raise
        except Exception as e:  # a broken template is the bundle's fault; say so in one line
            raise PromptError(f"the bundle's chat template failed to render: {type(e).__name__}: {e}") from None

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces, never emitting half a UTF-8 character.

    Decodes a small window (prefix_offset..end) and emits only what the newest tokens add;
    while the window's text ends in U+FFFD (an incomplete byte sequence) it waits. ``flush`` ends a generation
    with what is still held, so the whole text is the ids' decoding however they were pushed.
    """

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into emitted text
        self.held = ""  # what the last push held back (its text up to an incomplete character), else ""

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in new_ids)
        pending = self.peek()
        if pending and not pending.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            self.held = ""
            return pending
        self.held = pending
        return ""

    def peek(self) -> str:
        """The text the tokens not yet emitted add, as far as it goes (ending in U+FFFD while a character is
        incomplete)."""
        prefix_text = self.codec.decode(self.ids[self._prefix: self._read])
        full = self.codec.decode(self.ids[self._prefix:])
        return full[len(prefix_text):] if len(full) > len(prefix_text) else ""

    def flush(self) -> str:
        """At the end of a generation: the held-back text too (U+FFFD for a character the tokens left incomplete,
        as decoding all the ids gives), so the text does not depend on how the tokens were grouped into pushes."""
        tail = self.peek()
        self._prefix = self._read = len(self.ids)
        self.held = ""
        return tail
