"""`spec-run serve`: an OpenAI-compatible HTTP server over one SpecDecoder.

Starlette + uvicorn (the ``[serve]`` extra): pure Python, ~2 MB installed, no pydantic/compiled deps beyond what
uvicorn needs — on a Jetson the model, not the server, should own the memory. One decoding worker thread runs
requests in arrival order (batch 1) from a bounded queue; a full queue answers 503 with Retry-After. Events cross
from the worker to the request's coroutine through ``loop.call_soon_threadsafe``; a client that disconnects sets
its job's cancel flag and the worker closes the stream at the next round. The decoder reuses the cached prefix of
the previous request, so a chat turn pays only for its new tokens (``usage.specedge.reused_tokens``).

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming SSE or not), GET /v1/models, /health,
/metrics (Prometheus text). Errors have OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .decoder import SpecDecoder
from .errors import ContextLengthError, PromptError, SamplingParamsError, SpecEdgeError
from .factory import DRAFTER_ALIASES
from .metrics import Metrics
from .request import check_fits
from .sampling import SamplingParams

DRAFTERS = ("auto", "hybrid", "model", "prompt-lookup", "lookup", "none", "off")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Job:
    prompt: Any  # str or chat messages
    chat: bool
    params: SamplingParams
    drafter: str
    k: int | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)


def _num(body: dict, name: str, kind: type, default: Any, lo: float, hi: float) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, kind) and not isinstance(v, bool) if kind is int else \
        isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok or not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be a number in [{lo}, {hi}], got {v!r}", param=name)
    return v


def parse_request(body: Any, chat: bool, max_context: int, k_max: int) -> tuple[Any, SamplingParams, str, int | None]:
    """OpenAI request fields -> (prompt, SamplingParams, drafter, k). Unknown fields are ignored, invalid ones
    raise ApiError(400) naming the field and what is allowed."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        prompt = msgs
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
            raise ApiError(400, f"'{name}' {body[name]!r} is not supported by this server (one choice, plain text, "
                                f"no logprobs, tools, penalties or logit bias); leave it out", param=name,
                           code="unsupported_parameter")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or
                             not all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 63):
        raise ApiError(400, f"'seed' must be an integer in [0, 2^63), got {seed!r}", param="seed")
    spec = body.get("speculation") or {}
    if not isinstance(spec, dict):
        raise ApiError(400, "'speculation' must be an object {drafter, k}", param="speculation")
    drafter = spec.get("drafter", "auto")
    if drafter not in DRAFTERS:
        raise ApiError(400, f"'speculation.drafter' must be one of {', '.join(DRAFTERS)}, got {drafter!r}",
                       param="speculation.drafter")
    k = _num(spec, "k", int, None, 0, k_max) if "k" in spec else None
    try:
        params = SamplingParams(max_new_tokens=max_tokens,
                                temperature=_num(body, "temperature", float, 1.0, 0.0, 2.0),
                                top_p=_num(body, "top_p", float, 1.0, 1e-9, 1.0),
                                top_k=_num(body, "top_k", int, 0, 0, 1 << 20), seed=seed, stop=tuple(stop or ()))
    except SamplingParamsError as e:
        raise ApiError(400, str(e)) from None
    return prompt, params, drafter, k


def parse_streaming(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) from a request's ``stream`` and ``stream_options``; invalid ones raise ApiError(400)
    before anything is queued."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    opts = body.get("stream_options")
    if opts is None:
        return bool(stream), False
    if not isinstance(opts, dict):
        raise ApiError(400, f"'stream_options' must be an object {{include_usage}}, got {opts!r}",
                       param="stream_options")
    usage = opts.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise ApiError(400, f"'stream_options.include_usage' must be true or false, got {usage!r}",
                       param="stream_options.include_usage")
    return bool(stream), bool(usage)


