"""An OpenAI-compatible completions server on asynckv, as a FastAPI app.

It shows what the facade is for: one engine, started in the app's lifespan,
serves every HTTP request from the server's event loop, and a client that
goes away takes its request out of the engine. Run it with::

    VLLM_CPU_KVCACHE_SPACE=1 python examples/server.py --host 127.0.0.1 --port 8000

(``--model PATH`` and any other ``EngineArgs`` flag, ``--max-num-seqs 32`` say,
go to the engine; without ``--model`` it serves asynckv's demo model.)

Endpoints:

* ``POST /v1/completions``: a subset of OpenAI's completions body (``prompt``,
  ``max_tokens``, ``temperature``, ``top_p``, ``n``, ``stream``,
  ``stream_options.include_usage``, ``stop``, ``seed``, and vLLM's
  ``ignore_eos``), answered with JSON or, with ``stream`` true, server-sent
  events in OpenAI's chunk format, ending with ``data: [DONE]``.
* ``POST /reset_prefix_cache``: ``{"reset_running_requests": bool}`` in,
  ``{"reset": bool}`` (the engine's answer) out.
* ``GET /health``: 200 while the engine is usable, 503 once it is dead or closed.
* ``GET /stats``: ``AsyncEngine.stats()`` as JSON.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:
400 for a body that doesn't validate or a request the engine refuses (a
prompt longer than the model takes, say), 503 when the engine is dead or
closed. An error after a stream has started arrives as an ``error`` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import Annotated, Any, TypeVar

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Send
from vllm import EngineArgs, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.utils.argparse_utils import FlexibleArgumentParser

from asynckv import AsyncEngine, EngineClosedError, EngineDeadError, RequestStream

__all__ = ("create_app", "main")

T = TypeVar("T")
log = logging.getLogger("asynckv.server")

_COMPACT = (",", ":")  # JSON separators without spaces, as FastAPI's JSON answers

# How long a stream that lost its client waits for the engine to confirm the abort.
_ABORT_WAIT_SECONDS = 10.0


# -- request bodies ------------------------------------------------------------------


class _Body(BaseModel):
    # JSON types are taken as they are ("1" is not a number) and unknown fields
    # are refused, so a misspelt option is a 400 rather than silently ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    """OpenAI's ``stream_options``."""

    include_usage: bool = False


class CompletionBody(_Body):
    """The part of OpenAI's completions body that this server understands.

    Integers are bounded as OpenAI bounds them: vLLM silently drops a request
    whose seed doesn't fit in 64 bits, and its engine then waits forever.
    """

    model: str | None = None
    """Accepted for compatibility and otherwise ignored: the server has one model."""
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1, lt=2**31)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = (
        None
    )
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    ignore_eos: bool = False
    """vLLM's extension: keep generating past the end-of-sequence token."""

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters; raises ``ValueError`` for a combination vLLM refuses."""
        return SamplingParams(
            n=self.n,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


class ResetBody(_Body):
    """The body of ``POST /reset_prefix_cache``."""

    reset_running_requests: bool = False


# -- errors --------------------------------------------------------------------------


def _error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(message, kind, param), status_code=status)


def _unavailable(exc: Exception) -> JSONResponse:
    return _error(503, str(exc), "service_unavailable")


def _gone() -> Response:
    # nginx's "client closed request": for the access log, nobody reads it.
    return Response(status_code=499)


def _invalid(exc: Exception) -> JSONResponse:
    param = exc.parameter if isinstance(exc, VLLMValidationError) else None
    return _error(400, str(exc), "invalid_request_error", param)


async def _on_invalid_body(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            problems.append("the body is not valid JSON")
            continue
        where = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
        # FastAPI hands over anything but a JSON object (no Content-Type, say) as is.
        problems.append(f"{where}: {err.get('msg')}" if where else "expected a JSON object")
    return _error(400, "invalid body: " + "; ".join(problems), "invalid_request_error")


# -- the app -------------------------------------------------------------------------


def create_app(engine_args: EngineArgs, model_name: str | None = None) -> FastAPI:
    """Make the app; its lifespan starts an engine from ``engine_args`` and closes it.

    ``model_name`` is the name answers carry in ``model``: by default the
    first ``served_model_name``, else ``engine_args.model``.
    """
    engine = AsyncEngine.from_engine_args(engine_args)
    if model_name is None:
        served = engine_args.served_model_name
        if isinstance(served, str):
            model_name = served
        elif served:
            model_name = str(served[0])
        else:
            model_name = str(engine_args.model)
    name = model_name

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine:
            yield

    app = FastAPI(title="asynckv completions server", lifespan=lifespan)
    app.add_exception_handler(RequestValidationError, _on_invalid_body)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Any:
        try:
            params = body.sampling_params()
        except ValueError as exc:  # VLLMValidationError is one too
            return _invalid(exc)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        try:
            stream = engine.generate(body.prompt, params, request_id=request_id)
        except (EngineDeadError, EngineClosedError) as exc:
            return _unavailable(exc)
        owned: RequestStream | None = stream  # closed on the way out unless handed off
        head = {"id": request_id, "object": "text_completion", "created": created, "model": name}
        try:
            if not body.stream:
                final = await _unless_disconnected(request, _result(stream))
                return _gone() if final is None else {**head, **_completion(final)}
            # The first output (or the engine's refusal) comes before the headers,
            # so that a refused request gets its 400 rather than a broken stream.
            outputs = aiter(stream)
            first = await _unless_disconnected(request, anext(outputs))
            if first is None:
                return _gone()
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = _events(stream, outputs, first, head, include_usage)
            owned = None  # the response closes it
            return _EventStream(events)
        except VLLMValidationError as exc:
            return _invalid(exc)
        except (EngineDeadError, EngineClosedError) as exc:
            return _unavailable(exc)
        finally:
            if owned is not None:
                await _close(owned)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(body: ResetBody | None = None) -> Any:
        running = body is not None and body.reset_running_requests
        try:
            return {"reset": await engine.reset_prefix_cache(reset_running_requests=running)}
        except (EngineDeadError, EngineClosedError) as exc:
            return _unavailable(exc)

    @app.get("/health")
    async def health() -> Any:
        try:
            await engine.check_health()
        except (EngineDeadError, EngineClosedError) as exc:
            return _unavailable(exc)
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return engine.stats()._asdict()

    return app


async def _result(stream: RequestStream) -> RequestOutput:
    return await stream


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, or cancel it and return None if the client goes away first.

    Cancelling a task that waits on a stream aborts the stream's request.
    """
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


