"""`spec-run serve --ray ADDRESS`: replicas of one bundle on a Ray cluster behind one OpenAI-compatible endpoint.

Two Ray Serve deployments (the ``[ray]`` extra; nothing else in specedge imports ray):

* ``SpecEdgeReplica``: one :class:`SpecDecoder` and the single-process server's :class:`~.server.Server` around it,
  so every route, error, SSE stream, API key check, queue limit and ``/metrics`` is that server's code. A request
  reaches it as (method, path, headers, body) and runs through the server's own ASGI app in the replica; what the
  app sends comes back as a stream of (status, headers) then body chunks.
* ``SpecEdgeRouter``: the HTTP ingress. It reads a request's body, takes its conversation's key
  (:func:`affinity_key`) and forwards it with that key as Ray Serve's multiplexed model id: Ray routes an id to a
  replica that has served it (whose decoder holds the conversation's prefix), and a new id to a lightly loaded one.
  A replica remembers its last :data:`SESSIONS_PER_REPLICA` keys.

A replica that dies fails its in-flight requests with a 503 in OpenAI's error shape (mid-stream: an SSE error event),
and Ray starts another. ``/metrics`` and ``/health`` answer from one replica; Ray's own metrics cover the cluster.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

ROUTER_MIN_ONGOING = 256  # requests the router holds at once, at the least
COALESCE_S = 0.025  # a replica's stream sends what its app wrote within this long as one message
SESSIONS_PER_REPLICA = 64  # conversation keys a replica keeps as "held here" (Ray's multiplexed-model LRU)
MAX_ROUTED_BODY = 64 << 20  # the router reads at most this much of a body; a replica refuses what cannot fit
AFFINITY_HEADER = "x-specedge-session"  # a client's own conversation key, when it has one
REPLICA_DIED = ("the replica serving this request stopped ({what}); Ray Serve starts another: retry the request")


@dataclass(frozen=True)
class RayOptions:
    """How the replicas are placed and scaled (``spec-run serve --ray``)."""

    address: str = "auto"  # a running cluster's address ("auto": the one this machine is part of)
    replicas: int = 1
    max_replicas: int | None = None  # above ``replicas``: Ray Serve's autoscaling between the two
    replica_cpus: float = 1.0  # CPUs Ray reserves for each replica (its decoder's threads by default)
    replica_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom node resources a replica needs ("jetson": 1)
    max_ongoing: int = 32  # requests Ray sends one replica at once (its server queues and refuses past its own limit)


def start_local_cluster(nodes: int, cpus: int, ray: str = "ray") -> tuple[str, list[Any]]:
    """A Ray cluster of ``nodes`` nodes of ``cpus`` CPUs on loopback (``ray start --head`` and ``ray start
    --address``, as on real machines, each in the foreground of a process group of its own): its address and the
    processes :func:`stop_local_cluster` stops. For tests and benchmarks on one machine; other Ray clusters on it are
    left alone."""
    import os
    import socket
    import subprocess
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    common = ["--block", "--node-ip-address", "127.0.0.1", "--num-cpus", str(cpus), "--disable-usage-stats"]
    procs = [subprocess.Popen([ray, "start", "--head", "--port", str(port), "--include-dashboard", "false", *common],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)]
    deadline = time.monotonic() + 120
    while True:  # the head's GCS answers: the other nodes can join
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if procs[0].poll() is not None or time.monotonic() > deadline:
                stop_local_cluster(procs)
                raise RuntimeError(f"the local Ray head did not start on port {port}") from None
            time.sleep(0.2)
    for _ in range(nodes - 1):
        procs.append(subprocess.Popen([ray, "start", "--address", f"127.0.0.1:{port}", *common], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
    return f"127.0.0.1:{port}", procs


def stop_local_cluster(procs: list[Any]) -> None:
    """Stop the nodes :func:`start_local_cluster` started, the last first: each node's process group."""
    import os
    import signal
    import subprocess

    for p in reversed(procs):
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(p.pid, sig)
                p.wait(wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue


def parse_resources(items: tuple[str, ...] | list[str]) -> dict[str, float]:
    """("jetson=1", "gpu_mem=8") -> {"jetson": 1.0, "gpu_mem": 8.0}: a replica's custom Ray resources."""
    from .errors import OptionError

    out: dict[str, float] = {}
    for item in items:
        name, eq, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not eq or not name.strip() or not value > 0:
            raise OptionError(f"--replica-resource {item!r}: give NAME=AMOUNT with a positive amount, e.g. jetson=1")
        out[name.strip()] = value
    return out


def affinity_key(body: bytes, headers: dict[str, str]) -> str:
    """The key that sends a conversation's turns to one replica: the client's ``X-SpecEdge-Session`` header, else
    the request's ``user`` field, else a hash of the conversation's opening (its messages up to and including the
    first user message, which every later turn repeats; a completion's first 512 characters). '' for a body that is
    not a JSON object (the replica answers its error)."""
    def digest(kind: str, text: str) -> str:
        return kind + ":" + hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:32]

    own = headers.get(AFFINITY_HEADER, "").strip()
    if own:
        return digest("h", own)
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return ""
    if not isinstance(req, dict):
        return ""
    if isinstance(req.get("user"), str) and req["user"]:
        return digest("u", req["user"])
    opening: Any = None
    messages = req.get("messages")
    if isinstance(messages, list):
        opening = []
        for m in messages:
            opening.append(m)
            if isinstance(m, dict) and m.get("role") == "user":
                break
    elif isinstance(req.get("prompt"), str):
        opening = req["prompt"][:512]
    if opening is None:
        return ""
    return digest("c", json.dumps(opening, sort_keys=True, ensure_ascii=False, default=str))


