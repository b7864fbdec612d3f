"""AsyncEngine: the event-loop side of the facade.

Every method here runs on the caller's thread, usually an event loop
(asyncio or trio), and never touches the ``LLMEngine``: it puts a command in
the worker's inbox and, for the awaitable ones, waits for the answer on the
caller's loop. The sync ``shutdown()`` may run on any thread.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import anyio
from vllm.sampling_params import SamplingParams
from vllm.usage.usage_lib import UsageContext

from .._bridge import _loops
from .._bridge._commands import Abort, Add, Reply
from .._errors import EngineClosedError, EngineNotStartedError
from .._types import RestartPolicy
from .._worker._worker import Worker
from . import _checks
from ._asyncllm import AsyncLLMMethods
from ._build_time import BuildRecord
from ._engine_control import EngineControl
from ._sink import _Sink
from ._stream import RequestStream

if TYPE_CHECKING:
    from types import TracebackType

    from vllm import EngineArgs, LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerFactory

    from .._vllm import EngineLike

__all__ = ("AsyncEngine",)


class AsyncEngine(AsyncLLMMethods, EngineControl):
    """An async facade (asyncio or trio) over one ``vllm.LLMEngine``, stepped on its own thread.

    A dedicated worker thread owns the engine: it is the only thread that
    calls it. Methods put commands in the worker's inbox, which it applies in
    FIFO order between two steps, so a command issued after another (from any
    loop or thread) is applied after it. Streams and command results are
    delivered to the event loop that issued them; one started engine serves
    any number of loops, asyncio loops and trio runs alike, at once or one
    after the other.

    Build one with ``AsyncEngine.from_engine_args(args)`` and ``await start()``
    (or ``async with``), or wrap an engine you built with ``AsyncEngine(engine)``,
    which starts the worker at once. The engine is then owned by the facade:
    closing the facade shuts it down.

    ``freeze_gc`` (default True): once the engine is built, run a full garbage
    collection and ``gc.freeze()``, as vLLM's own OpenAI server does. What
    exists then (torch, vLLM, the engine's client side) lives as long as the
    process; frozen, it is no longer scanned by every full collection, which
    otherwise holds the GIL, and so stalls the event loop, for a long time
    (measured: 0.25 s on CPU and 0.5 s on an H200 host in a burst of 1,024
    requests; docs/performance.md). Process-wide, like every ``gc`` setting:
    pass False to leave the collector alone.

    ``stream_interval`` (seconds, default 0): the default of ``generate``'s
    own, which makes a stream wake its consumer at most once per interval.

    ``keep_off_model_cores`` (default True): where the engine's model workers
    are bound to some of this process's CPUs (vLLM's CPU backend), keep the
    worker thread and vLLM's output thread on the others, which vLLM reserves
    for the frontend, while 16 or more requests are in flight (and until 4
    or fewer are), so that they don't preempt a long model step. The caller's
    event loop is never moved; on a GPU nothing is bound and nothing moves.
    Threads and processes started from the worker thread meanwhile (a
    ``run_on_engine`` callable's) inherit the placement. docs/performance.md
    has the figures.

    ``rebuild`` (a wrapped engine only): a callable that builds a new engine
    after this one died; with it, ``restart`` (default ``RestartPolicy()``)
    says how often. ``from_engine_args(..., restart=...)`` rebuilds from the
    same arguments. Without either, a death is final, as it always was.

    It also has ``AsyncLLM``'s names and shapes for what the two share
    (``get_tokenizer``, ``tokenizer``, ``add_request``, ``sleep``, LoRA, profiling,
    the cache resets, ...), so code written for ``AsyncLLM`` runs on it; and
    ``asynckv.AsyncEngineClient`` makes it vLLM's ``EngineClient``.

    The controls (``run_on_engine``, ``reset_prefix_cache``, ``paused()``, the
    pause calls, ``stats``, ``check_health``) come from ``EngineControl``.
    """

    def __init__(
        self,
        llm_engine: EngineLike,
        *,
        freeze_gc: bool = True,
        stream_interval: float = 0.0,
        rebuild: Callable[[], EngineLike] | None = None,
        restart: RestartPolicy | None = None,
        keep_off_model_cores: bool = True,
    ) -> None:
        if restart is not None and rebuild is None:
            raise ValueError("restart needs rebuild=: a wrapped engine can't be rebuilt without it")
        if rebuild is not None and restart is None:
            restart = RestartPolicy()
        self._record = BuildRecord(llm_engine)
        self._worker = Worker(
            lambda: llm_engine, freeze_gc, _checks.restart(restart), rebuild, keep_off_model_cores
        )
        self._closed = False
        self._stream_interval = _checks.stream_interval(stream_interval)
        self._worker.start(None)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        start_engine_loop: bool = True,
        usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        stat_loggers: list[StatLoggerFactory] | None = None,
        *,
        freeze_gc: bool = True,
        stream_interval: float = 0.0,
        restart: RestartPolicy | None = None,
        keep_off_model_cores: bool = True,
    ) -> AsyncEngine:
        """Make an engine that ``start()`` will build from ``engine_args``.

        Does no heavy work: nothing is loaded until ``start()`` (``AsyncLLM``
        builds in its constructor). ``usage_context`` and ``stat_loggers`` go
        to ``LLMEngine.from_engine_args``; ``start_engine_loop`` is accepted for
        ``AsyncLLM``'s signature and, as there, changes nothing. ``freeze_gc``,
        ``stream_interval`` and ``keep_off_model_cores``: see the class.

        ``restart`` (default None: a death is final): rebuild a dead engine from
        the same arguments and resume every unfinished request where it
        stopped, within the policy's limits (``RestartPolicy``;
        docs/reliability.md, "Restart and resume").
        """
        from vllm import LLMEngine

        build = functools.partial(
            LLMEngine.from_engine_args,
            engine_args,
            usage_context=usage_context,
            stat_loggers=stat_loggers,
        )
        return cls._unstarted(build, freeze_gc, stream_interval, restart, keep_off_model_cores)

    @classmethod
    def _unstarted(
        cls,
        build: Callable[[], LLMEngine],
        freeze_gc: bool,
        stream_interval: float = 0.0,
        restart: RestartPolicy | None = None,
        keep_off_model_cores: bool = True,
    ) -> AsyncEngine:
        self = cls.__new__(cls)
        self._record = BuildRecord()
        # A rebuilt engine is not recorded: the loop reads the first one's configs
        # and renderer, which a rebuild from the same arguments leaves as they were.
        policy = _checks.restart(restart)
        self._worker = Worker(
            self._record.wrap(build), freeze_gc, policy, build, keep_off_model_cores
        )
        self._closed = False
        self._stream_interval = _checks.stream_interval(stream_interval)
        return self

    @property
    def stream_interval(self) -> float:
        """The default of ``generate(stream_interval=...)``, seconds (0: every output at once).

        Settable; a new value applies to streams made after it, and is checked
        as ``generate``'s own (TypeError, ValueError).
        """
        return self._stream_interval

    @stream_interval.setter
    def stream_interval(self, seconds: float) -> None:
        self._stream_interval = _checks.stream_interval(seconds)

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Build the engine on the worker thread and wait until it is ready.

        The event loop keeps serving meanwhile (loading and compiling can take
        tens of seconds). Raises the engine's own error if it can't be built.
        A no-op for an engine that is already started.
        """
        self._check_open()
        if self._worker.started:
            return
        reply = Reply.here()
        self._worker.start(reply)
        await reply.future

    async def aclose(self, timeout: float = 30.0) -> None:
        """Close the engine: end what is in flight, shut vLLM down, join the worker.

        Streams and commands still in flight end with ``EngineClosedError``, as
        do all later calls. Waits (without blocking the loop) up to about
        ``timeout`` seconds for the worker; a worker stuck in a dead engine is
        abandoned and its engine processes killed. Idempotent.

        A cancellation never stops a close that has begun. Under a trio (or
        anyio) cancel scope the wait is shielded: leaving ``async with engine:``
        by a cancellation returns once the engine is closed, where trio's
        cancelled scope would otherwise cancel the cleanup itself. asyncio's
        ``task.cancel()`` interrupts the wait, as it always did, and the close
        goes on in its thread.
        """
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._worker.close, timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Blocking ``aclose()``, for any thread; idempotent.

        ``timeout`` as in ``aclose()``; None (``AsyncLLM``'s default, which
        waits without limit there) waits up to 30 seconds, so that a worker
        stuck in a dead engine can't hang the caller.
        """
        if self._closed:
            return
        self._closed = True
        self._worker.close(30.0 if timeout is None else timeout)

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError()

    def _submit(self, command: Any) -> None:
        self._check_open()
        if not self._worker.started:
            raise EngineNotStartedError()
        self._worker.inbox.put(command)  # raises EngineDeadError once dead

    async def _ask(self, make: Callable[[Reply], Any]) -> Any:
        reply = Reply.here()
        self._submit(make(reply))
        return await reply.future

    # -- requests ------------------------------------------------------------------

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stream_interval: float | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """Submit a request now and return its stream.

        The request is in the inbox when this returns, before anyone awaits
        the stream. ``prompt`` is anything ``LLMEngine.add_request`` takes (a
        string, a ``TokensPrompt``, ...); ``kwargs`` go to ``add_request``
        (``lora_request``, ``priority``, ...). Without ``request_id`` a unique
        one is made. Must be called on a running event loop (asyncio or trio),
        which the stream then belongs to.

        A bad request (empty or too long prompt, unknown LoRA, an id already
        in flight, ...) raises its error from the stream, to this caller only.

        ``stream_interval`` (seconds; None: the engine's ``stream_interval``)
        makes the stream wake its consumer at most once per interval: outputs
        that come sooner are coalesced on the loop (DELTA outputs merged,
        CUMULATIVE ones replaced by the latest), and go out together once the
        interval has passed. The first output and the final one always go out
        at once, and no token is lost. 0 hands out every output as it comes.

        Raises:
            TypeError: ``sampling_params``, ``request_id`` or ``stream_interval``
                has the wrong type.
            ValueError: a ``seed`` beyond 64 bits (vLLM would hang on it), a
                negative ``stream_interval``.
            EngineClosedError, EngineDeadError, EngineNotStartedError: at once.
        """
        loop = _loops.current()
        params = _checks.sampling_params(sampling_params)
        rid = _checks.request_id(request_id)
        interval = (
            self._stream_interval
            if stream_interval is None
            else _checks.stream_interval(stream_interval)
        )
        sink = _Sink(loop, rid, params.output_kind, params.n, interval)
        self._submit(Add(rid, prompt, params, kwargs, sink))
        return RequestStream(rid, sink, self._abort_soon)

    def _abort_soon(self, request_id: str, why: str) -> None:
        # Called from streams abandoned by cancel, break or GC: never raise. A request
        # that a pool member adopted (failover) is aborted there.
        inbox = self._worker.forwarded.get(request_id, self._worker.inbox)
        with contextlib.suppress(Exception):
            inbox.put(Abort([request_id], None, why))

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests and return once they are out of the engine.

        Each stream ends with a final output whose unfinished completions have
        ``finish_reason == "abort"``. Unknown or finished ids are ignored.
        ``internal`` is ``AsyncLLM``'s flag for ids that vLLM made itself; asynckv
        hands out only the ids given to ``generate``, so both values abort them.
        """
        ids = _checks.request_ids(request_id)
        await self._ask(lambda reply: Abort(ids, reply))
