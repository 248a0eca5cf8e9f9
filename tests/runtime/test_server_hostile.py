"""`spec-run serve` against careless and hostile clients and operators: keys no client can send, deep or huge
bodies, clients that leave while queued or streaming, stop strings that would stall a stream, and the OpenAI
request shapes clients send every day. Tiny bundles on a free localhost port."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from specedge.runtime import SamplingParams, SpecDecoder  # noqa: E402
from specedge.runtime.errors import OptionError  # noqa: E402
from specedge.runtime.server import Server  # noqa: E402

from .test_server import Running, free_port  # noqa: E402


@pytest.fixture(scope="module")
def server(bundles):
    s = Running(bundles["lookup"])
    yield s
    s.close()


def raw_http(port: int, head: bytes, body: bytes = b"", timeout: float = 30) -> bytes:
    """One request over a socket of its own; the whole response (the server closes or answers in full)."""
    conn = socket.create_connection(("127.0.0.1", port))
    try:
        conn.sendall(head + body)
        conn.settimeout(timeout)
        got = b""
        while True:
            try:
                chunk = conn.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
            h, sep, rest = got.partition(b"\r\n\r\n")
            n = re.search(rb"content-length: *(\d+)", h, re.I)
            if sep and n and len(rest) >= int(n.group(1)):
                break
        return got
    finally:
        conn.close()


def post_head(path: str, length: int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {k: float(v) for k, v in re.findall(r"^specedge_(\w+) ([\d.e+]+)$", text, re.M)}


def in_balance(m: dict[str, float]) -> bool:
    return m["requests_total"] == sum(m[k] for k in ("requests_completed_total", "requests_cancelled_total",
                                                     "requests_rejected_total", "requests_failed_total",
                                                     "queue_depth", "requests_running"))


# ---------------------------------------------------------------------------------------------------------- auth
@pytest.mark.parametrize("key, message", [
    ("", r"the API key \(--api-key or SPECEDGE_API_KEY\) is empty"),
    (" ", r"U\+0020 \(SPACE\) at position 0 of its 1 characters"),
    ("se cret", r"U\+0020 \(SPACE\) at position 2 of its 7 characters"),
    ("sekret\n", r"U\+000A \(a control character\) at position 6"),
    ("clé-secrète", r"U\+00E9 \(LATIN SMALL LETTER E WITH ACUTE\) at position 2"),
])
def test_a_key_no_client_can_send_is_refused_at_start(decoders, key, message):
    with pytest.raises(OptionError, match=message) as e:
        Server(decoders["lookup"], "tiny", api_key=key)
    assert "visible ASCII characters (! to ~" in str(e.value)
    assert key.strip() == "" or key.strip() not in str(e.value)  # the message never shows the key


@pytest.mark.parametrize("args, env", [(["--api-key", ""], {}), ([], {"SPECEDGE_API_KEY": ""}),
                                       (["--api-key", " "], {}), ([], {"SPECEDGE_API_KEY": "\tkey"})])
def test_spec_run_serve_refuses_an_empty_or_blank_key_before_loading(bundles, monkeypatch, args, env):
    from click.testing import CliRunner

    from specedge.runtime.cli import main

    def serving(*a, **kw):
        raise AssertionError("the server started with this key")

    monkeypatch.setattr(uvicorn, "run", serving)
    monkeypatch.setattr(uvicorn.Server, "run", serving)
    monkeypatch.setattr(SpecDecoder, "load", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("loaded")))
    monkeypatch.delenv("SPECEDGE_API_KEY", raising=False)
    r = CliRunner().invoke(main, ["serve", str(bundles["lookup"]), *args], env=env)
    assert r.exit_code == 2 and "error: the API key (--api-key or SPECEDGE_API_KEY)" in r.output, r.output


def test_the_bearer_scheme_is_case_insensitive_and_only_v1_is_guarded(bundles):
    s = Running(bundles["lookup"], api_key="sekret-1")
    body = json.dumps({"prompt": "def", "max_tokens": 2}).encode()
    try:
        for auth in ("Bearer sekret-1", "bearer sekret-1", "BEARER sekret-1", "bEaReR   sekret-1"):
            status, payload, _ = s.post("/v1/completions", {"prompt": "def", "max_tokens": 2},
                                        headers={"Authorization": auth})
            assert status == 200, (auth, payload)
        for auth in ("Bearer sekret-2", "Basic sekret-1", "sekret-1", "Bearer", "Bearer sekret-1x"):
            status, payload, headers = s.post("/v1/completions", {"prompt": "def", "max_tokens": 2},
                                              headers={"Authorization": auth})
            assert status == 401 and payload["error"]["code"] == "invalid_api_key", auth
            assert {k.lower(): v for k, v in headers.items()}["www-authenticate"] == "Bearer"
        # a header no key can equal (bytes past ASCII) is a 401, not a crash
        got = raw_http(s.port, post_head("/v1/completions", len(body), "Authorization: Bearer sekr\xe9t-1\r\n")
                       .replace(b"\xc3\xa9", b"\xe9"), body)
        assert got.startswith(b"HTTP/1.1 401"), got[:200]
        # docs/serving.md: the key guards the /v1 routes, not /health and /metrics
        assert urllib.request.urlopen(s.url + "/health", timeout=10).status == 200
        assert urllib.request.urlopen(s.url + "/metrics", timeout=10).status == 200
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(s.url + "/v1/models", timeout=10)
        assert e.value.code == 401
    finally:
        s.close()


@pytest.mark.parametrize("key, says", [("sekret-abc", "the /v1 routes require an API key"),
                                       (None, "with no API key: every client that reaches 127.0.0.1")])
def test_the_start_log_says_whether_a_key_is_required_and_never_shows_it(bundles, monkeypatch, capfd, key, says):
    from specedge.runtime.server import serve

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **kw: None)
    serve(str(bundles["lookup"]), port=free_port(), api_key=key)
    err = capfd.readouterr().err
    assert says in err, err
    assert key is None or key not in err


# ---------------------------------------------------------------------------------------------------------- body
def test_deeply_nested_json_is_a_400_in_openais_shape(server):
    for raw in (b"[" * 400_000, b"{\"a\": " * 100_000, b'{"prompt": "x", "stop": ' + b"[" * 50_000):
        got, payload, _ = server.post("/v1/completions", None, raw=raw)
        assert got == 400, payload
        assert payload["error"]["type"] == "invalid_request_error" and "nests arrays or objects deeper" in \
            payload["error"]["message"], payload
    # parsed, yet deep: the error shows the value cut short
    deep = json.dumps({"prompt": "x", "temperature": [[[[[[[[[["x" * 5000]]]]]]]]]]})
    got, payload, _ = server.post("/v1/completions", None, raw=deep.encode())
    assert got == 400 and payload["error"]["param"] == "temperature" and len(payload["error"]["message"]) < 200


def test_a_body_over_the_limit_is_refused_by_its_length_unread(server):
    got = raw_http(server.port, post_head("/v1/completions", server.srv.max_body + 1))  # no body sent
    assert got.startswith(b"HTTP/1.1 413"), got[:200]
    err = json.loads(got.partition(b"\r\n\r\n")[2])["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert f"over {server.srv.max_body} bytes" in err["message"]


# ------------------------------------------------------------------------------------------------------- metrics
def test_metrics_add_up_when_clients_leave_while_queued_and_while_streaming(bundles):
    s = Running(bundles["lookup"], max_queue=3)
    real = s.dec.stream

    def slow(prompt, params, **kw):  # a round every 50 ms, no eos: requests stay queued behind a long one
        for ev in real(prompt, dataclasses.replace(params, ignore_eos=True), **kw):
            time.sleep(0.05)
            yield ev

    s.dec.stream = slow
    scrapes, stop = [], threading.Event()

    def scrape():
        while not stop.is_set():
            scrapes.append(metrics(s.url))
            time.sleep(0.01)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()

    def opened(path: str, body: dict) -> socket.socket:
        raw = json.dumps(body).encode()
        conn = socket.create_connection(("127.0.0.1", s.port))
        conn.sendall(post_head(path, len(raw)) + raw)
        return conn

    def wait_for(cond, what: str) -> None:
        for _ in range(400):
            if cond(s.srv.metrics.snapshot()):
                return
            time.sleep(0.025)
        raise AssertionError(f"{what}: {s.srv.metrics.snapshot()}")

    long = {"prompt": "def fib(n):", "max_tokens": 200, "temperature": 0, "speculation": {"drafter": "none"}}
    try:
        streaming = opened("/v1/completions", {**long, "stream": True})  # runs, streams, then leaves
        streaming.settimeout(30)
        got = b""
        while got.count(b"data:") < 3:
            got += streaming.recv(4096)
        queued = [opened("/v1/completions", {**long, "stream": True}),  # leave while queued: streaming ...
                  opened("/v1/chat/completions", {**long, "stream": True, "prompt": None,
                                                  "messages": [{"role": "user", "content": "hi"}]}),
                  opened("/v1/completions", long)]  # ... and not
        wait_for(lambda m: m["queued"] == 3, "three queued")
        busy = s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert busy[0] == 503
        for c in queued:
            c.close()
        time.sleep(0.3)  # the server notices; the jobs stay queued until the worker reaches them
        streaming.close()
        wait_for(lambda m: m["queued"] == m["running"] == 0, "all done")
        done = s.post("/v1/completions", {"prompt": "The", "max_tokens": 3, "temperature": 0})
        assert done[0] == 200
        m = metrics(s.url)
    finally:
        stop.set()
        scraper.join(timeout=10)
        s.close()
    assert len(scrapes) > 20 and all(in_balance(x) for x in scrapes), next(x for x in scrapes if not in_balance(x))
    assert (m["requests_total"], m["requests_completed_total"], m["requests_cancelled_total"],
            m["requests_rejected_total"], m["requests_failed_total"]) == (6, 1, 4, 1, 0), m
    # the tokens the stream that left had generated (3 events or more) are counted beside the completed request's
    assert m["completion_tokens_total"] >= done[1]["usage"]["completion_tokens"] + 3, m
    assert m["prompt_tokens_total"] > done[1]["usage"]["prompt_tokens"], m


# ---------------------------------------------------------------------------------------------------------- stop
@pytest.mark.parametrize("stop, got", [
    ("x" * 257, "1 string(s) of 257 characters"),
    (["a", "b", "c", "d", "e"], "5 string(s) of 1, 1, 1, 1, 1 characters"),
    (["ok", ""], "2 string(s) of 2, 0 characters"),
    ([1], "[1]"),
])
def test_stop_strings_are_capped_like_openais(server, stop, got):
    status, payload, _ = server.post("/v1/completions", {"prompt": "def", "max_tokens": 2, "stop": stop})
    assert status == 400 and payload["error"]["param"] == "stop", payload
    assert ("'stop' must be a string or a list of up to 4 strings, each of 1 to 256 characters; got " + got
            == payload["error"]["message"]), payload


def test_a_long_stop_string_that_cannot_match_does_not_hold_the_stream_back(server):
    body = {"prompt": "def fib(n):", "max_tokens": 32, "temperature": 0, "stream": True, "ignore_eos": True,
            "stop": ["\x07" * 256]}  # never generated: nothing need wait for it
    raw = json.dumps(body).encode()
    got = raw_http(server.port, post_head("/v1/completions", len(raw)), raw)
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in got.decode().split("\n")
             if line.startswith("data: {")]
    full = server.dec.generate("def fib(n):", SamplingParams(max_new_tokens=32))
    assert "".join(texts) == full.text
    assert sum(1 for t in texts if t) >= 8, texts  # streamed as it was decoded, not in one piece at the end


def test_the_decoder_holds_back_only_what_could_begin_a_stop_string(decoders):
    dec = decoders["lookup"]
    full = dec.generate("def fib(n):", SamplingParams(max_new_tokens=32, ignore_eos=True))
    never = "\x07" * 10_000  # the API has no length cap
    pieces = [ev.text for ev in dec.stream("def fib(n):", SamplingParams(max_new_tokens=32, ignore_eos=True,
                                                                         stop=(never,)))]
    assert "".join(pieces) == full.text and sum(1 for p in pieces if p) >= 8, pieces
    # a stop string that does occur: text streams up to where it could begin, and ends before it
    stop = full.text[10:14]
    pieces = [ev.text for ev in dec.stream("def fib(n):", SamplingParams(max_new_tokens=32, ignore_eos=True,
                                                                         stop=(stop + "\x07" * 300,)))]
    assert "".join(pieces) == full.text  # never completed: everything comes out
    cut = [ev.text for ev in dec.stream("def fib(n):", SamplingParams(max_new_tokens=32, ignore_eos=True,
                                                                      stop=(stop,)))]
    assert "".join(cut) == full.text[: full.text.index(stop)]


@pytest.mark.parametrize("text, stops, held", [
    ("hello wor", ("world",), 3), ("hello", ("world",), 0), ("abab", ("abc",), 2), ("aaa", ("aaab",), 3),
    ("xab", ("b", "abz"), 2), ("x", ("x",), 0), ("", ("x",), 0), ("ab" * 200, ("b" + "x" * 300,), 1),
])
def test_stop_prefix_len_is_the_longest_suffix_that_begins_a_stop_string(text, stops, held):
    from specedge.runtime.request import stop_prefix_len

    assert stop_prefix_len(text, stops) == held == longest_stop_prefix(text, stops)


def longest_stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    return max(n for n in range(len(text) + 1) for s in stops if n < len(s) and s.startswith(text[len(text) - n:]))


@given(st.text("abx", max_size=12), st.lists(st.text("abx", min_size=1, max_size=6), min_size=1, max_size=4),
       st.integers(0, 12))
def test_stop_prefix_len_matches_a_brute_force_search(text, stops, start):
    from specedge.runtime.request import stop_prefix_len

    stops = tuple(stops)
    start = min(start, len(text))
    assert stop_prefix_len(text, stops, start) == longest_stop_prefix(text[start:], stops)


# ---------------------------------------------------------------------------------------------- request shapes
def test_content_as_text_parts_null_assistant_content_and_the_developer_role(server):
    c = server.client
    greedy = dict(model="tiny", temperature=0, max_tokens=12)

    def same(messages, want):  # the request means what ``want`` means: the same prompt tokens, the same text
        got = c.chat.completions.create(messages=messages, **greedy)
        assert got.usage.prompt_tokens == len(server.dec.encode_prompt(want)), messages
        assert got.choices[0].message.content == server.dec.generate(want, SamplingParams(max_new_tokens=12)).text

    parts = [{"type": "text", "text": "def fib(n):"}, {"type": "text", "text": "    return n"}]
    same([{"role": "user", "content": parts}], [{"role": "user", "content": "def fib(n):\n    return n"}])
    same([{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}],
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}])
    same([{"role": "developer", "content": [{"type": "text", "text": "Be terse."}]},
          {"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
          {"role": "user", "content": "and?"}],
         [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": ""}, {"role": "user", "content": "and?"}])


@pytest.mark.parametrize("messages, param, message", [
    ([{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     "messages[0].content[1]", "is a part of type 'image_url'; this server serves a text model and reads only text "
                               "parts"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0]", "reads only text parts"),
    ([{"role": "user", "content": None}], "messages[0].content", "only an assistant message may leave it out"),
    ([{"role": "system"}], "messages[0].content", "has no content (missing or null)"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role",
     "role 'wizard' is not allowed; roles: system, developer (as system), user, assistant, tool"),
    (["hi"], "messages[0]", "must be a {role, content} object, got 'hi'"),
])
def test_what_a_text_model_cannot_read_is_refused_saying_so(server, messages, param, message):
    status, payload, _ = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 400 and payload["error"]["param"] == param and message in payload["error"]["message"], payload


# ---------------------------------------------------------------------------------------------------------- memory
def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
def test_rss_stays_flat_over_a_thousand_served_and_refused_requests(bundles, tmp_path):
    """The server in a process of its own (its RSS alone, not the client's): 1,000 requests, 4 in 10 short ones
    (max_tokens 1-4, some turned away busy with --max-queue 1), the rest refused, most after reading a ~1 MB body
    (unparsable, nested, a 1 MB image part, a prompt over the context that must be tokenized to know) or by its
    Content-Length alone."""
    port, key = free_port(), "k-" + os.urandom(8).hex()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specedge.runtime.cli", "serve", str(bundles["lookup"]),
                                 "--port", str(port), "--max-queue", "1", "--log-level", "info"],
                                env={**os.environ, "SPECEDGE_API_KEY": key}, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.05)
        auth = f"Authorization: Bearer {key}\r\n"
        big = "hello world " * 85_000  # ~1 MB
        bodies = {
            "unparsable": b'{"prompt": "' + big.encode(),
            "nested": b"[" * 400_000,
            "image": json.dumps({"max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "QUJD" * 250_000}}]}]}).encode(),
            "context": json.dumps({"prompt": big, "max_tokens": 2}).encode(),
        }

        def served(i: int) -> int:
            path, body = (("/v1/completions", {"prompt": f"def f{i}(n):"}) if i % 2 else
                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"hi {i}"}]}))
            raw = json.dumps({**body, "max_tokens": 1 + i % 4, "temperature": 0, "stream": i % 3 == 0}).encode()
            return int(raw_http(port, post_head(path, len(raw), auth), raw)[9:12])

        def refused(kind: str) -> int:
            if kind == "length":
                return int(raw_http(port, post_head("/v1/completions", (1 << 20) + 1, auth))[9:12])
            return int(raw_http(port, post_head("/v1/completions", len(bodies[kind]), auth), bodies[kind])[9:12])

        # a round of 10: 4 short ones at once (with --max-queue 1 some are busy), then 6 refused; a prompt over the
        # context (tokenized before it is refused, ~1 s on this vocabulary) every tenth round, two at once
        def one_round(r: int, ex: ThreadPoolExecutor) -> list[int]:
            codes = list(ex.map(served, range(4 * r, 4 * r + 4)))
            kinds = ["unparsable", "nested", "image", "length"] + (["context", "context"] if r % 10 == 0 else
                                                                   ["unparsable", "image"])
            return codes + list(ex.map(refused, kinds))

        codes: list[int] = []
        with ThreadPoolExecutor(4) as ex:
            for _ in range(3):  # warm: the first requests allocate what every later one reuses
                served(0)
            baseline = rss_mb(proc.pid)
            for r in range(100):
                codes += one_round(r, ex)
                if r == 9:
                    after_100 = rss_mb(proc.pid)
        after_1000 = rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"server RSS: {baseline:.0f} MB warm, {after_100:.0f} MB after 100 requests, {after_1000:.0f} MB after "
          f"1,000")
    assert len(codes) == 1000 and set(codes) <= {200, 400, 413, 503} and codes.count(200) >= 100, sorted(set(codes))
    assert codes.count(413) == 100 and codes.count(400) == 500, {c: codes.count(c) for c in set(codes)}
    assert after_1000 <= 1.10 * after_100, (baseline, after_100, after_1000)
    assert after_100 <= baseline + 40, (baseline, after_100, after_1000)  # what a 1 MB prompt took is given back
    text = log.read_text()
    assert "the /v1 routes require an API key" in text and key not in text, text
