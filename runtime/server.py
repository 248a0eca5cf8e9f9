"""`spec-run serve`: an OpenAI-compatible HTTP server over one SpecDecoder.

Starlette + uvicorn (the ``[serve]`` extra): pure Python, ~2 MB installed, no pydantic/compiled deps beyond what
uvicorn needs — on a Jetson the model, not the server, should own the memory. One decoding worker thread per
request the decoder decodes together (``max_batch``: its streams join one batch, :mod:`.batch`) takes requests in
arrival order from a bounded queue; a full queue answers 503 with Retry-After. Events cross
from the worker to the request's coroutine through ``loop.call_soon_threadsafe``; a client that disconnects sets
its job's cancel flag and the worker closes the stream at the next round. The decoder reuses the cached prefix of
the previous request, so a chat turn pays only for its new tokens (``usage.specedge.reused_tokens``).

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming SSE or not), GET /v1/models, /health,
/metrics (Prometheus text). Errors have OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .decoder import SpecDecoder
from .errors import ContextLengthError, OptionError, PromptError, SamplingParamsError, SpecEdgeError
from .factory import DRAFTER_ALIASES
from .metrics import Metrics
from .openai_api import DRAFTERS, ApiError, check_api_key, parse_request, parse_streaming, shown
from .request import check_fits
from .sampling import SamplingParams

# A body this large has its freed heap handed back to the OS once it is answered: glibc keeps freed pages for reuse,
# and a 1 MB prompt's parse and tokens take a few hundred MB for a moment (docs/serving.md, Memory).
TRIM_BODY_BYTES = 256 << 10



@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc; musl has none
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> None:
    """Return the heap pages malloc holds free to the OS (glibc's ``malloc_trim(0)``: the free pages of every arena,
    and the main arena's free top); elsewhere a no-op."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@dataclass
class Job:
    prompt: Any  # str or chat messages
    chat: bool
    params: SamplingParams
    drafter: str
    k: int | None
    n_prompt: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)

    def post(self, kind: str, item: Any) -> None:
        """From the worker thread to the request's coroutine: ("event", StreamEvent), ("done", None) or
        ("error", exception)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, item))


class Server:
    """The decoder, its worker threads (one per request it decodes together), the bounded queue and the metrics;
    ``app`` is the ASGI application."""

    def __init__(self, dec: SpecDecoder, model_name: str, max_queue: int = 16, api_key: str | None = None,
                 max_body: int | None = None, drafter: str = "auto"):
        self.dec, self.model, self.api_key = dec, model_name, check_api_key(api_key)
        if drafter not in DRAFTERS:
            raise OptionError(f"drafter {drafter!r}: choose one of {', '.join(DRAFTERS)}")
        if DRAFTER_ALIASES.get(drafter, drafter) == "model" and dec.draft_runner is None:
            raise OptionError(f"drafter {drafter!r}: this bundle has no draft model; use auto, prompt-lookup or none")
        self.drafter = drafter  # for requests that name none (speculation.drafter)
        # The largest request body read: a prompt that fills the context is a few bytes a token (~4 of English,
        # up to ~12 JSON-escaped), so 64 a token with a 1 MiB floor turns away only what cannot fit, before it is
        # parsed and tokenized (a 24 MB prompt took 2 GB and 20 s of the event loop to be refused).
        self.max_body = max_body or max(1 << 20, 64 * dec.manifest.max_context)
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.metrics = Metrics()
        self.metrics.batch = dec.batch  # rounds per batch size, on /metrics
        self._workers = [threading.Thread(target=self._work, name=f"specedge-decoder-{i}", daemon=True)
                         for i in range(len(dec.slots))]
        for w in self._workers:
            w.start()
        self.app = self._make_app()

    # ------------------------------------------------------------------ worker
    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.metrics.move("queued", "running")
            outcome, error = self._decode(job)
            self.metrics.move("running", outcome)  # counted before the client can see the end
            if error is not None:
                job.post("error", error)
            else:
                job.post("done", None)

    def _decode(self, job: Job) -> tuple[str, Exception | None]:
        """Run one job, posting its events: (outcome, the error if it failed). A client that left stops it at
        the next round boundary; the tokens it had cost are counted all the same."""
        if job.cancelled.is_set():  # the client left while it was queued
            return "cancelled", None
        n_new, stats = 0, None
        try:
            stream = self.dec.stream(job.prompt, job.params, drafter=job.drafter, k=job.k)
            for ev in stream:
                n_new += len(ev.token_ids)
                if ev.finished:
                    stats = ev.stats
                elif job.cancelled.is_set():
                    stream.close()
                    break
                job.post("event", ev)
        except Exception as e:  # noqa: BLE001 - reported to the client, never kills the worker
            self.metrics.observe_partial(job.n_prompt if n_new else 0, n_new)
            return "failed", e
        if stats is None:
            self.metrics.observe_partial(job.n_prompt, n_new)
            return "cancelled", None
        self.metrics.observe(stats)
        return "completed", None

    def stop(self) -> None:
        for _ in self._workers:
            self.jobs.put(None)

    # -------------------------------------------------------------------- http
    def _make_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
        ])

    def _error(self, e: ApiError) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def _auth(self, request: Any) -> None:
        """``Authorization: Bearer KEY`` where a key is set; the scheme's case does not matter (RFC 7235)."""
        if self.api_key is None:
            return
        scheme, _, credentials = request.headers.get("authorization", "").strip().partition(" ")
        given = credentials.strip().encode("latin-1")  # the header's bytes, as Starlette decoded them
        if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.api_key.encode("ascii")):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        changed = self.dec.files.changed()  # a few stat calls: what every request checks first
        if changed:  # every request would be refused: tell the orchestrator to restart the server
            return JSONResponse({"status": "bundle changed on disk", "changed": changed, "model": self.model,
                                 "queue": self.jobs.qsize()}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model, "queue": self.jobs.qsize()})

    async def _metrics(self, request: Any) -> Any:
        from starlette.responses import PlainTextResponse

        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            self._auth(request)
        except ApiError as e:
            return self._error(e)
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                         "owned_by": "specedge"}]})

    async def _chat(self, request: Any) -> Any:
        return await self._handle(request, chat=True)

    async def _completions(self, request: Any) -> Any:
        return await self._handle(request, chat=False)

    async def _handle(self, request: Any, chat: bool) -> Any:
        request.state.body_bytes = 0
        try:
            job, stream, include_usage = await self._admit(request, chat)
        except ApiError as e:
            refused = self._error(e)
        else:
            refused = None
        # the body, its parse and its tokens are garbage by now (the error's traceback held them until here)
        if request.state.body_bytes >= TRIM_BODY_BYTES:
            release_free_heap()
        if refused is not None:
            return refused
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if stream:
            return self._sse(job, rid, chat, include_usage)
        return await self._collect(request, job, rid, chat)

    async def _admit(self, request: Any, chat: bool) -> tuple[Job, bool, bool]:
        """Check a request and queue its job, or raise ApiError: every error the client's, found before anything
        is queued."""
        self._auth(request)
        raw = await self._read_body(request)
        request.state.body_bytes = len(raw)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, f"the request body nests arrays or objects deeper than this server parses (about "
                                f"{sys.getrecursionlimit()} levels); a request is an object a few levels deep"
                           ) from None
        del raw
        if isinstance(body, dict) and body.get("model") not in (None, self.model):
            raise ApiError(404, f"model {shown.repr(body.get('model'))} does not exist; this server serves "
                                f"{self.model!r}", param="model", code="model_not_found")
        m = self.dec.manifest
        prompt, params, drafter, k = parse_request(body, chat, m.max_context, m.k, self.drafter)
        stream, include_usage = parse_streaming(body)
        del body
        if DRAFTER_ALIASES.get(drafter, drafter) == "model" and self.dec.draft_runner is None:
            raise ApiError(400, "this bundle has no draft model; use drafter 'auto', 'prompt-lookup' or 'none'",
                           param="speculation.drafter")
        if self.jobs.full():  # refused before its prompt is tokenized
            self.metrics.admit("rejected")
            raise self._busy()
        # Tokenized and checked against the context here, so the error is the client's and nothing is queued. On
        # the event loop's thread: the tokenizer holds the GIL while it encodes, so another thread would stall the
        # loop all the same, and this thread's heap (spec-run serve's main thread: glibc's main arena) is the one
        # malloc_trim shrinks to the last page; another thread's arena keeps its free top, tens of MB after a 1 MB
        # prompt.
        try:
            n_prompt = self._prompt_tokens(prompt, params)
        except ContextLengthError as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt",
                           code="context_length_exceeded") from None
        except (PromptError, SamplingParamsError) as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt") from None
        job = Job(prompt, chat, params, drafter, k, n_prompt, asyncio.get_running_loop(), asyncio.Queue())
        self.metrics.admit()
        self.jobs.put_nowait(job)  # there is room: only this thread puts, and it awaited nothing since the check
        return job, stream, include_usage

    def _busy(self) -> ApiError:
        return ApiError(503, f"the server is busy (its queue of {self.jobs.maxsize} requests is full); retry shortly",
                        "server_error", code="overloaded", headers={"Retry-After": "1"})

    async def _read_body(self, request: Any) -> bytes:
        """The request body, refused (413) past ``max_body`` bytes, by its Content-Length or as it arrives."""
        too_big = ApiError(413, f"the request body is over {self.max_body} bytes, more than a prompt that fills "
                                f"this bundle's context (S_max={self.dec.manifest.max_context} tokens) needs",
                           code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_big
        body = bytearray()
        async for part in request.stream():
            if len(body) + len(part) > self.max_body:
                raise too_big
            body += part
        return bytes(body)

    def _prompt_tokens(self, prompt: Any, params: SamplingParams) -> int:
        n = len(self.dec.encode_prompt(prompt))
        check_fits(self.dec.manifest, n, params)
        return n

    # --------------------------------------------------------------- responses
    def _usage(self, n_prompt: int, stats: Any) -> dict:
        usage = {"prompt_tokens": n_prompt, "completion_tokens": stats.new_tokens if stats else 0,
                 "total_tokens": n_prompt + (stats.new_tokens if stats else 0)}
        if stats is not None:
            usage["specedge"] = {"reused_tokens": stats.reused_tokens, "drafted": stats.drafted,
                                 "accepted": stats.accepted, "rounds": stats.rounds,
                                 "acceptance_rate": round(stats.acceptance_rate, 4),
                                 "free_guesses_accepted": stats.guesses_accepted,
                                 "strategies": stats.strategies, "ttft_s": round(stats.ttft_s, 4),
                                 "decode_tok_s": round(stats.decode_tok_s, 2)}
        return usage

    async def _next(self, job: Job) -> tuple[str, Any]:
        kind, item = await job.events.get()
        if kind == "error":
            e = item
            status = 400 if isinstance(e, (PromptError, SamplingParamsError, ContextLengthError)) else 500
            raise ApiError(status, f"{type(e).__name__}: {e}", "invalid_request_error" if status == 400
                           else "server_error")
        return kind, item

    async def _collect(self, request: Any, job: Job, rid: str, chat: bool) -> Any:
        from starlette.responses import JSONResponse

        async def watch() -> None:  # the body is read: the next message is the client leaving (or the response sent)
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancelled.set()

        watcher = asyncio.create_task(watch())
        text, reason, stats = [], None, None
        try:
            while True:
                kind, ev = await self._next(job)
                if kind == "done":
                    break
                text.append(ev.text)
                if ev.finished:
                    reason, stats = ev.finish_reason, ev.stats
        except ApiError as e:
            return self._error(e)
        finally:
            watcher.cancel()
            job.cancelled.set()  # no-op once done; frees the worker if this coroutine was cancelled
        out = "".join(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _reason(reason), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": out}
        else:
            choice["text"] = out
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model, "choices": [choice],
                             "usage": self._usage(job.n_prompt, stats)})

    def _sse(self, job: Job, rid: str, chat: bool, include_usage: bool) -> Any:
        from starlette.responses import StreamingResponse

        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(delta: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if first else \
                    ({"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model,
                                          "choices": [choice]}) + "\n\n"

        async def events():
            stats, reason = None, None
            try:
                if chat:
                    yield chunk(None, None, first=True)
                while True:
                    try:
                        kind, ev = await self._next(job)
                    except ApiError as e:
                        yield "data: " + json.dumps(e.body()) + "\n\n"
                        return
                    if kind == "done":
                        break
                    if ev.text:
                        yield chunk(ev.text, None)
                    if ev.finished:
                        stats, reason = ev.stats, ev.finish_reason
                yield chunk(None, _reason(reason))
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model,
                                                 "choices": [], "usage": self._usage(job.n_prompt, stats)}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled.set()  # the client went away (or we are done): the worker stops at the next round

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


