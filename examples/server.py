"""An OpenAI-compatible completions server on asynckv, as a small FastAPI app.

It shows what the facade is for: engines started in the app's lifespan serve
every HTTP request from the server's one event loop, and a client that goes
away takes its request out of the engine before the engine's next step. The
body is parsed, and the sampling parameters made, by vLLM's own protocol
model (``CompletionRequest.to_sampling_params``), so it takes the whole
completions body vLLM takes. For all of vLLM's server (chat, tools, metrics,
tokenize, ...) on asynckv, run ``python -m asynckv.serve`` instead. Run this
one with::

    VLLM_CPU_KVCACHE_SPACE=1 python examples/server.py --port 8000 [--engines 2]

(``--model PATH`` and any other ``EngineArgs`` flag go to the engines; without
``--model`` it serves asynckv's demo model.)

Endpoints:

* ``POST /v1/completions``: OpenAI's completions body. ``prompt`` is a string,
  a list of strings, token ids or a list of them (one request each, choices
  numbered ``prompt * n + i``); ``n``, ``logprobs``, ``echo``, ``stop``,
  ``seed``, the penalties, ``logit_bias``, ``user`` and vLLM's extras
  (``ignore_eos``, ``top_k``, ``min_tokens``, ``repetition_penalty``, ...).
  JSON, or with ``stream`` server-sent events in OpenAI's chunk format, ending
  with ``data: [DONE]`` (usage last with ``stream_options.include_usage``).
* ``GET /v1/models``: the one model, with the engine's ``max_model_len``.
* ``POST /reset_prefix_cache``: ``{"reset_running_requests": bool}`` in,
  ``{"reset": bool}`` out (every engine's answer, and-ed).
* ``POST /pause``: ``{"mode": "abort" | "wait" | "keep"}`` (``AsyncEngine.pause_generation``
  on every engine): completions that arrive meanwhile wait; ``POST /resume`` admits them.
* ``GET /health``: 200 while an engine is usable, 503 once none is: with
  ``{"status": "degraded"}`` while one restarts (``--restart``), else an error.
  With ``--engines N``, ``"draining"`` lists the members taking no new
  request (``[]`` but during a rolling restart).
* ``POST /admin/rolling_restart``: ``{"handoff": bool}`` (default true) in;
  restarts every engine in turn, rebuilt from the same arguments, and returns
  once the last is back: ``{"members": [{"index", "moved", "stayed"}, ...]}``.
  With ``--engines N`` (``AsyncEnginePool.rolling`` with ``engine.restart``)
  the pool serves throughout: a member's streams move to another member
  (``handoff``) and continue from their last token, or finish where they are
  (``"handoff": false``) before it restarts. With one engine it is a planned
  ``engine.restart()``: its streams pause, then go on (``"members"`` is empty:
  nothing is drained). Needs ``--restart N`` (only then do requests keep the
  state they continue from; ``--restart 0`` keeps every death final) and
  ``--api-key`` (it answers 403 without one);
  409 while a roll already runs.
* ``GET /stats``: the requests in flight, waiting, finished and aborted over
  all engines, and each engine's ``AsyncEngine.stats()``.

Limits: the server listens on 127.0.0.1 unless ``--host`` says otherwise;
with ``--api-key KEY`` every ``/v1`` and ``/admin`` endpoint answers 401
without ``Authorization: Bearer KEY``; with ``--max-pending N``, a completion beyond N
in flight gets 429 with ``Retry-After`` instead of a place in an unbounded
queue. ``--engines N`` serves from ``AsyncEnginePool``, N engines on one loop.
``--restart N`` rebuilds an engine that died (its engine core killed, say)
up to N times a minute: streaming clients see their tokens continue.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
whatever fails: 400 for a body that doesn't validate (not UTF-8, not JSON, a
prompt with a lone surrogate, ...) or a request the engine refuses (a prompt
longer than the model takes, say); 404 for a ``model`` other than the one
served, as ``vllm serve`` answers it (type ``NotFoundError``, "The model
`nope` does not exist. Valid aliases: demo."), and for an unknown path; 503 when the engines are
dead or closed; 500 for a bug. An error after a stream has started arrives as
an ``error`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from types import FrameType
from typing import Any, Literal, TypeVar

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from vllm import EngineArgs
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.async_utils import merge_async_iterators

from asynckv import (
    AsyncEngine,
    AsyncEnginePool,
    EngineClosedError,
    EngineDeadError,
    EngineRestartingError,
    RequestStream,
    RestartPolicy,
)

PauseMode = Literal["abort", "wait", "keep"]

__all__ = ("create_app", "main")

T = TypeVar("T")
Engines = AsyncEngine | AsyncEnginePool
UNAVAILABLE = (EngineDeadError, EngineClosedError)
# What vLLM raises for a request it refuses (VLLMValidationError is not a ValueError).
BAD_REQUEST = (ValueError, OverflowError, VLLMValidationError)
# How long a stream that lost its client waits for the engine to confirm the abort.
_ABORT_WAIT_SECONDS = 10.0


class ResetBody(BaseModel):
    """The body of ``POST /reset_prefix_cache``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    reset_running_requests: bool = False


