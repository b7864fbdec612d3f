"""What ``python -m asynckv.serve`` runs on the main thread: vLLM's own server on asynckv.

The server is vLLM's, unchanged: its argument parser (``make_arg_parser``),
its socket setup, and ``build_and_serve``, which builds the FastAPI app (every
endpoint of ``vllm serve``) around an engine client and serves it with
uvicorn, shutting down on SIGTERM. The one difference is the engine client:
``AsyncEngineClient`` over an ``AsyncEngine`` instead of vLLM's ``AsyncLLM``.

asynckv adds three things, through vLLM's own ``--middleware`` hook:
``--max-pending N`` (429 with ``Retry-After`` beyond N generation requests in
flight), ``GET /stats`` (``AsyncEngine.stats()`` as JSON), both behind
``--api-key`` as vLLM's ``/v1`` is, and a loopback default for ``--host``.
On SIGTERM vLLM's server calls the client's ``shutdown`` with
``--shutdown-timeout``: asynckv drains for that long (admitted requests
finish, new ones get 503), then ends the rest with the same 503.

Runs on the main thread's event loop (uvloop, as ``vllm serve``); the engine's
worker thread is asynckv's.
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import signal
import sys
from typing import Any, NoReturn

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ("GENERATION_PATHS", "PendingLimit", "StatsRoute", "build_app", "main", "parse_args")

GENERATION_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/messages",
        "/invocations",
    }
)
"""The POST endpoints that ``--max-pending`` counts: those that generate."""

RETRY_AFTER_SECONDS = 1
"""The ``Retry-After`` a refused request gets: a request on this server takes seconds."""

_DEMO_CHAT_TEMPLATE = importlib.resources.files("asynckv") / "_data" / "chat_template.jinja"


class PendingLimit:
    """ASGI middleware: at most ``--max-pending`` generation requests in flight; 429 beyond.

    A request counts from its arrival to the end of its response (the last
    event of a stream), so a refused client can rely on the bound: no queue
    grows behind it. A refused request gets HTTP 429 with ``Retry-After`` and
    an OpenAI-shaped error body. The limit is read from the app's
    ``state.args.max_pending`` (vLLM keeps the parsed arguments there); None
    or 0 means no limit. Only the event loop touches the count.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.pending = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"].removeprefix(scope.get("root_path", "")) not in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        limit = getattr(scope["app"].state.args, "max_pending", None)
        if not _authorized(scope):
            # vLLM's own middleware, inside this one, answers 401: an unauthorized
            # client neither counts nor learns how busy the server is.
            await self.app(scope, receive, send)
            return
        if limit and self.pending >= limit:
            message = f"{self.pending} requests are pending, the most this server takes; retry"
            await _json(send, 429, _error(message, "TooManyRequests", 429), RETRY_AFTER_SECONDS)
            return
        self.pending += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.pending -= 1


class StatsRoute:
    """ASGI middleware that answers ``GET /stats`` with ``AsyncEngine.stats()`` as JSON.

    The snapshot never waits for the engine, so it answers even while a step
    runs long. Behind ``--api-key`` (or ``VLLM_API_KEY``) as vLLM's ``/v1`` is:
    without the key, 401 with vLLM's body. (vLLM leaves ``/metrics`` and
    ``/health`` open; ``/stats`` is asynckv's own, and guarded.)
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == "/stats":
            if not _authorized(scope):
                await _json(send, 401, {"error": "Unauthorized"})
                return
            client = scope["app"].state.engine_client
            await _json(send, 200, client.engine.stats()._asdict())
            return
        await self.app(scope, receive, send)


def _authorized(scope: Scope) -> bool:
    """Whether the request carries the server's API key, checked as vLLM's middleware does.

    asynckv's middleware is added after vLLM's authentication (``--middleware``),
    so it runs first and checks for itself. True when no key is set.
    """
    from starlette.datastructures import Headers
    from vllm import envs
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    state = scope["app"].state
    if not hasattr(state, "asynckv_auth"):  # made once per app: the key can't change
        args = state.args
        tokens = [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]
        state.asynckv_auth = AuthenticationMiddleware(_no_app, tokens) if tokens else None
    check: Any = state.asynckv_auth
    return check is None or bool(check.verify_token(Headers(scope=scope)))


async def _no_app(scope: Scope, receive: Receive, send: Send) -> None:
    # AuthenticationMiddleware wraps an app; only its verify_token is used here.
    raise NotImplementedError


def _error(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


async def _json(send: Send, status: int, body: object, retry_after: int | None = None) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


# -- the command line ------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``vllm serve``'s flags (vLLM's own parser) plus ``--max-pending``.

    Differences from ``vllm serve``: ``--host`` defaults to 127.0.0.1 (pass
    ``--host 0.0.0.0`` to listen on every interface), and without a model (no
    ``--model``, no positional model) it serves asynckv's demo model, named
    ``demo``, with a chat template. Flags that need more than one engine
    client or an engine started elsewhere are refused here, with the reason.
    """
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser, validate = _vllm_cli()
    parser = FlexibleArgumentParser(
        prog="python -m asynckv.serve",
        description="vLLM's OpenAI-compatible server, on an asynckv engine.",
    )
    parser = make_arg_parser(parser)
    parser.add_argument(
        "--max-pending",
        type=int,
        default=None,
        help="At most this many generation requests in flight (running or waiting); "
        "beyond, answer 429 with Retry-After instead of queueing without limit.",
    )
    parser.set_defaults(host="127.0.0.1", model=None)
    args: argparse.Namespace = parser.parse_args(argv)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    refused = _refused(args)
    if refused:
        parser.error(refused)
    if args.max_pending is not None and args.max_pending < 1:
        parser.error("--max-pending must be at least 1")
    if args.model is None:
        from ..testing import demo_model

        args.model = str(demo_model())  # built and cached on first use (about 15 s)
        args.served_model_name = args.served_model_name or ["demo"]
        if args.chat_template is None:
            args.chat_template = str(_DEMO_CHAT_TEMPLATE)
    validate(args)
    return args


