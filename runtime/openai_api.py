"""The OpenAI-compatible API's requests: what a body may hold and what it means (prompt or chat messages, sampling,
stop strings, streaming, specedge's ``speculation`` extension), and the errors in OpenAI's shape. Pure functions over
parsed JSON: the HTTP server (:mod:`.server`) and any other front end take requests through them."""

from __future__ import annotations

import reprlib
import unicodedata
from typing import Any

from .errors import OptionError, SamplingParamsError
from .sampling import SamplingParams
from .text import CHAT_ROLES

DRAFTERS = ("auto", "hybrid", "model", "prompt-lookup", "lookup", "none", "off")
STOP_STRINGS = 4  # OpenAI's limit
# A stop string's length limit: ample for the markers people stop at (role tags, fences, sentinels). A stream holds
# back only text that could begin one, so the limit bounds the matching work per token, not the latency.
STOP_CHARS = 256

shown = reprlib.Repr()  # a field's value in an error message: short, and bounded however deep the JSON nests
shown.maxstring = shown.maxother = 60
shown.maxlevel = 3


def check_api_key(key: str | None) -> str | None:
    """``key`` if an HTTP client can send it as ``Authorization: Bearer KEY``: one or more visible ASCII characters
    (``!`` to ``~``). None serves without a key; an empty or blank key is refused, never read as "no key". The
    error names the offending character, never the key."""
    if key is None:
        return None
    what = "the API key (--api-key or SPECEDGE_API_KEY)"
    allowed = "one or more visible ASCII characters (! to ~: no spaces, control or non-ASCII characters)"
    if not isinstance(key, str):
        raise OptionError(f"{what} must be a string of {allowed}, got {type(key).__name__}")
    if not key:
        raise OptionError(f"{what} is empty; give {allowed}, or leave the option and the variable out to serve "
                          f"without a key")
    bad = next((i for i, c in enumerate(key) if not "!" <= c <= "~"), None)
    if bad is not None:
        c = key[bad]
        raise OptionError(f"{what} has U+{ord(c):04X} ({unicodedata.name(c, 'a control character')}) at position "
                          f"{bad} of its {len(key)} characters, which HTTP clients cannot send in a header as "
                          f"given; allowed: {allowed}")
    return key


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _num(body: dict, name: str, kind: type, default: Any, lo: float, hi: float) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, kind) and not isinstance(v, bool) if kind is int else \
        isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok or not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be a number in [{lo}, {hi}], got {shown.repr(v)}", param=name)
    return v


def parse_request(body: Any, chat: bool, max_context: int, k_max: int, drafter: str = "auto"
                  ) -> tuple[Any, SamplingParams, str, int | None]:
    """OpenAI request fields -> (prompt, SamplingParams, drafter, k). Unknown fields are ignored, invalid ones
    raise ApiError(400) naming the field and what is allowed. ``drafter``: for a request that names none."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if chat:
        prompt = chat_messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    # the newer name wins where both are given; an explicit null is "not given" (some clients send every field)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _num(body, name, int, 128, 1, max_context)
    unsupported = {"n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []),
                   "response_format": (None, {"type": "text"}), "presence_penalty": (None, 0),
                   "frequency_penalty": (None, 0), "logit_bias": (None, {})}
    for name, fine in unsupported.items():  # not implemented: said, not silently ignored
        if name in body and body[name] not in fine:
            raise ApiError(400, f"'{name}' {shown.repr(body[name])} is not supported by this server (one choice, "
                                f"plain text, no logprobs, tools, penalties or logit bias); leave it out", param=name,
                           code="unsupported_parameter")
    stop = parse_stop(body.get("stop"))
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63):
        raise ApiError(400, f"'seed' must be an integer in [0, 2^63), got {shown.repr(seed)}", param="seed")
    spec = body.get("speculation") or {}
    if not isinstance(spec, dict):
        raise ApiError(400, "'speculation' must be an object {drafter, k}", param="speculation")
    drafter = spec.get("drafter", drafter)
    if not isinstance(drafter, str) or drafter not in DRAFTERS:
        raise ApiError(400, f"'speculation.drafter' must be one of {', '.join(DRAFTERS)}, got {shown.repr(drafter)}",
                       param="speculation.drafter")
    k = _num(spec, "k", int, None, 0, k_max) if "k" in spec else None
    try:
        params = SamplingParams(max_new_tokens=max_tokens,
                                temperature=_num(body, "temperature", float, 1.0, 0.0, 2.0),
                                top_p=_num(body, "top_p", float, 1.0, 1e-9, 1.0),
                                top_k=_num(body, "top_k", int, 0, 0, 1 << 20), seed=seed, stop=stop)
    except SamplingParamsError as e:
        raise ApiError(400, str(e)) from None
    return prompt, params, drafter, k


def chat_messages(msgs: Any) -> list[dict]:
    """OpenAI chat messages as the chat template takes them, meaning what they mean to OpenAI: the ``developer``
    role is ``system`` (its newer name), ``content`` as a list of text parts is their texts joined by newlines, and
    an assistant's ``content: null`` (or none: a turn that only called tools) is empty. Parts a text model cannot
    read (images, audio, files) are refused, as is null content in any other role."""
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, f"'messages' must be a non-empty list of {{role, content}} objects, got {shown.repr(msgs)}",
                       param="messages")
    roles = ", ".join(["system", "developer (as system)", *CHAT_ROLES[1:]])
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be a {{role, content}} object, got {shown.repr(m)}",
                           param=f"messages[{i}]")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}]: role {shown.repr(role)} is not allowed; roles: {roles}",
                           param=f"messages[{i}].role")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise ApiError(400, f"messages[{i}] ({m['role']}) has no content (missing or null); only an "
                                    f"assistant message may leave it out", param=f"messages[{i}].content")
            content = ""
        elif isinstance(content, list):
            content = "\n".join(_text_part(p, i, j) for j, p in enumerate(content))
        out.append({**m, "role": role, "content": content})
    return out


def _text_part(part: Any, i: int, j: int) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    got = f"a part of type {shown.repr(kind)}" if isinstance(kind, str) else shown.repr(part)
    raise ApiError(400, f"messages[{i}].content[{j}] is {got}; this server serves a text model and reads only text "
                        f"parts {{\"type\": \"text\", \"text\": ...}}", param=f"messages[{i}].content[{j}]")


def parse_stop(stop: Any) -> tuple[str, ...]:
    """``stop`` as OpenAI takes it, a string or a list of up to 4, each here of 1 to STOP_CHARS characters."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= STOP_CHARS for s in stops)):
        if isinstance(stops, list) and all(isinstance(s, str) for s in stops):
            got = f"{len(stops)} string(s) of {', '.join(str(len(s)) for s in stops[:8])} characters"
        else:
            got = shown.repr(stop)
        raise ApiError(400, f"'stop' must be a string or a list of up to {STOP_STRINGS} strings, each of 1 to "
                            f"{STOP_CHARS} characters; got {got}", param="stop")
    return tuple(stops)


def parse_streaming(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) from a request's ``stream`` and ``stream_options``; invalid ones raise ApiError(400)
    before anything is queued."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {shown.repr(stream)}", param="stream")
    opts = body.get("stream_options")
    if opts is None:
        return bool(stream), False
    if not isinstance(opts, dict):
        raise ApiError(400, f"'stream_options' must be an object {{include_usage}}, got {shown.repr(opts)}",
                       param="stream_options")
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ApiError(400, f"'stream_options.include_usage' must be true or false, got {shown.repr(usage)}",
                       param="stream_options.include_usage")
    return bool(stream), bool(usage)
