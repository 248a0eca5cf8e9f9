"""`spec-run serve --ray`: two replicas of the SmolLM2 bundle on a local two-node Ray cluster (loopback only), one
CPU each, behind one endpoint. The official openai client gets the single-process server's greedy text, streaming
or not; a conversation's turns land on one replica (its prefix reused); a replica killed mid-request fails that
request within seconds, and later requests are served."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specedge.runtime.serve_ray import affinity_key, parse_resources

openai = pytest.importorskip("openai")

RAY = str(Path(sys.executable).with_name("ray"))
REPLICA_PROCESS = "ServeReplica:specedge:SpecEdgeReplica"  # how Ray names a replica's worker process
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_conversation_keeps_its_key_across_turns_and_others_differ():
    turn1 = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    turn2 = {"messages": turn1["messages"] + [{"role": "assistant", "content": "Hello!"},
                                              {"role": "user", "content": "More?"}]}
    other = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bye"}]}
    import json

    k1, k2, k3 = (affinity_key(json.dumps(b).encode(), {}) for b in (turn1, turn2, other))
    assert k1 == k2 and k1 != k3 and k1
    assert affinity_key(b'{"user": "ada", "messages": []}', {}) != affinity_key(b'{"user": "bob"}', {})
    assert affinity_key(b"not json", {"x-specedge-session": "s1"}) == affinity_key(b"{}", {"x-specedge-session": "s1"})
    assert affinity_key(b"not json", {}) == "" and affinity_key(b"[1]", {}) == ""


def test_replica_resources_parse_and_bad_ones_say_what_is_allowed():
    from specedge.runtime.errors import OptionError

    assert parse_resources(["jetson=1", " gpu_mem = 8"]) == {"jetson": 1.0, "gpu_mem": 8.0}
    for bad in ("jetson", "=1", "jetson=0", "jetson=lots"):
        with pytest.raises(OptionError, match="NAME=AMOUNT"):
            parse_resources([bad])


@pytest.fixture(scope="module")
def smol_bundle(tmp_path_factory):
    from specedge.export.bundle import ExportOptions, export_bundle
    from specedge.export.fetch import fetch

    out = tmp_path_factory.mktemp("smol-ray") / "bundle"
    export_bundle(fetch("smollm2-135m"), "prompt-lookup", out, ExportOptions(k=4, max_context=512, prefill_chunk=32))
    return out


def test_replica_options_without_a_cluster_are_refused_with_what_to_add():
    from click.testing import CliRunner

    from specedge.runtime.cli import main

    r = CliRunner().invoke(main, ["serve", "engines/none", "--replicas", "2"])
    assert r.exit_code == 2 and "--ray ADDRESS" in r.output, r.output


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray.serve", reason="the [ray] extra (ray[serve]) is not installed")
    from specedge.runtime.serve_ray import start_local_cluster, stop_local_cluster

    address, nodes = start_local_cluster(2, 1, ray=RAY)
    try:
        yield address
    finally:
        stop_local_cluster(nodes)


@pytest.fixture(scope="module")
def endpoint(cluster, smol_bundle):
    import ray
    from ray import serve

    from specedge.runtime.serve_ray import RayOptions, serve_on_ray

    port = _free_port()
    serve_on_ray(str(smol_bundle), RayOptions(address=cluster, replicas=2, replica_cpus=1), port=port,
                 serve_kw={"threads": 1, "max_batch": 1}, blocking=False)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        serve.shutdown()
        ray.shutdown()


def _alone(bundle, messages, n: int) -> str:
    """What the single-process server answers (spec-run serve's app, in this process)."""
    from starlette.testclient import TestClient

    from specedge.runtime import SpecDecoder
    from specedge.runtime.server import Server

    dec = SpecDecoder.load(bundle, threads=1)
    srv = Server(dec, bundle.name)
    try:
        r = TestClient(srv.app).post("/v1/chat/completions", json={"messages": messages, "max_tokens": n,
                                                                    "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    finally:
        srv.stop()
        dec.close()


def test_replicas_answer_what_the_single_server_answers_streaming_or_not(endpoint, smol_bundle):
    want = _alone(smol_bundle, PROMPT, 24)
    got = endpoint.chat.completions.create(model=smol_bundle.name, messages=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == want
    stream = endpoint.chat.completions.create(model=smol_bundle.name, messages=PROMPT, max_tokens=24, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    with pytest.raises(openai.NotFoundError):  # the replica's own errors come through as they are
        endpoint.chat.completions.create(model="no-such-model", messages=PROMPT, max_tokens=4)


def test_a_conversations_turns_land_on_the_replica_that_holds_its_prefix(endpoint, smol_bundle):
    for conv in range(4):
        messages = [{"role": "user", "content": f"Conversation {conv}: what is {conv} plus {conv * 3}?"}]
        first = endpoint.chat.completions.create(model=smol_bundle.name, messages=messages, max_tokens=12,
                                                 temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And times two?"}]
        second = endpoint.chat.completions.create(model=smol_bundle.name, messages=messages, max_tokens=12,
                                                  temperature=0)
        reused = second.usage.model_extra["specedge"]["reused_tokens"]
        assert reused >= first.usage.prompt_tokens, (conv, reused, first.usage.prompt_tokens)


def test_a_replica_killed_mid_request_fails_it_within_seconds_and_later_requests_are_served(endpoint, smol_bundle):
    pids = [int(p) for p in subprocess.run(["pgrep", "-f", REPLICA_PROCESS], capture_output=True,
                                           text=True).stdout.split()]
    assert len(pids) == 2, pids
    outcome: dict = {}

    def long_request() -> None:
        try:
            stream = endpoint.chat.completions.create(
                model=smol_bundle.name, messages=[{"role": "user", "content": "Count from 1 to 300, one number "
                                                                               "per line."}],
                max_tokens=400, temperature=0, stream=True)
            for _ in stream:
                outcome.setdefault("first", time.monotonic())
            outcome["end"] = "finished"
        except Exception as e:  # noqa: BLE001 - the error the client sees is the point
            outcome["end"] = e
        outcome["at"] = time.monotonic()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while "first" not in outcome and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "first" in outcome, outcome
    killed = time.monotonic()
    for p in pids:  # both: whichever holds the request
        os.kill(p, signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()
    assert isinstance(outcome["end"], openai.APIError), outcome
    assert "replica" in str(outcome["end"]) and outcome["at"] - killed < 10, outcome
    deadline = time.monotonic() + 90
    while True:
        try:
            r = endpoint.chat.completions.create(model=smol_bundle.name, messages=PROMPT, max_tokens=6,
                                                 temperature=0)
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "no replica came back"
            time.sleep(1)
    assert r.choices[0].message.content