def _refused(args: argparse.Namespace) -> str | None:
    checks = [
        (getattr(args, "api_server_count", None) not in (None, 1), "--api-server-count"),
        (getattr(args, "headless", False), "--headless"),
        (getattr(args, "grpc", False), "--grpc"),
        (getattr(args, "data_parallel_size", 1) != 1, "--data-parallel-size"),
        (getattr(args, "max_num_queued_tokens", None) is not None, "--max-num-queued-tokens"),
    ]
    names = [name for bad, name in checks if bad]
    if not names:
        return None
    return (
        f"{', '.join(names)}: not supported on asynckv, which runs one API server over "
        "one LLMEngine in this process (see docs/server.md)"
    )


def _vllm_cli() -> tuple[Any, Any]:
    try:  # vLLM 0.32
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
    except ImportError:  # vLLM before 0.32 (0.26 on the GPU machine)
        from vllm.entrypoints.openai.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
    return make_arg_parser, validate_parsed_serve_args


def _vllm_server() -> tuple[Any, Any]:
    try:  # vLLM 0.32
        from vllm.entrypoints.launchers.api_server.entry import build_and_serve
        from vllm.entrypoints.launchers.launcher import setup_server
    except ImportError:  # vLLM before 0.32
        from vllm.entrypoints.openai.api_server import (
            build_and_serve,
            setup_server,
        )
    return build_and_serve, setup_server


def _with_middleware(args: argparse.Namespace) -> None:
    middleware = [f"{__name__}.PendingLimit", f"{__name__}.StatsRoute"]
    args.middleware = [*args.middleware, *(m for m in middleware if m not in args.middleware)]


async def build_app(client: Any, args: argparse.Namespace) -> Any:
    """Build vLLM's OpenAI app on ``client`` (an ``AsyncEngineClient``), without serving it.

    The app ``serve`` serves, with asynckv's middleware, for an ASGI host
    other than vLLM's uvicorn (Ray Serve in examples/ray_serve.py): every
    ``vllm serve`` endpoint, ``--max-pending`` and ``GET /stats``. ``args`` is
    what ``parse_args`` returns. The app's lifespan (vLLM's periodic stats
    log, and a GC freeze) runs only if the host runs it; nothing else needs it.
    vLLM 0.32 only.
    """
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app as vllm_build_app

    _with_middleware(args)
    tasks = await client.get_supported_tasks()
    app = vllm_build_app(args, tasks, client.model_config)
    await init_app_state(client, app.state, args, tasks)
    return app


# -- serving ---------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    """Build the engine, serve vLLM's app on it until SIGTERM or SIGINT, then close it.

    The order is ``vllm serve``'s: the socket is bound before the engine is
    built, and a SIGTERM during the build interrupts it. On SIGTERM vLLM's
    server shuts the engine client down first (streams in flight end with an
    error event), then stops uvicorn; the engine's processes are gone when
    this returns.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from .._loop._engine import AsyncEngine
    from ._client import AsyncEngineClient

    build_and_serve, setup_server = _vllm_server()

    def interrupt(*_: object) -> NoReturn:
        raise KeyboardInterrupt("terminated")

    # vLLM's server installs its own handlers once uvicorn runs.
    signal.signal(signal.SIGTERM, interrupt)
    _with_middleware(args)
    listen_address, sock = setup_server(args, reuse_port=False)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    usage = UsageContext.OPENAI_API_SERVER
    engine = AsyncEngine.from_vllm_config(
        engine_args.create_engine_config(usage_context=usage),
        usage_context=usage,
        disable_log_stats=engine_args.disable_log_stats,
        aggregate_engine_logging=getattr(engine_args, "aggregate_engine_logging", False),
    )
    try:
        await engine.start()
        client = AsyncEngineClient(engine)
        if not await client.get_supported_tasks():
            raise NotImplementedError("asynckv serves generation only; this is a pooling model")
        await client.reset_mm_cache()  # as vLLM's server: drop the profiling run's inputs
        shutdown_task = await build_and_serve(client, listen_address, sock, args)
        await shutdown_task
    finally:
        engine.shutdown()  # idempotent: vLLM's server has usually closed it already
        sock.close()


def main(argv: list[str] | None = None) -> None:
    """Run the server: parse ``argv`` (default ``sys.argv[1:]``) and serve until stopped."""
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()  # vLLM's CLI default: spawn engine processes
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from vllm.logger import configure_logging_from_args

        configure_logging_from_args(args)
    except ImportError:  # vLLM before 0.32 configures logging at import
        pass
    from vllm.utils.system_utils import decorate_logs

    decorate_logs("APIServer")
    try:
        import uvloop
    except ImportError:
        import asyncio

        asyncio.run(serve(args))
    else:
        uvloop.run(serve(args))
