"""The engine's controls, on ``AsyncEngine``: between-step calls, pausing, stats and health.

Every method here runs on the caller's thread, usually an event loop (asyncio
or trio), and never touches the ``LLMEngine``: the awaitable ones put a command
in the worker's inbox and wait for the answer on the caller's loop; ``stats``,
``check_health`` and the properties read the worker's snapshot, from any
thread, without waiting for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

from .._bridge._commands import Call, Hold, Pause, Release, Reply, Resume
from .._errors import (
    EngineClosedError,
    EngineDeadError,
    EngineRestartingError,
    EngineStalledError,
)
from .._log import emit
from .._stats import EngineStats
from .._types import PauseMode
from .._worker._registry import Life
from .._worker._steps import StepStream
from . import _checks

if TYPE_CHECKING:
    from vllm import LLMEngine

    from .._worker._worker import Worker

__all__ = ("EngineControl",)

R = TypeVar("R")

# The holds of the paused() blocks the current task is inside (tasks created
# in a block inherit it): a call that needs steps which such a hold stops can
# never complete, and the worker refuses it at once.
_HOLDING: contextvars.ContextVar[frozenset[Hashable]] = contextvars.ContextVar(
    "asynckv_holding", default=frozenset()
)


class EngineControl:
    """The controls of ``AsyncEngine``; see the module docstring and ``AsyncEngine``."""

    if TYPE_CHECKING:
        _worker: Worker

        def _check_open(self) -> None: ...

        def _submit(self, command: Any) -> None: ...

        async def _ask(self, make: Callable[[Reply], Any]) -> Any: ...

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

    def steps(self, buffer: int = 1024) -> StepStream:
        """Stream a ``StepRecord`` for each engine step from now on: ``async for step in ...``.

        Call it on the loop that will read it. Records come in step order,
        with the step's number, duration, requests and tokens (prefill and
        decode apart), finishes, and preemptions and the scheduler's queue
        where vLLM reports them (stats on). A reader that falls behind loses
        the oldest records beyond ``buffer`` (``StepStream.skipped`` counts
        them); the worker never waits for it. With no reader the worker
        makes no records at all. Iteration stops when the stream is closed or
        the engine closes; it raises ``EngineDeadError`` if the engine dies.
        ``run_on_engine`` remains the way to run code between two steps.

        Raises:
            ValueError: ``buffer`` < 1.
            EngineClosedError: the engine is closed.
        """
        self._check_open()
        if buffer < 1:
            raise ValueError(f"buffer must be at least 1, got {buffer}")
        return StepStream(self._worker.steps, buffer)

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
            restarts=snap.restarts,
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
            EngineDeadError: the engine died (with a ``RestartPolicy``: beyond it).
            EngineRestartingError: a dead engine is being rebuilt (its
                ``RestartPolicy``): degraded, not dead; requests wait and resume.
            EngineStalledError: a ``step()`` has been running for longer than
                ``stall_timeout`` seconds, or requests are unfinished, nothing
                holds the engine (``paused()``, a "keep" pause) and no step has
                completed for that long.
        """
        self._check_open()
        snap = self._worker.snapshot()
        if (error := snap.dead_error) is not None:
            raise error
        if snap.life is Life.RESTARTING:
            raise EngineRestartingError(self._worker.restart_cause)
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
    def restarting(self) -> bool:
        """Whether a dead engine is being rebuilt now (``RestartPolicy``): degraded, not dead."""
        return self._worker.registry.life is Life.RESTARTING

    @property
    def errored(self) -> bool:
        """Whether the engine has died."""
        return self._worker.registry.dead_error is not None

    @property
    def dead_error(self) -> BaseException:
        """The ``EngineDeadError`` that later calls raise (a generic one if not dead)."""
        error = self._worker.registry.dead_error
        return error or EngineDeadError(RuntimeError("the engine is alive"))
