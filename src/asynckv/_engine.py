"""AsyncEngine: the event-loop side of the facade.

Every method here runs on the caller's thread, usually an event loop
(asyncio or trio), and never touches the ``LLMEngine``: it puts a command in
the worker's inbox and, for the awaitable ones, waits for the answer on the
caller's loop. The sync ``shutdown()`` may run on any thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import anyio
from vllm.sampling_params import SamplingParams
from vllm.usage.usage_lib import UsageContext

from . import _checks, _loops
from ._asyncllm import AsyncLLMMethods, BuildRecord
from ._commands import Abort, Add, Call, Hold, Pause, PauseMode, Release, Reply, Resume
from ._errors import (
    EngineClosedError,
    EngineDeadError,
    EngineNotStartedError,
    EngineStalledError,
)
from ._log import emit
from ._sink import _Sink
from ._stats import EngineStats
from ._stream import RequestStream
from ._worker import Worker

if TYPE_CHECKING:
    from types import TracebackType

    from vllm import EngineArgs, LLMEngine
    from vllm.v1.metrics.loggers import StatLoggerFactory

    from ._vllm import EngineLike

__all__ = ("AsyncEngine",)

P = ParamSpec("P")
R = TypeVar("R")

# The holds of the paused() blocks the current task is inside (tasks created
# in a block inherit it): a call that needs steps which such a hold stops can
# never complete, and the worker refuses it at once.
_HOLDING: contextvars.ContextVar[frozenset[Hashable]] = contextvars.ContextVar(
    "asynckv_holding", default=frozenset()
)


class AsyncEngine(AsyncLLMMethods):
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

    It also has ``AsyncLLM``'s names and shapes for what the two share
    (``get_tokenizer``, ``tokenizer``, ``add_request``, ``sleep``, LoRA, profiling,
    the cache resets, ...), so code written for ``AsyncLLM`` runs on it; and
    ``asynckv.AsyncEngineClient`` makes it vLLM's ``EngineClient``.
    """

    def __init__(self, llm_engine: EngineLike, *, freeze_gc: bool = True) -> None:
        self._record = BuildRecord(llm_engine)
        self._worker = Worker(lambda: llm_engine, freeze_gc)
        self._closed = False
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
    ) -> AsyncEngine:
        """Make an engine that ``start()`` will build from ``engine_args``.

        Does no heavy work: nothing is loaded until ``start()`` (``AsyncLLM``
        builds in its constructor). ``usage_context`` and ``stat_loggers`` go
        to ``LLMEngine.from_engine_args``; ``start_engine_loop`` is accepted for
        ``AsyncLLM``'s signature and, as there, changes nothing. ``freeze_gc``:
        see the class.
        """
        from vllm import LLMEngine

        build = functools.partial(
            LLMEngine.from_engine_args,
            engine_args,
            usage_context=usage_context,
            stat_loggers=stat_loggers,
        )
        return cls._unstarted(build, freeze_gc)

    @classmethod
    def _unstarted(cls, build: Callable[[], LLMEngine], freeze_gc: bool) -> AsyncEngine:
        self = cls.__new__(cls)
        self._record = BuildRecord()
        self._worker = Worker(self._record.wrap(build), freeze_gc)
        self._closed = False
        return self

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

        Raises:
            TypeError: ``sampling_params`` or ``request_id`` has the wrong type.
            ValueError: a ``seed`` beyond 64 bits (vLLM would hang on it).
            EngineClosedError, EngineDeadError, EngineNotStartedError: at once.
        """
        loop = _loops.current()
        params = _checks.sampling_params(sampling_params)
        rid = _checks.request_id(request_id)
        sink = _Sink(loop, rid, params.output_kind, params.n)
        self._submit(Add(rid, prompt, params, kwargs, sink))
        return RequestStream(rid, sink, self._abort_soon)

    def _abort_soon(self, request_id: str, why: str) -> None:
        # Called from streams abandoned by cancel, break or GC: never raise.
        with contextlib.suppress(Exception):
            self._worker.inbox.put(Abort([request_id], None, why))

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests and return once they are out of the engine.

        Each stream ends with a final output whose unfinished completions have
        ``finish_reason == "abort"``. Unknown or finished ids are ignored.
        ``internal`` is ``AsyncLLM``'s flag for ids that vLLM made itself; asynckv
        hands out only the ids given to ``generate``, so both values abort them.
        """
        ids = _checks.request_ids(request_id)
        await self._ask(lambda reply: Abort(ids, reply))

    # -- between two steps ---------------------------------------------------------

    async def run_on_engine(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run ``fn(llm_engine, *args, **kwargs)`` on the worker between two steps.

        Returns its result; its exception is raised here and the engine keeps
        going. ``fn`` must not block for long: no step runs meanwhile.
        """
        result: R = await self._ask(lambda reply: Call(lambda e: fn(e, *args, **kwargs), reply))
        return result

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Reset the prefix cache between two steps and return vLLM's answer.

        False when running requests still hold blocks and
        ``reset_running_requests`` is False. With it True, running requests are
        preempted and recomputed, and finish as they would have without the reset.
        """
        worker = self._worker

        def reset(engine: LLMEngine) -> bool:
            # On the worker thread, between two steps.
            in_flight = len(worker.registry.routes)
            done = bool(engine.reset_prefix_cache(reset_running_requests, reset_connector))
            emit(
                logging.INFO if done else logging.WARNING,
                "prefix cache reset",
                result=done,
                step=worker.counters.steps,
                reset_running_requests=reset_running_requests,
                requests_preempted=in_flight if done and reset_running_requests else 0,
            )
            return done

        result: bool = await self.run_on_engine(reset)
        return result

    def stats(self) -> EngineStats:
        """Take a snapshot of the engine's counters, without waiting for the worker.

        Safe from any thread; never blocks. See ``EngineStats`` for the fields.
        """
        snap = self._worker.snapshot()
        last = snap.last_step_end
        return EngineStats(
            steps=snap.steps,
            steps_per_second=snap.steps_per_second,
            last_step_seconds=snap.last_step_seconds,
            seconds_since_last_step=None if last is None else time.perf_counter() - last,
            requests_in_flight=snap.in_flight,
            requests_waiting=snap.waiting,
            paused=snap.admission_paused or snap.held,
            commands_queued=snap.commands_queued,
            outputs_delivered=snap.outputs_delivered,
            requests_finished=snap.requests_finished,
            requests_aborted=snap.requests_aborted,
            loops_served=snap.loops_served,
        )

    @property
    def step_count(self) -> int:
        """The number of engine steps completed so far."""
        return self._worker.counters.steps

    @contextlib.asynccontextmanager
    async def paused(self, at_step: int | None = None) -> AsyncIterator[int]:
        """Hold the engine at a step boundary for the duration of the block.

        Enters once the worker stands at the next boundary, or right after step
        ``at_step`` completes, and yields the number of completed steps there.
        Commands issued in the block (generate, abort, reset, ...) are applied
        in order at that boundary; stepping resumes when the block exits.

        Holds stack: stepping resumes when every block has exited. A block
        entered inside another of the same task (or of a task created inside
        it) for a future ``at_step`` could never be entered, and raises at once.

        Raises:
            ValueError: ``at_step`` has already passed.
            EngineHeldError: ``at_step`` is in the future and the caller's own
                ``paused()`` block stops the stepping.
        """
        holding = _HOLDING.get()
        hold = Hold(at_step, Reply.here(), holding)
        try:
            self._submit(hold)
            step: int = await hold.reply.future
            entered = _HOLDING.set(holding | {hold.token})
            try:
                yield step
            finally:
                _HOLDING.reset(entered)
        finally:
            with contextlib.suppress(EngineClosedError, EngineDeadError):
                self._worker.inbox.put(Release(hold.token))

    async def pause_generation(
        self, *, mode: PauseMode = "abort", clear_cache: bool = True
    ) -> None:
        """Pause generation, as ``AsyncLLM.pause_generation`` does.

        Requests submitted while paused wait and are admitted, in order, on
        ``resume_generation()``. ``mode`` says what happens to those in flight:
        ``"abort"`` aborts them, ``"wait"`` returns once they have finished,
        ``"keep"`` freezes them until resumed. ``clear_cache`` then resets the
        prefix cache (preempting kept requests, which recompute on resume).
        A pause while paused applies its own mode to what is in flight. A
        pending ``"wait"`` also returns when ``resume_generation()`` comes first.
        docs/reset-and-pause.md has the outcome of every combination.

        Raises:
            ValueError: an unknown ``mode``.
            EngineHeldError: ``"wait"`` with requests in flight while a ``"keep"``
                pause or the caller's own ``paused()`` block stops the stepping
                (it could never return); nothing changes.
        """
        mode = _checks.pause_mode(mode)
        holding = _HOLDING.get()
        await self._ask(lambda reply: Pause(mode, clear_cache, reply, holding))

    async def resume_generation(self) -> None:
        """Resume after ``pause_generation()``: admit the waiting requests, step again.

        A no-op when not paused. Pending ``"wait"`` pauses return.
        """
        await self._ask(Resume)

    async def is_paused(self) -> bool:
        """Whether ``pause_generation()`` is in force."""
        self._check_open()
        return self._worker.snapshot().admission_paused

    # -- health ----------------------------------------------------------------------

    async def check_health(self, stall_timeout: float | None = None) -> None:
        """Raise unless the engine is usable and, given ``stall_timeout``, making progress.

        Never waits for the worker, so it answers even while a step hangs.

        Raises:
            EngineClosedError: the engine was closed.
            EngineDeadError: the engine died.
            EngineStalledError: a ``step()`` has been running for longer than
                ``stall_timeout`` seconds, or requests are unfinished, nothing
                holds the engine (``paused()``, a "keep" pause) and no step has
                completed for that long.
        """
        self._check_open()
        snap = self._worker.snapshot()
        if (error := snap.dead_error) is not None:
            raise error
        if stall_timeout is None:
            return
        now = time.perf_counter()
        stepping = snap.in_step_since
        if stepping is not None and now - stepping > stall_timeout:
            # A step that doesn't return stalls everything, whatever we track.
            raise EngineStalledError(now - stepping, snap.in_flight)
        if not snap.in_flight or snap.held:
            return
        idle = now - max(snap.last_step_end or 0.0, snap.busy_since)
        if idle > stall_timeout:
            raise EngineStalledError(idle, snap.in_flight)

    @property
    def errored(self) -> bool:
        """Whether the engine has died."""
        return self._worker.registry.dead_error is not None

    @property
    def dead_error(self) -> BaseException:
        """The ``EngineDeadError`` that later calls raise (a generic one if not dead)."""
        error = self._worker.registry.dead_error
        return error or EngineDeadError(RuntimeError("the engine is alive"))