class RollBody(BaseModel):
    """The body of ``POST /admin/rolling_restart``: move the streams, or let them finish."""

    model_config = ConfigDict(extra="forbid", strict=True)
    handoff: bool = True


class PauseBody(BaseModel):
    """The body of ``POST /pause``: what happens to the requests in flight."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: PauseMode = "wait"


# -- errors --------------------------------------------------------------------------


def _error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(message, kind, param), status_code=status)


def _invalid(exc: Exception) -> JSONResponse:
    param = exc.parameter if isinstance(exc, VLLMValidationError) else None
    return _error(400, str(exc), "invalid_request_error", param)


async def _on_bad_request(request: Request, exc: Exception) -> JSONResponse:
    # vLLM's protocol models raise VLLMValidationError from their validators, which
    # pydantic passes through instead of making a validation error of it.
    return _invalid(exc)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    # FastAPI's own refusals (a body it can't decode, an unknown path, a wrong method).
    assert isinstance(exc, HTTPException)
    if isinstance(exc.__cause__, UnicodeDecodeError):
        bad = exc.__cause__
        message = f"invalid body: not valid UTF-8 ({bad.reason} at byte {bad.start})"
    else:
        message = str(exc.detail)
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    response = _error(exc.status_code, message, kind)
    response.headers.update(exc.headers or {})
    return response


async def _on_crash(request: Request, exc: Exception) -> JSONResponse:
    # Starlette still logs the traceback: an exception that gets here is a bug.
    return _error(500, f"{type(exc).__name__}: {exc}", "internal_error")


async def _on_invalid_body(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            problems.append("the body is not valid JSON")
            continue
        where = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
        problems.append(f"{where}: {err.get('msg')}" if where else "expected a JSON object")
    return _error(400, "invalid body: " + "; ".join(problems), "invalid_request_error")


class Guard:
    """ASGI middleware: the API key on ``/v1`` and ``/admin``, and at most ``max_pending``
    completions in flight.

    The ``/admin`` routes restart engines: without an API key they answer 403.

    A completion counts from its arrival to the end of its response (the last
    event of a stream), so the bound holds however the clients behave.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, max_pending: int | None) -> None:
        self.app, self.api_key, self.max_pending = app, api_key, max_pending
        self.pending = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path.startswith("/admin") and self.api_key is None:
            await _error(403, "the /admin routes need the server started with --api-key",
                         "permission_error")(scope, receive, send)  # fmt: skip
            return
        if self.api_key is not None and path.startswith(("/v1", "/admin")):
            headers = dict(scope["headers"])
            if headers.get(b"authorization", b"").decode() != f"Bearer {self.api_key}":
                await _error(401, "a valid API key is required", "authentication_error")(
                    scope, receive, send
                )
                return
        if path != "/v1/completions":
            await self.app(scope, receive, send)
            return
        if self.max_pending is not None and self.pending >= self.max_pending:
            refused = _error(429, f"{self.pending} completions in flight; retry", "rate_limit")
            refused.headers["Retry-After"] = "1"
            await refused(scope, receive, send)
            return
        self.pending += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.pending -= 1


# -- the app -------------------------------------------------------------------------


