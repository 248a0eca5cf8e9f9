"""`spec-run serve` through the official openai client and raw HTTP, on a server started here on a free localhost
port (tiny bundles; bounded request counts and timeouts; loopback only)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from specedge.runtime import OptionError, SamplingParams, SpecDecoder  # noqa: E402
from specedge.runtime.server import Server  # noqa: E402

GREEDY = dict(temperature=0, max_tokens=24)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    def __init__(self, bundle, max_batch=1, **kw):
        self.dec = SpecDecoder.load(bundle, max_batch=max_batch)
        self.srv = Server(self.dec, "tiny", **kw)
        self.port = free_port()
        self.uv = uvicorn.Server(uvicorn.Config(self.srv.app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.uv.started:
                break
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=kw.get("api_key") or "none", timeout=60,
                                    max_retries=0)

    def close(self):
        self.uv.should_exit = True
        self.thread.join(timeout=10)
        self.srv.stop()

    def post(self, path, body, raw=None, headers=None):
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)


@pytest.fixture(scope="module")
def server(bundles):
    s = Running(bundles["lookup"])
    yield s
    s.close()


def test_chat_and_completion_streamed_equal_non_streamed_equal_the_api(server):
    c = server.client
    msgs = [{"role": "user", "content": "def fib(n):"}]
    full = c.chat.completions.create(model="tiny", messages=msgs, **GREEDY)
    text = full.choices[0].message.content
    api = server.dec.generate(msgs, SamplingParams(max_new_tokens=24))
    assert text == api.text and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == len(server.dec.encode_prompt(msgs))
    assert full.usage.completion_tokens == len(api.token_ids)
    parts, usage = [], None
    for ch in c.chat.completions.create(model="tiny", messages=msgs, stream=True,
                                        stream_options={"include_usage": True}, **GREEDY):
        if ch.choices and ch.choices[0].delta.content:
            parts.append(ch.choices[0].delta.content)
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == text and usage.completion_tokens == full.usage.completion_tokens
    comp = c.completions.create(model="tiny", prompt="The quick brown fox", **GREEDY)
    assert comp.choices[0].text == server.dec.generate("The quick brown fox", SamplingParams(max_new_tokens=24)).text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="The quick brown fox", stream=True, **GREEDY) if ch.choices)
    assert streamed == comp.choices[0].text
    stop = text[4:7]
    cut = c.chat.completions.create(model="tiny", messages=msgs, stop=[stop], **GREEDY)
    assert cut.choices[0].message.content == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    assert [m.id for m in c.models.list().data] == ["tiny"]


def test_a_second_turn_prefills_only_its_new_tokens(server):
    c = server.client
    turn1 = [{"role": "user", "content": "import numpy as np"}]
    r1 = c.chat.completions.create(model="tiny", messages=turn1, **GREEDY)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
    r2 = c.chat.completions.create(model="tiny", messages=turn2, **GREEDY)
    reused = r2.usage.model_extra["specedge"]["reused_tokens"]
    assert reused >= r1.usage.prompt_tokens - 1
    fresh = server.dec.generate(turn2, SamplingParams(max_new_tokens=24), reuse_prefix=False)
    assert r2.choices[0].message.content == fresh.text


@pytest.mark.parametrize("path, body, status, code, message", [
    ("/v1/chat/completions", None, 400, None, "not valid JSON"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404,
     "model_not_found", "does not exist"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 7}, 400, None,
     r"'temperature' must be a number in \[0.0, 2.0\]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 400}], "max_tokens": 8}, 400,
     "context_length_exceeded", "S_max=256"),
    ("/v1/chat/completions", {"messages": [{"role": "root", "content": "x"}]}, 400, None, "role 'root'"),
    ("/v1/completions", {"prompt": ""}, 400, None, "'prompt' must be a non-empty string"),
])
def test_errors_have_openais_shape(server, path, body, status, code, message):
    import re

    got, payload, _ = server.post(path, body, raw=b"{not json" if body is None else None)
    assert got == status
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    assert re.search(message, err["message"]), err


def test_concurrent_clients_each_get_their_own_output(server):
    prompts = [f"{w} number {i}" for i, w in enumerate(["def", "The", "import", "héllo"] * 4)]  # 16 clients
    want = {p: server.dec.generate(p, SamplingParams(max_new_tokens=12)).text for p in prompts}

    def ask(p):
        return p, server.client.completions.create(model="tiny", prompt=p, temperature=0, max_tokens=12).choices[0].text

    with ThreadPoolExecutor(16) as ex:
        got = dict(ex.map(ask, prompts))
    assert got == want


def test_a_disconnect_frees_the_server_and_overload_is_503(bundles):
    s = Running(bundles["lookup"], max_queue=1)
    try:
        body = json.dumps({"prompt": "def fib(n):", "max_tokens": 200, "stream": True,
                           "temperature": 0}).encode()
        # a streaming client that reads one event, then disconnects
        conn = socket.create_connection(("127.0.0.1", s.port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        conn.settimeout(30)
        got = b""
        while b"data:" not in got:  # headers and the first event may arrive in separate reads
            chunk = conn.recv(4096)
            assert chunk, got
            got += chunk
        conn.close()
        t0 = time.time()
        r = s.client.completions.create(model="tiny", prompt="The", temperature=0, max_tokens=4)
        assert r.choices[0].finish_reason in ("length", "stop") and time.time() - t0 < 30
        # overload: one running + one queued; the rest are turned away with 503 + Retry-After, none lost or mixed
        long = {"prompt": "def fib(n):", "max_tokens": 200, "temperature": 0}
        with ThreadPoolExecutor(6) as ex:
            results = list(ex.map(lambda i: s.post("/v1/completions", long), range(6)))
        codes = sorted(r[0] for r in results)
        assert codes.count(200) >= 1 and 503 in codes and set(codes) <= {200, 503}
        busy = next(r for r in results if r[0] == 503)
        assert (busy[1]["error"]["code"] == "overloaded"
                and {k.lower(): v for k, v in busy[2].items()}["retry-after"] == "1")
        texts = {r[1]["choices"][0]["text"] for r in results if r[0] == 200}
        assert len(texts) == 1  # every served request got the same (correct) text
        metrics = urllib.request.urlopen(s.url + "/metrics", timeout=10).read().decode()
        assert ("specedge_requests_rejected_total" in metrics
                and "specedge_time_to_first_token_seconds_bucket" in metrics)
    finally:
        s.close()


def test_api_key_is_enforced(bundles):
    s = Running(bundles["lookup"], api_key="sekret")
    try:
        status, payload, _ = s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 401 and payload["error"]["code"] == "invalid_api_key"
        assert s.client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].text is not None
    finally:
        s.close()


@pytest.mark.parametrize("body, status, param, message", [
    ({"prompt": "x", "stream": True, "stream_options": "x"}, 400, "stream_options", "must be an object"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", "must be true or false"),
    ({"prompt": "x", "stream": "false"}, 400, "stream", "'stream' must be true or false"),
    ({"prompt": "x", "stream": True, "speculation": {"drafter": "model"}}, 400, "speculation.drafter",
     "this bundle has no draft model"),
    ({"prompt": "x", "speculation": {"drafter": "model"}}, 400, "speculation.drafter",
     "this bundle has no draft model"),
    ({"prompt": "x", "max_completion_tokens": 0}, 400, "max_completion_tokens", "'max_completion_tokens' must be"),
    ({"prompt": "x", "n": 3}, 400, "n", "'n' 3 is not supported"),
    ({"prompt": "x", "logprobs": True}, 400, "logprobs", "is not supported"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format", "is not supported"),
])
def test_invalid_requests_are_refused_before_anything_is_queued(server, body, status, param, message):
    queued = server.srv.metrics.snapshot()["requests"]
    got, payload, _ = server.post("/v1/completions", body)
    assert got == status and payload["error"]["param"] == param and message in payload["error"]["message"], payload
    assert server.srv.metrics.snapshot()["requests"] == queued  # no worker decodes for a client that was told 400


def test_lone_surrogates_oversized_bodies_and_null_fields(server):
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'  # valid JSON, not encodable text
    got, payload, _ = server.post("/v1/chat/completions", None, raw=raw)
    assert got == 400 and "not valid UTF-8 text" in payload["error"]["message"], payload
    # an explicit null is "not given": max_tokens applies
    got, payload, _ = server.post("/v1/completions", {"prompt": "def", "max_completion_tokens": None, "max_tokens": 3,
                                                      "temperature": 0})
    assert got == 200 and payload["usage"]["completion_tokens"] <= 3, payload


def test_a_non_streaming_client_that_disconnects_is_cancelled(bundles):
    s = Running(bundles["lookup"])
    real = s.dec.stream

    def slow(*a, **kw):  # a round every 50 ms: the request outlives its client by seconds unless cancelled
        for ev in real(*a, **kw):
            time.sleep(0.05)
            yield ev

    s.dec.stream = slow
    try:
        body = json.dumps({"prompt": "def fib(n):", "max_tokens": 200, "temperature": 0,
                           "speculation": {"drafter": "none"}}).encode()
        conn = socket.create_connection(("127.0.0.1", s.port))
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.5)  # decoding
        conn.close()
        for _ in range(100):
            if s.srv.metrics.snapshot()["cancelled"]:
                break
            time.sleep(0.05)
        assert s.srv.metrics.snapshot()["cancelled"] == 1
    finally:
        s.close()


def test_a_body_over_the_limit_is_413_by_its_length_or_as_it_arrives(bundles):
    """Refused unread (a server that reads a 24 MB prompt to refuse it spent 2 GB and 20 s of its event loop).
    Raw sockets with small bodies: a client still sending what the server will not read may see a reset."""
    s = Running(bundles["lookup"], max_body=2048)
    try:
        assert Server(s.dec, "tiny").max_body == 1 << 20  # the default's floor: S_max 256 x 64 bytes is less
        body = json.dumps({"prompt": "hello world " * 200}).encode()  # ~2.4 kB
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[:1500], body[1500:])) + b"0\r\n\r\n"
        for head, payload in ((f"Content-Length: {len(body)}\r\n", b""),  # refused by its header, before the body
                              ("Transfer-Encoding: chunked\r\n", chunked)):  # no length: refused as it arrives
            conn = socket.create_connection(("127.0.0.1", s.port))
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + head.encode() + b"\r\n" + payload)
            conn.settimeout(30)
            got = b""
            while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                got += chunk
            conn.close()
            assert got.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in got, got[:300]
        ok = s.post("/v1/completions", {"prompt": "def", "max_tokens": 2})  # the server goes on serving
        assert ok[0] == 200
    finally:
        s.close()


def test_serve_takes_every_presets_run_table_and_its_drafter(monkeypatch):
    """`spec-run serve --config PRESET` reads the [run] table generate and chat read, drafter included: the drafter of
    requests that name none."""
    from click.testing import CliRunner

    import specedge.runtime.server as server_module
    from specedge.runtime.cli import main
    from specedge.runtime.config import list_presets, load_config

    seen = []
    monkeypatch.setattr(server_module, "serve", lambda bundle, **kw: seen.append(kw))
    for preset in list_presets():
        r = CliRunner().invoke(main, ["serve", "B", "--config", preset])
        assert r.exit_code == 0, (preset, r.output)
        assert seen.pop()["drafter"] == load_config(preset)["run"].get("drafter", "auto")
    r = CliRunner().invoke(main, ["serve", "B", "--config", "cpu", "--drafter", "none"])
    assert r.exit_code == 0 and seen.pop()["drafter"] == "none"


def test_a_servers_drafter_is_the_default_of_requests_that_name_none(bundles):
    s = Running(bundles["lookup"], drafter="none")
    try:
        body = {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 6}
        status, reply, _ = s.post("/v1/completions", body)
        # every round plain; a plain round's free one-token guess (where width 2 costs no more than 1) may commit
        # two tokens, so the 5 tokens after the first take 5 rounds or fewer
        rounds = reply["usage"]["specedge"]["strategies"] if status == 200 else {}
        assert set(rounds) == {"none"} and 3 <= rounds["none"] <= 5, reply
        status, reply, _ = s.post("/v1/completions", {**body, "speculation": {"drafter": "prompt-lookup"}})
        assert status == 200 and "none" not in reply["usage"]["specedge"]["strategies"], reply
    finally:
        s.close()
    with pytest.raises(OptionError, match="no draft model"):
        Server(SpecDecoder.load(bundles["lookup"]), "tiny", drafter="model")