DEFAULT_MAX_BATCH = 4  # spec-run serve's requests decoded together, where the bundle and backend can


def default_max_batch(bundle: str, backend: str) -> int:
    """:data:`DEFAULT_MAX_BATCH` for a row-addressed bundle (kv_mode rows) on the CPU, else 1 (its graphs take one
    sequence a step; a self draft shares one sequence's cache). An unreadable bundle gives 1: loading it says what is
    wrong."""
    from pathlib import Path

    from .manifest import ROWS_KV_MODE, read_manifest

    try:
        m = read_manifest(Path(bundle), verify="none")
    except SpecEdgeError:
        return 1
    self_draft = m.draft is not None and m.draft.is_self
    return DEFAULT_MAX_BATCH if m.kv_mode == ROWS_KV_MODE and backend in ("auto", "ort-cpu") and not self_draft else 1


def _reason(reason: str | None) -> str | None:
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason or "", reason)


def serve(bundle: str, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 16, api_key: str | None = None,
          backend: str = "auto", threads: int | None = None, log_level: str = "info", cuda_graphs: bool = True,
          drafter: str = "auto", max_batch: int | None = None) -> None:
    """Load the bundle and serve it until interrupted. The log says at start whether an API key is required (never
    the key). max_batch: requests decoded together (None: :data:`DEFAULT_MAX_BATCH` for a row-addressed bundle on
    the CPU, else 1)."""
    try:
        import uvicorn
    except ImportError:
        raise SpecEdgeError("spec-run serve needs the [serve] extra: pip install 'specedge[serve]'") from None
    import logging
    from pathlib import Path

    api_key = check_api_key(api_key)  # before the bundle loads: a bad key fails in a moment
    if max_batch is None:
        max_batch = default_max_batch(bundle, backend)
    dec = SpecDecoder.load(bundle, backend=backend, threads=threads, verify="size", cuda_graphs=cuda_graphs,
                           max_batch=max_batch)
    srv = Server(dec, Path(bundle).resolve().name, max_queue=max_queue, api_key=api_key, drafter=drafter)
    config = uvicorn.Config(srv.app, host=host, port=port, log_level=log_level)  # sets up uvicorn's loggers
    log = logging.getLogger("uvicorn.error")
    if api_key is not None:
        log.info("specedge: serving %s; the /v1 routes require an API key (Authorization: Bearer ...)", srv.model)
    else:
        log.log(logging.INFO if host in ("127.0.0.1", "localhost", "::1") else logging.WARNING,
                "specedge: serving %s with no API key: every client that reaches %s:%d is served (--api-key or "
                "SPECEDGE_API_KEY requires one)", srv.model, host, port)
    log.info("specedge: %d request%s decoded together (--max-batch)", max_batch, "s" if max_batch > 1 else "")
    try:
        uvicorn.Server(config).run()
    finally:
        srv.stop()