def create_app(
    engine_args: EngineArgs,
    model_name: str | None = None,
    *,
    engines: int = 1,
    api_key: str | None = None,
    max_pending: int | None = None,
    restart: RestartPolicy | None = None,
) -> FastAPI:
    """Make the app; its lifespan starts the engines from ``engine_args`` and closes them.

    ``engines`` > 1 serves from an ``AsyncEnginePool`` of that many engines.
    ``restart``: each engine's ``RestartPolicy`` (a dead engine is rebuilt and
    its streams continue where they stopped).
    ``model_name`` is the name answers carry in ``model``: by default the
    first ``served_model_name``, else ``engine_args.model``.
    """
    backend: Engines
    if engines > 1:
        pool = AsyncEnginePool.from_engine_args([engine_args] * engines, restart=restart)
        backend, members = pool, pool.engines
    else:
        backend = AsyncEngine.from_engine_args(engine_args, restart=restart)
        members = (backend,)
    served = engine_args.served_model_name
    names = [served] if isinstance(served, str) else [str(s) for s in served or ()]
    names = [model_name] if model_name else names or [str(engine_args.model)]
    name = names[0]
    # The model's card: max_model_len is the engine's (the model's own when no flag set it).
    card: dict[str, Any] = {"id": name, "object": "model", "owned_by": "asynckv"}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with backend:
            # The tokenizer and the model's length are read from the engine that was
            # built; read them now, while it is up, so they stay readable if it dies.
            _ = members[0].tokenizer
            card["max_model_len"] = int(members[0].model_config.max_model_len)
            yield

    app = FastAPI(title="asynckv completions server", lifespan=lifespan)
    app.state.engines = backend  # for the shutdown, which closes them first (_Server)
    app.add_exception_handler(RequestValidationError, _on_invalid_body)
    app.add_exception_handler(VLLMValidationError, _on_bad_request)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_crash)
    app.add_middleware(Guard, api_key=api_key, max_pending=max_pending)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if body.suffix is not None or body.use_beam_search or body.prompt_embeds is not None:
            return _error(400, "suffix, beam search and prompt embeddings are not supported",
                          "invalid_request_error")  # fmt: skip
        if body.model and body.model not in names:  # as vllm serve: no model named is fine
            unknown = f"The model `{body.model}` does not exist. Valid aliases: {', '.join(names)}."
            return _error(404, unknown, "NotFoundError", "model")
        engine = members[0]  # for the tokenizer and limits, the same on every engine
        try:
            prompts = _prompts(body.prompt)
            params = [body.to_sampling_params(_max_tokens(body, p, engine)) for p in prompts]
        except BAD_REQUEST as exc:
            return _invalid(exc)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": request_id, "object": "text_completion", "created": int(time.time())}
        head["model"] = name
        try:
            streams = [
                backend.generate(prompt, sp, f"{request_id}-{i}")
                for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True))
            ]
        except UNAVAILABLE as exc:
            return _error(503, str(exc), "service_unavailable")
        answer = _Answer(body, prompts, engine)
        outputs = merge_async_iterators(*(_outputs(s) for s in streams))
        owned = True  # closed on the way out unless the response takes them over
        try:
            # The first output (or the engine's refusal) comes before the headers,
            # so that a refused request gets its 400 rather than a broken stream.
            first = await _unless_disconnected(request, anext(outputs))
            if first is None:
                return Response(status_code=499)  # nginx's "client closed request"
            if body.stream:
                owned = False
                return _EventStream(_events(answer, head, first, outputs, streams))
            finals = await _unless_disconnected(request, _finals(first, outputs, len(prompts)))
            return Response(status_code=499) if finals is None else {**head, **answer.whole(finals)}
        except UNAVAILABLE as exc:
            return _error(503, str(exc), "service_unavailable")
        except BAD_REQUEST as exc:  # the engine refused it (a prompt too long, say)
            return _invalid(exc)
        finally:
            if owned:
                await _close(outputs, streams)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(body: ResetBody | None = None) -> Any:
        running = body is not None and body.reset_running_requests
        try:
            done = await backend.reset_prefix_cache(reset_running_requests=running)
        except UNAVAILABLE as exc:
            return _error(503, str(exc), "service_unavailable")
        return {"reset": all(done) if isinstance(done, list) else done}

    @app.post("/pause")
    async def pause(body: PauseBody | None = None) -> Any:
        mode = "wait" if body is None else body.mode
        try:
            await asyncio.gather(
                *(engine.pause_generation(mode=mode, clear_cache=False) for engine in members)
            )
        except UNAVAILABLE as exc:
            return _error(503, str(exc), "service_unavailable")
        return {"paused": True}

    @app.post("/resume")
    async def resume() -> Any:
        try:
            await asyncio.gather(*(engine.resume_generation() for engine in members))
        except UNAVAILABLE as exc:
            return _error(503, str(exc), "service_unavailable")
        return {"paused": False}

    @app.get("/health")
    async def health() -> Any:
        # Which members take no new request (a rolling restart's current one).
        draining: dict[str, Any] = {}
        if isinstance(backend, AsyncEnginePool):
            draining["draining"] = sorted(backend.drained)
        errors, restarting = [], False
        for engine in members:
            try:
                await engine.check_health()
                return {"status": "ok", **draining}
            except EngineRestartingError as exc:
                restarting = True
                errors.append(str(exc))
            except UNAVAILABLE as exc:
                errors.append(str(exc))
        if restarting:
            # Degraded, not dead: requests wait and resume once the engine is back.
            degraded = {"status": "degraded", "detail": "; ".join(errors), **draining}
            return JSONResponse(degraded, 503)
        return _error(503, "; ".join(errors), "service_unavailable")

    rolling = asyncio.Lock()  # one roll at a time: a second is refused, not queued

    @app.post("/admin/rolling_restart")
    async def rolling_restart(body: RollBody | None = None) -> Any:
        handoff = body is None or body.handoff
        if restart is None:
            needs = "a restart needs the server started with --restart N (0: deaths stay final)"
            return _error(409, needs, "conflict")
        if rolling.locked():
            return _error(409, "a rolling restart is already running", "conflict")
        async with rolling:
            try:
                if isinstance(backend, AsyncEnginePool):
                    drained = await backend.rolling(_restart, handoff=handoff)
                else:
                    await backend.restart()
                    drained = []  # nothing drained: its streams continue on the new engine
            except UNAVAILABLE as exc:
                return _error(503, str(exc), "service_unavailable")
            except ValueError as exc:  # the roll can't hand over (a member is dead, say)
                return _error(409, str(exc), "conflict")
        return {
            "members": [
                {"index": d.index, "moved": len(d.moved), "stayed": len(d.stayed)} for d in drained
            ]
        }

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        each = [engine.stats()._asdict() for engine in members]
        keys = ("requests_in_flight", "requests_waiting", "commands_queued")
        totals = {key: sum(s[key] for s in each) for key in (*keys, "requests_finished")}
        return totals | {
            "requests_aborted": sum(s["requests_aborted"] for s in each),
            "engines": each,
        }

    return app


