"""Built-in prompt suites and user prompt files.

A suite is a few prompts of one kind. They differ in how much of the answer is already in
the context, which is what decides whether prompt lookup pays (code editing: a lot;
chat: almost nothing) and how predictable the text is for a draft model.

User files are JSONL in UTF-8, one prompt per line (lines end at "\n" only; a U+2028 inside a
string is text): ``{"text": "..."}`` (sent through the chat template, like the built-ins, unless
``"raw": true``) or ``{"messages": [{"role": ..., "content": ...}, ...]}`` with roles from
``CHAT_ROLES``; optional ``"suite"`` (default "custom") and ``"id"``. Every line is checked when
the file is read; :func:`~specedge.runtime.bench.runner.check_prompts` checks that each prompt
fits a bundle's context before any model is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import PromptError
from ..text import CHAT_ROLES

EDIT_CODE = '''def add_all(xs):
    tmp = 0
    for x in xs:
        tmp = tmp + x
    return tmp


def mean(xs):
    tmp = add_all(xs)
    return tmp / len(xs)


def variance(xs):
    m = mean(xs)
    tmp = 0
    for x in xs:
        tmp = tmp + (x - m) ** 2
    return tmp / len(xs)
'''

_EDIT_CODE_2 = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        if name in self.items:
            self.items[name] = self.items[name] + count
        else:
            self.items[name] = count

    def remove(self, name, count):
        if name not in self.items:
            return False
        self.items[name] = self.items[name] - count
        if self.items[name] <= 0:
            del self.items[name]
        return True
'''

_TEXT_1 = (
    "The Jetson Orin Nano is a small computer for robots and cameras. It pairs six Arm CPU cores with an "
    "Ampere GPU and eight gigabytes of memory that the CPU and GPU share. Because the memory is shared and "
    "its bandwidth is about 68 gigabytes per second, a language model running on it is limited by how fast "
    "its weights can be read, not by how fast the GPU can multiply. A model with one billion parameters in "
    "16-bit floats needs two gigabytes per generated token, so the device can produce at most about thirty "
    "tokens per second. Quantizing the weights to four bits cuts the bytes per token by four and raises that "
    "ceiling accordingly, at a small cost in accuracy."
)

_TEXT_2 = (
    "Speculative decoding speeds up text generation without changing its output. A small draft model "
    "guesses the next few tokens cheaply, and the large model checks all the guesses in one forward pass. "
    "Tokens are accepted with a rule that keeps the large model's distribution exactly, so the output is "
    "the same as if the large model had generated alone. The gain depends on how often the guesses are "
    "right and on how much the check of several tokens costs compared with generating one. When guesses "
    "are rarely right, the extra work makes generation slower, which is why a good system measures and "
    "switches speculation off when it does not pay."
)

SUITES: dict[str, list[str]] = {
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring and type hints.",
        "Write a Python class Stack with push, pop, peek and is_empty methods, and a short usage example.",
        "Write a Python function that checks whether a string is a valid IPv4 address. Explain it briefly.",
    ],
    "edit": [
        f"Rename the variable `tmp` to `total` in this code and return the full code:\n```python\n{EDIT_CODE}```",
        f"Add type hints and a one-line docstring to every function in this code, and return the full code:\n"
        f"```python\n{EDIT_CODE}```",
        f"Change `remove` so that it raises KeyError for an unknown name instead of returning False. "
        f"Return the full class:\n```python\n{_EDIT_CODE_2}```",
    ],
    "chat": [
        "Explain in a short paragraph why the sky is blue.",
        "Give three tips for writing readable code, with one sentence of explanation each.",
        "What is the difference between a process and a thread? Answer in a few sentences.",
    ],
    "summarize": [
        f"Summarize this text in two sentences:\n\n{_TEXT_1}",
        f"Summarize this text in two sentences:\n\n{_TEXT_2}",
        f"Write a one-sentence summary and then three bullet points of key facts from this text:\n\n{_TEXT_1}",
    ],
    "json": [
        "Return only a JSON object describing a book, with the fields title, author, year and genres (a list).",
        "Return only a JSON array of three users, each an object with id (integer), name, email and active (boolean).",
        "Convert this to a JSON object and return only the JSON: name Ada Lovelace, born 1815, died 1852, "
        "known for the first published computer program, languages English and French.",
    ],
}


@dataclass(frozen=True)
class BenchPrompt:
    suite: str
    id: str
    prompt: str | tuple[dict[str, Any], ...]  # text (chat-wrapped unless raw) or chat messages
    raw: bool = False  # True: plain text fed without the chat template
    where: str = ""  # where it was read: "FILE:LINE" for a prompt file's ("" for a built-in)

    def origin(self) -> str:
        """Where the prompt comes from, as error messages name it."""
        return self.where or f"suite {self.suite}, prompt {self.id}"

    def as_request(self, templated: bool = True) -> tuple[Any, bool]:
        """(prompt, chat) as SpecDecoder.stream takes them. ``templated`` False (a bundle without a chat template: a
        base model's file): the prompt's text as it is, a chat's contents one per line."""
        if not templated:
            text = self.prompt if isinstance(self.prompt, str) else "\n".join(m["content"] for m in self.prompt)
            return text, False
        if isinstance(self.prompt, tuple):
            return list(self.prompt), False
        return self.prompt, not self.raw


def suite_prompts(names: list[str] | tuple[str, ...], per_suite: int = 0) -> list[BenchPrompt]:
    """The built-in prompts of the named suites (the first ``per_suite`` of each if > 0)."""
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise PromptError(f"unknown suite(s) {unknown}; built-in suites are {sorted(SUITES)}")
    if per_suite < 0:
        raise PromptError(f"per_suite must be >= 0 (0: every prompt of each suite), got {per_suite}")
    return [BenchPrompt(n, f"{n}-{i}", text) for n in names for i, text in enumerate(SUITES[n][: per_suite or None])]


def load_prompts(path: str | Path) -> list[BenchPrompt]:
    """Read a JSONL prompt file (format in the module docstring); errors name the line."""
    out: list[BenchPrompt] = []
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise PromptError(f"cannot read prompt file {p}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        no = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise PromptError(f"{p}:{no}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {col}); save the prompt "
                          f"file as UTF-8") from None
    # split on "\n" only: str.splitlines() would also split at U+2028, U+0085, ... inside a JSON string
    for no, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{p}:{no}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or ("text" in obj) == ("messages" in obj):
            raise PromptError(f"{p}:{no}: each line must be an object with exactly one of 'text' or 'messages'")
        suite, pid = str(obj.get("suite", "custom")), str(obj.get("id", f"{p.stem}-{no}"))
        if "text" in obj:
            if not isinstance(obj["text"], str) or not obj["text"]:
                raise PromptError(f"{p}:{no}: 'text' must be a non-empty string")
            out.append(BenchPrompt(suite, pid, obj["text"], bool(obj.get("raw", False)), where=f"{p}:{no}"))
        else:
            msgs = obj["messages"]
            if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "role" in m and "content" in m
                                                              for m in msgs)):
                raise PromptError(f"{p}:{no}: 'messages' must be a non-empty list of {{role, content}} objects")
            bad = [i for i, m in enumerate(msgs) if not isinstance(m["content"], str) or not isinstance(m["role"], str)]
            if bad:  # checked before any model work, not after the first prompts ran
                raise PromptError(f"{p}:{no}: message {bad[0]}: 'role' and 'content' must be strings")
            roles = [(i, m["role"]) for i, m in enumerate(msgs) if m["role"] not in CHAT_ROLES]
            if roles:
                raise PromptError(f"{p}:{no}: message {roles[0][0]}: role {roles[0][1]!r} is not allowed; roles: "
                                  f"{', '.join(CHAT_ROLES)}")
            out.append(BenchPrompt(suite, pid, tuple(msgs), where=f"{p}:{no}"))
    if not out:
        raise PromptError(f"{p}: no prompts found")
    return out