async def run_asgi(app: Any, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes):
    """Run one HTTP request through an ASGI ``app`` in this process: yields ("start", status, headers), then
    ("body", bytes) for each chunk. Closing the generator early (the client left) tells the app the client
    disconnected."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await sent.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode("latin-1"), "root_path": "",
             "query_string": query.encode("latin-1"), "server": ("specedge-replica", 0), "client": ("ray", 0),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]}
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():  # the app returned (or raised) with nothing more to send
                getter.cancel()
                task.result()
                return
            message = getter.result()
            if message["type"] == "http.response.start":
                yield ("start", int(message["status"]),
                       [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                # what the app sends within COALESCE_S goes along: each item costs Ray a message between
                # processes, and a fast model's tokens (a few ms apart) would cost more in messages than in steps
                data, more = bytearray(message.get("body", b"")), message.get("more_body", False)
                until = loop.time() + COALESCE_S
                while more:
                    left = until - loop.time()
                    if left <= 0 and sent.empty():
                        break
                    try:
                        nxt = sent.get_nowait() if left <= 0 else await asyncio.wait_for(sent.get(), left)
                    except asyncio.TimeoutError:
                        break
                    data += nxt.get("body", b"")
                    more = nxt.get("more_body", False)
                if data:
                    yield ("body", bytes(data))
                if not more:
                    return
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the request is over either way
                task.cancel()


def _replica_died(e: BaseException) -> Any:
    """The error a request gets when its replica died or cannot be reached (OpenAI's shape, as the server's)."""
    from .openai_api import ApiError

    return ApiError(503, REPLICA_DIED.format(what=type(e).__name__), "server_error", code="replica_unavailable",
                    headers={"Retry-After": "1"})


def _response(e: Any) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def build_app(bundle: str, serve_kw: dict[str, Any], options: RayOptions) -> Any:
    """The Ray Serve application: a router in front of ``options.replicas`` replicas of ``bundle``. serve_kw: what
    each replica's decoder and server take (backend, threads, max_batch, max_queue, api_key, drafter, verify)."""
    from ray import serve

    @serve.deployment(name="SpecEdgeReplica", max_ongoing_requests=options.max_ongoing,
                      ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus,
                                         "resources": dict(options.resources)},
                      **_scaling(options))
    class SpecEdgeReplica:
        def __init__(self) -> None:
            from pathlib import Path

            # absolute: the class is pickled by value into Ray's workers
            from specedge.runtime.decoder import SpecDecoder
            from specedge.runtime.server import Server, default_max_batch

            kw = dict(serve_kw)
            max_batch = kw.pop("max_batch", None) or default_max_batch(bundle, kw.get("backend", "auto"))
            threads = kw.get("threads") or max(1, int(options.replica_cpus))  # the CPUs Ray gave it, not the node's
            self.dec = SpecDecoder.load(bundle, backend=kw.get("backend", "auto"), threads=threads,
                                        verify="size", max_batch=max_batch)
            self.server = Server(self.dec, kw.get("model_name") or Path(bundle).resolve().name,
                                 max_queue=kw.get("max_queue", 16), api_key=kw.get("api_key"),
                                 drafter=kw.get("drafter", "auto"))

        @serve.multiplexed(max_num_models_per_replica=SESSIONS_PER_REPLICA)
        async def _session(self, key: str) -> str:
            return key  # nothing to load: the decoder's cache is the conversation's prefix

        async def forward(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes):
            key = serve.get_multiplexed_model_id()
            if key:
                await self._session(key)  # tells Ray this replica holds the conversation
            async for item in run_asgi(self.server.app, method, path, query, headers, body):
                yield item

    # it only waits on replicas: as many requests at once as every replica may hold (Ray's default is 5)
    @serve.deployment(name="SpecEdgeRouter", ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=max(ROUTER_MIN_ONGOING,
                                               options.max_ongoing * (options.max_replicas or options.replicas)))
    @serve.ingress()
    class SpecEdgeRouter:
        def __init__(self, replica: Any) -> None:
            self.replica = replica

        def __serve_build_asgi_app__(self) -> Any:
            from starlette.applications import Starlette
            from starlette.routing import Route

            return Starlette(routes=[Route("/{path:path}", self.route,
                                           methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])])

        async def route(self, request: Any) -> Any:
            from starlette.responses import Response, StreamingResponse

            from specedge.runtime.openai_api import ApiError

            body = bytearray()
            async for part in request.stream():
                body += part
                if len(body) > MAX_ROUTED_BODY:
                    return _response(ApiError(413, f"the request body is over {MAX_ROUTED_BODY} bytes",
                                              code="request_too_large"))
            headers = list(request.headers.items())
            key = affinity_key(bytes(body), dict(request.headers)) if request.method == "POST" else ""
            handle = self.replica.options(stream=True, multiplexed_model_id=key)
            gen = handle.forward.remote(request.method, request.url.path, request.url.query, headers, bytes(body))
            try:
                first = await gen.__anext__()
            except StopAsyncIteration:
                return _response(ApiError(502, "the replica sent no response", "server_error", code="bad_gateway"))
            except Exception as e:  # noqa: BLE001 - a dead or unreachable replica: the client's error, clearly
                return _response(_replica_died(e))
            _, status, out_headers = first
            streaming = any(k.lower() == "content-type" and v.startswith("text/event-stream")
                            for k, v in out_headers)
            kept = {k: v for k, v in out_headers if k.lower() not in ("content-length", "transfer-encoding")}

            async def chunks():
                try:
                    async for item in gen:
                        yield item[1]
                except Exception as e:  # noqa: BLE001 - mid-response: say so in the stream, then end it
                    if streaming:
                        yield ("data: " + json.dumps(_replica_died(e).body()) + "\n\n").encode()
                finally:
                    gen.cancel()

            if streaming:
                return StreamingResponse(chunks(), status_code=status, headers=kept)
            data = bytearray()
            try:
                async for item in gen:
                    data += item[1]
            except Exception as e:  # noqa: BLE001
                return _response(_replica_died(e))
            return Response(bytes(data), status_code=status, headers=kept)

    return SpecEdgeRouter.bind(SpecEdgeReplica.bind())


def _scaling(options: RayOptions) -> dict[str, Any]:
    if options.max_replicas is not None and options.max_replicas > options.replicas:
        return {"autoscaling_config": {"min_replicas": options.replicas, "max_replicas": options.max_replicas,
                                       "target_ongoing_requests": 2}}
    return {"num_replicas": options.replicas}


def serve_on_ray(bundle: str, options: RayOptions, host: str = "127.0.0.1", port: int = 8000,
                 serve_kw: dict[str, Any] | None = None, blocking: bool = True) -> None:
    """Connect to the Ray cluster at ``options.address``, deploy the router and the replicas, and serve at
    host:port (Ray Serve's HTTP proxy) until interrupted (``blocking``)."""
    from .errors import SpecEdgeError

    try:
        import ray
        from ray import serve
    except ImportError:
        raise SpecEdgeError("spec-run serve --ray needs the [ray] extra: pip install 'specedge[ray]'") from None
    ray.init(address=options.address, ignore_reinit_error=True, log_to_driver=False)
    # one endpoint: the head node's proxy only (a proxy per node would cost every node a process)
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    serve.run(build_app(bundle, dict(serve_kw or {}), options), name="specedge", route_prefix="/",
              blocking=blocking)