async def _restart(engine: AsyncEngine) -> None:
    await engine.restart()


def _prompts(prompt: Any) -> list[str | TokensPrompt]:
    """One engine prompt per prompt of the body: text as it is, token ids as a TokensPrompt."""
    if prompt is None or prompt == [] or prompt == "":
        raise VLLMValidationError("prompt must not be empty", parameter="prompt")
    if isinstance(prompt, str):
        return [_unicode(prompt)]
    if all(isinstance(p, int) for p in prompt):
        return [TokensPrompt(prompt_token_ids=list(prompt))]
    return [
        _unicode(p) if isinstance(p, str) else TokensPrompt(prompt_token_ids=list(p))
        for p in prompt
    ]


def _unicode(text: str) -> str:
    """``text``, if it is valid Unicode: JSON's escapes can spell a lone surrogate, which isn't."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"U+{ord(text[exc.start]):04X} at character {exc.start}"
        raise VLLMValidationError(
            f"prompt is not valid Unicode: a lone surrogate ({where}); a character "
            "beyond U+FFFF is escaped in JSON as a pair of surrogates",
            parameter="prompt",
        ) from None
    return text


def _max_tokens(body: CompletionRequest, prompt: str | TokensPrompt, engine: AsyncEngine) -> int:
    """The body's ``max_tokens``, or with null as many as the model's length leaves."""
    if body.max_tokens is not None:
        return int(body.max_tokens)
    ids = (
        prompt["prompt_token_ids"] if isinstance(prompt, dict) else engine.tokenizer.encode(prompt)
    )
    return max(1, int(engine.model_config.max_model_len) - len(ids))


async def _outputs(stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
    # An async generator, as merge_async_iterators takes; leaving it aborts the request.
    async with stream:
        async for out in stream:
            yield out


async def _finals(
    first: tuple[int, RequestOutput], rest: AsyncIterator[tuple[int, RequestOutput]], count: int
) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * count
    finals[first[0]] = first[1]
    async for i, out in rest:
        finals[i] = out
    return [out for out in finals if out is not None]


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, or cancel it and return None if the client goes away first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _disconnect(request: Request) -> None:
    # The body has been read, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _close(outputs: AsyncGenerator[Any, None], streams: list[RequestStream]) -> None:
    """Abort what is unfinished and wait, boundedly, for the streams to end (shielded)."""
    with anyio.move_on_after(_ABORT_WAIT_SECONDS, shield=True):
        await outputs.aclose()
        for stream in streams:
            await stream.aclose()


# -- answers -------------------------------------------------------------------------


class _Answer:
    """Turns a request's outputs into OpenAI's choices: text, echo, logprobs and usage."""

    def __init__(self, body: CompletionRequest, prompts: list[Any], engine: AsyncEngine) -> None:
        self.body, self.prompts, self.engine = body, prompts, engine
        self.offsets: dict[int, int] = {}  # per choice: characters sent so far
        self.prompt_tokens = [0] * len(prompts)
        self.generated = 0

    def choices(self, i: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The choices of one output (a delta when streaming) of prompt ``i``."""
        self.prompt_tokens[i] = len(out.prompt_token_ids or ())
        choices = []
        for c in out.outputs:
            index = i * self.body.n + c.index
            echo = self.body.echo and index not in self.offsets  # the choice's first chunk
            start = self.offsets.get(index, 0)
            prefix = self._prompt_text(out) if echo else ""
            self.offsets[index] = start + len(prefix) + len(c.text)
            self.generated += len(c.token_ids)
            logprobs = None
            if self.body.logprobs is not None and c.logprobs is not None:
                # OpenAI's echo with logprobs scores the prompt's tokens too.
                scored = out.prompt_logprobs if echo and out.prompt_logprobs is not None else []
                prompt = list(zip(out.prompt_token_ids or (), scored, strict=False))
                generated = list(zip(c.token_ids, c.logprobs, strict=False))
                logprobs = self._logprobs(prompt, generated, start, prefix)
            choices.append(
                {
                    "index": index,
                    "text": prefix + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return choices

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return str(out.prompt)
        return str(self.engine.get_tokenizer().decode(out.prompt_token_ids or []))

    def _logprobs(
        self, prompt: list[Any], generated: list[Any], start: int, prefix: str
    ) -> dict[str, list[Any]]:
        """OpenAI's completion logprobs of ``(token id, {id: Logprob} | None)`` positions.

        ``text_offset`` indexes the choice's whole text: a prompt token the
        echoed ``prefix`` doesn't show (``<s>``) sits where the text stands.
        """
        lp: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        lp["text_offset"] = []
        at = 0  # how far into the prefix
        for token_id, position in prompt:
            text = self._add(lp, token_id, position, start + at)
            found = prefix.find(text, at) if text else -1
            if found >= 0:
                lp["text_offset"][-1], at = start + found, found + len(text)
        offset = start + len(prefix)
        for token_id, position in generated:
            offset += len(self._add(lp, token_id, position, offset))
        return lp

    def _add(self, lp: dict[str, list[Any]], token_id: int, position: Any, offset: int) -> str:
        chosen = None if position is None else position[token_id]
        # The first prompt token has no logprob, nor a decoded text: decode it here.
        if chosen is None:
            text = str(self.engine.get_tokenizer().decode([token_id]))
        else:
            text = chosen.decoded_token or ""
        lp["tokens"].append(text)
        lp["token_logprobs"].append(None if chosen is None else chosen.logprob)
        top = None if position is None else {p.decoded_token: p.logprob for p in position.values()}
        lp["top_logprobs"].append(top)
        lp["text_offset"].append(offset)
        return text

    def usage(self) -> dict[str, int]:
        prompt = sum(self.prompt_tokens)
        total = prompt + self.generated
        return {"prompt_tokens": prompt, "completion_tokens": self.generated, "total_tokens": total}

    def whole(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The body of a JSON answer from each prompt's final output."""
        choices = [c for i, out in enumerate(finals) for c in self.choices(i, out)]
        return {"choices": sorted(choices, key=lambda c: c["index"]), "usage": self.usage()}


def _sse(data: object) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _events(
    answer: _Answer,
    head: dict[str, Any],
    first: tuple[int, RequestOutput],
    rest: AsyncGenerator[tuple[int, RequestOutput], None],
    streams: list[RequestStream],
) -> AsyncGenerator[str, None]:
    """Yield the SSE events of the merged DELTA streams, ``first`` first.

    However it ends (the client gone, an error, the server stopping), every
    unfinished request is aborted and its stream closed, in ``finally``.
    """
    try:
        yield _sse({**head, "choices": answer.choices(*first)})
        async for i, out in rest:
            yield _sse({**head, "choices": answer.choices(i, out)})
        options = answer.body.stream_options
        if options is not None and options.include_usage:
            yield _sse({**head, "choices": [], "usage": answer.usage()})
        yield "data: [DONE]\n\n"
    except EngineClosedError as exc:
        yield _sse(_error_body(f"the server is shutting down ({exc})", "service_unavailable"))
    except UNAVAILABLE as exc:
        yield _sse(_error_body(str(exc), "service_unavailable"))
    except Exception as exc:
        yield _sse(_error_body(f"{type(exc).__name__}: {exc}", "internal_error"))
    finally:
        await _close(rest, streams)


class _EventStream(StreamingResponse):
    """A server-sent event response that closes its generator however it ends.

    Starlette cancels the sending task when the client disconnects, which can
    leave the generator suspended at a ``yield``; closing it here runs its
    ``finally`` at once rather than whenever it is garbage-collected.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events

    async def stream_response(self, send: Send) -> None:
        async with contextlib.aclosing(self._events):
            await super().stream_response(send)


# -- command line --------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, then serve until interrupted."""
    parser = FlexibleArgumentParser(description="Serve OpenAI-style completions with asynckv.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--engines", type=int, default=1, help="engines (AsyncEnginePool if > 1)")
    parser.add_argument("--api-key", default=None, help="require this bearer token on /v1")
    parser.add_argument("--max-pending", type=int, default=None, help="429 beyond this many")
    parser.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    parser.add_argument(
        "--restart",
        type=int,
        default=None,
        metavar="N",
        help="rebuild a dead engine up to N times a minute, resuming its streams",
    )
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)  # None: the demo model
    args = parser.parse_args(argv)
    model_name = None
    if args.model is None:
        from asynckv.testing import demo_model

        args.model = str(demo_model())  # trained and cached on first use (minutes)
        model_name = "demo"
    app = create_app(
        EngineArgs.from_cli_args(args),
        model_name,
        engines=args.engines,
        api_key=args.api_key,
        max_pending=args.max_pending,
        restart=None if args.restart is None else RestartPolicy(max_restarts=args.restart),
    )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    _Server(config, app.state.engines).run()


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGTERM (or Ctrl-C) first closes the engines.

    uvicorn stops on a signal only once every connection has closed, so a
    stream would otherwise hold the exit until its last token. Closed first,
    the engines end every stream at once with an error event saying the
    server is shutting down; then the connections close and the lifespan
    (whose close is then a no-op) ends.
    """

    def __init__(self, config: uvicorn.Config, engines: Engines) -> None:
        super().__init__(config)
        self.engines = engines
        self.closing: list[asyncio.Task[None]] = []  # a task is kept until it is done

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            # A signal handler runs between two bytecodes of the loop's thread:
            # the close is handed to the loop, which the call wakes.
            loop = asyncio.get_running_loop()
            close = self.engines.aclose
            loop.call_soon_threadsafe(lambda: self.closing.append(loop.create_task(close())))
        super().handle_exit(sig, frame)


if __name__ == "__main__":  # vLLM spawns engine processes: the guard is required
    main()