class Server:
    """The decoder, its worker thread, the bounded queue and the metrics; ``app`` is the ASGI application."""

    def __init__(self, dec: SpecDecoder, model_name: str, max_queue: int = 16, api_key: str | None = None,
                 max_body: int | None = None):
        self.dec, self.model, self.api_key = dec, model_name, api_key
        # The largest request body read: a prompt that fills the context is a few bytes a token (~4 of English,
        # up to ~12 JSON-escaped), so 64 a token with a 1 MiB floor turns away only what cannot fit, before it is
        # parsed and tokenized (a 24 MB prompt took 2 GB and 20 s of the event loop to be refused).
        self.max_body = max_body or max(1 << 20, 64 * dec.manifest.max_context)
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.metrics = Metrics()
        self._worker = threading.Thread(target=self._work, name="specedge-decoder", daemon=True)
        self._worker.start()
        self.app = self._make_app()

    # ------------------------------------------------------------------ worker
    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.metrics.queue_depth.set(self.jobs.qsize())
            post = lambda kind, item: job.loop.call_soon_threadsafe(job.events.put_nowait, (kind, item))  # noqa
            if job.cancelled.is_set():
                post("done", None)
                continue
            try:
                stream = self.dec.stream(job.prompt, job.params, drafter=job.drafter, k=job.k)
                for ev in stream:
                    if job.cancelled.is_set():  # the client left: stop at this round boundary
                        stream.close()
                        self.metrics.cancelled.inc()
                        break
                    post("event", ev)
                post("done", None)
            except Exception as e:  # noqa: BLE001 - reported to the client, never kills the worker
                post("error", e)

    def stop(self) -> None:
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
        if self.api_key and request.headers.get("authorization", "") != f"Bearer {self.api_key}":
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error",
                           code="invalid_api_key")

    async def _health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

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
        try:
            self._auth(request)
            try:
                body = json.loads(await self._read_body(request))
            except (ValueError, UnicodeDecodeError) as e:
                raise ApiError(400, f"the request body is not valid JSON: {e}") from None
            if isinstance(body, dict) and body.get("model") not in (None, self.model):
                raise ApiError(404, f"model {body.get('model')!r} does not exist; this server serves {self.model!r}",
                               param="model", code="model_not_found")
            m = self.dec.manifest
            prompt, params, drafter, k = parse_request(body, chat, m.max_context, m.k)
            stream, include_usage = parse_streaming(body)
            if DRAFTER_ALIASES.get(drafter, drafter) == "model" and self.dec.draft_runner is None:
                raise ApiError(400, "this bundle has no draft model; use drafter 'auto', 'prompt-lookup' or 'none'",
                               param="speculation.drafter")
            try:  # tokenize and check the context here (off the event loop), so the error is the client's and
                # nothing is queued
                n_prompt = await asyncio.to_thread(self._prompt_tokens, prompt, params)
            except ContextLengthError as e:
                raise ApiError(400, str(e), param="messages" if chat else "prompt",
                               code="context_length_exceeded") from None
            except (PromptError, SamplingParamsError) as e:
                raise ApiError(400, str(e), param="messages" if chat else "prompt") from None
            job = Job(prompt, chat, params, drafter, k, asyncio.get_running_loop(), asyncio.Queue())
            try:
                self.jobs.put_nowait(job)
            except queue.Full:
                self.metrics.rejected.inc()
                raise ApiError(503, f"the server is busy ({self.jobs.maxsize} requests queued); retry shortly",
                               "server_error", code="overloaded", headers={"Retry-After": "1"}) from None
            self.metrics.queue_depth.set(self.jobs.qsize())
            self.metrics.requests.inc()
        except ApiError as e:
            return self._error(e)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if stream:
            return self._sse(request, job, rid, chat, n_prompt, include_usage)
        return await self._collect(request, job, rid, chat, n_prompt)

    async def _read_body(self, request: Any) -> bytes:
        """The request body, refused (413) past ``max_body`` bytes, by its Content-Length or as it arrives."""
        too_big = ApiError(413, f"the request body is over {self.max_body} bytes, more than a prompt that fills "
                                f"this bundle's context (S_max={self.dec.manifest.max_context} tokens) needs",
                           code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_big
        parts, n = [], 0
        async for part in request.stream():
            n += len(part)
            if n > self.max_body:
                raise too_big
            parts.append(part)
        return b"".join(parts)

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

    def _finish(self, job: Job, stats: Any) -> None:
        if stats is not None:
            self.metrics.observe(stats, time.perf_counter() - job.queued_at)

    async def _next(self, job: Job) -> tuple[str, Any]:
        kind, item = await job.events.get()
        if kind == "error":
            e = item
            status = 400 if isinstance(e, (PromptError, SamplingParamsError, ContextLengthError)) else 500
            raise ApiError(status, f"{type(e).__name__}: {e}", "invalid_request_error" if status == 400
                           else "server_error")
        return kind, item

    async def _collect(self, request: Any, job: Job, rid: str, chat: bool, n_prompt: int) -> Any:
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
        self._finish(job, stats)
        out = "".join(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _reason(reason), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": out}
        else:
            choice["text"] = out
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": self.model, "choices": [choice],
                             "usage": self._usage(n_prompt, stats)})

    def _sse(self, request: Any, job: Job, rid: str, chat: bool, n_prompt: int, include_usage: bool) -> Any:
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
                                                 "choices": [], "usage": self._usage(n_prompt, stats)}) + "\n\n"
                yield "data: [DONE]\n\n"
                self._finish(job, stats)
            finally:
                job.cancelled.set()  # the client went away (or we are done): the worker stops at the next round

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _reason(reason: str | None) -> str | None:
    return {"eos": "stop", "stop": "stop", "length": "length"}.get(reason or "", reason)


def serve(bundle: str, host: str = "127.0.0.1", port: int = 8000, max_queue: int = 16, api_key: str | None = None,
          backend: str = "auto", threads: int | None = None, log_level: str = "info", cuda_graphs: bool = True) -> None:
    """Load the bundle and serve it until interrupted."""
    try:
        import uvicorn
    except ImportError:
        raise SpecEdgeError("spec-run serve needs the [serve] extra: pip install 'specedge[serve]'") from None
    from pathlib import Path

    dec = SpecDecoder.load(bundle, backend=backend, threads=threads, verify="size", cuda_graphs=cuda_graphs)
    srv = Server(dec, Path(bundle).resolve().name, max_queue=max_queue, api_key=api_key)
    try:
        uvicorn.run(srv.app, host=host, port=port, log_level=log_level)
    finally:
        srv.stop()