# -- answers -------------------------------------------------------------------------


def _choice(completion: Any) -> dict[str, Any]:
    return {
        "index": completion.index,
        "text": completion.text,
        "logprobs": None,
        "finish_reason": completion.finish_reason,
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _completion(final: RequestOutput) -> dict[str, Any]:
    outputs: Sequence[Any] = final.outputs
    generated = sum(len(c.token_ids) for c in outputs)
    return {
        "choices": [_choice(c) for c in outputs],
        "usage": _usage(len(final.prompt_token_ids or ()), generated),
    }


def _sse(data: object) -> str:
    return f"data: {json.dumps(data, separators=_COMPACT)}\n\n"


async def _events(
    stream: RequestStream,
    outputs: AsyncIterator[RequestOutput],
    first: RequestOutput,
    head: dict[str, Any],
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    """Yield the SSE events of a DELTA stream whose first output is ``first``.

    However it ends (the client gone, an error, the server stopping), the
    request is aborted if unfinished and its stream closed, in ``finally``.
    """
    prompt_tokens = len(first.prompt_token_ids or ())
    generated = 0
    try:
        out: RequestOutput | None = first
        while out is not None:
            completions: Sequence[Any] = out.outputs
            generated += sum(len(c.token_ids) for c in completions)
            yield _sse({**head, "choices": [_choice(c) for c in completions]})
            out = await anext(outputs, None)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, generated)})
        yield "data: [DONE]\n\n"
    except (EngineDeadError, EngineClosedError) as exc:
        yield _sse(_error_body(str(exc), "service_unavailable"))
    except Exception as exc:
        log.exception("stream %s failed", stream.request_id)
        yield _sse(_error_body(f"{type(exc).__name__}: {exc}", "internal_error"))
    finally:
        await _close(stream)


async def _close(stream: RequestStream) -> None:
    """Abort the request if unfinished and wait, boundedly, for its stream to end.

    Shielded: a disconnect can arrive as a cancellation of the calling task.
    """
    with anyio.move_on_after(_ABORT_WAIT_SECONDS, shield=True):
        await stream.aclose()


class _EventStream(StreamingResponse):
    """A server-sent event response that closes its generator however it ends.

    Starlette cancels the sending task when the client disconnects, which can
    leave the generator suspended at a ``yield``; closing it here runs its
    ``finally`` at once rather than whenever it is garbage-collected.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
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
    parser.add_argument("--uvicorn-log-level", default="info", help="uvicorn's log level")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None)  # None: the demo model
    args = parser.parse_args(argv)
    model_name = None
    if args.model is None:
        from asynckv.testing import demo_model

        args.model = str(demo_model())  # built and cached on first use (about 15 s)
        model_name = "demo"
    engine_args = EngineArgs.from_cli_args(args)
    uvicorn.run(
        create_app(engine_args, model_name),
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
    )


if __name__ == "__main__":  # vLLM spawns engine processes: the guard is required
    main()
