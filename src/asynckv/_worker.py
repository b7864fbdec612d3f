"""The worker thread: sole owner of the ``LLMEngine``.

Everything in ``Worker._run`` and below runs on the worker thread, which is
the only thread that ever calls the engine. Each pass takes the inbox's
commands in FIFO order and applies them, answers them, then steps once if
requests are unfinished and nothing stops the stepping; otherwise it sleeps
on the inbox, so an idle engine costs no CPU. It answers the loops only
through an ``Outbox``. Admission, holds and pauses are the pure state
machine of ``_control.py``; what waits for an answer lives in the
``Registry``, whose lock ``die`` and ``close`` take from other threads.

With vLLM's engine-core process, ``step()`` blocks until the core's next
output. The worker doesn't wait there: it sleeps on the inbox until a command
*or* that output arrives (vLLM's output thread nudges the inbox), and steps
once the output is there. That nudge is a hook into vLLM's internals, so
every such sleep is bounded: were the hook to stop firing, the worker would
only poll, and before the hook has ever fired it steps anyway (blocking, as
without the hook).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, assert_never

from . import _watchdog
from ._commands import Abort, Add, Call, Command, Hold, Outbox, Pause, Release, Reply, Resume
from ._control import Abort as AbortParked
from ._control import AbortAll, Admit, Answer, Effect, Fail, PauseCore, ResetCache, ResumeCore
from ._counters import Counters, Snapshot
from ._errors import EngineClosedError, EngineDeadError
from ._inbox import Inbox
from ._log import emit, enabled
from ._registry import Life, Registry, Route
from ._vllm import (
    EngineLike,
    abort_outputs,
    engine_processes,
    has_core_process,
    is_engine_dead,
    pause_core_scheduler,
    resume_core_scheduler,
    shutdown_core,
    watch_outputs,
)

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from ._registry import Transition

__all__ = ("Worker",)

# Bounds on the sleep while the core computes (see the module docstring).
_POLL_SECONDS = 0.05  # once the output hook has fired: a silent hook only slows us
_FIRST_WAIT_SECONDS = 0.02  # before it ever fired: then step (and block) anyway


class Worker:
    """Owns one engine on a thread of its own; see the module docstring."""

    def __init__(self, build: Callable[[], EngineLike], freeze_gc: bool = False) -> None:
        self.inbox: Inbox[Command] = Inbox()
        self.registry = Registry(self.inbox)
        self.counters = Counters()
        """Written by the worker only; read by anyone (``snapshot``)."""
        self._build = build
        self._freeze_gc = freeze_gc
        self._processes: list[BaseProcess] = []
        self._closing = threading.Event()  # wakes the watchdog on close
        self._thread = threading.Thread(target=self._run, name="asynckv-engine", daemon=True)
        self._started: Reply | None = None
        # Multiprocess mode: whether the core's next output is waiting (see _wait).
        self._output_ready: Callable[[], bool] | None = None
        self._hook_fired = False

    # -- any thread ----------------------------------------------------------------

    def start(self, reply: Reply | None) -> None:
        """Start the thread; it builds the engine, then answers ``reply``."""
        self._started = reply
        self.registry.set_life(Life.STARTING)
        self._thread.start()

    @property
    def started(self) -> bool:
        """Whether ``start`` was called."""
        return self._thread.ident is not None

    def snapshot(self) -> Snapshot:
        """The counters and states now, read without a lock (fields may span two steps)."""
        registry, control = self.registry, self.registry.control
        return self.counters.snapshot(
            life=registry.life,
            dead_error=registry.dead_error,
            in_flight=len(registry.routes),
            waiting=len(control.parked),
            admission_paused=not control.admitting,
            held=not control.stepping,
            commands_queued=len(self.inbox),
        )

    def close(self, timeout: float) -> None:
        """Stop the worker, end everything in flight with ``EngineClosedError``, join.

        Blocking; idempotent; any thread but the worker. Returns within about
        ``timeout`` seconds even if the worker is stuck inside ``step()``: then the
        engine processes are killed and the (daemon) thread is left behind.
        """
        self._end(Life.CLOSED, EngineClosedError())
        self._closing.set()
        if self.started and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for process in self._processes:
            if process.is_alive():
                try:
                    process.kill()
                    process.join(5)
                except Exception as exc:  # already reaped elsewhere: nothing left to kill
                    emit(logging.DEBUG, "engine process kill failed", error=str(exc))
        emit(logging.INFO, "engine closed", steps=self.counters.steps)

    def die(self, cause: BaseException) -> None:
        """Declare the engine dead: end everything in flight with ``EngineDeadError``.

        Idempotent, any thread. Ignored once closed: a close kills the processes.
        """
        if self._end(Life.DEAD, EngineDeadError(cause)):
            emit(logging.ERROR, "engine dead", error=str(self.registry.error), exc_info=cause)

    def _end(self, life: Life, error: BaseException) -> bool:
        ended = self.registry.end(life, error)
        if ended is None:
            return False
        outbox = Outbox()
        ended.fail(outbox)
        outbox.flush()
        return True

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        outbox = Outbox()
        began = time.monotonic()
        emit(logging.INFO, "engine starting")
        try:
            engine = self._build()
        except BaseException as exc:
            if self._started is not None:
                self._started.fail(outbox, exc)
            self.die(exc)
            outbox.flush()
            return
        try:
            self._serve(engine, outbox, began)
        except BaseException as exc:  # step() or the engine broke: the engine is dead
            self.die(exc)
        finally:
            shutdown_core(engine)

    def _serve(self, engine: EngineLike, outbox: Outbox, began: float) -> None:
        self._processes = engine_processes(engine)
        self.registry.set_core(has_core_process(engine))
        self._output_ready = watch_outputs(engine, self._output_arrived)
        if self._freeze_gc:
            _freeze_heap()
        _watchdog.start(self._processes, engine, self.die, self._closing, self._thread)
        self.registry.set_life(Life.RUNNING)
        emit(
            logging.INFO,
            "engine started",
            model=getattr(getattr(engine, "model_config", None), "model", None),
            mode="multiprocess" if self._processes else "in-process",
            seconds=round(time.monotonic() - began, 3),
        )
        if self._started is not None:
            self._started.ok(outbox)
        outbox.flush()
        self._loop(engine)

    def _output_arrived(self) -> None:
        # On vLLM's output thread: a plain store and the inbox's own lock.
        self._hook_fired = True
        self.inbox.nudge()

    def _loop(self, engine: EngineLike) -> None:
        inbox = self.inbox
        while not inbox.closed:
            commands, step_anyway = self._wait(engine)
            outbox = Outbox()
            while commands:
                if self.registry.ended:
                    # Died mid-batch (the watchdog): the rest must not reach the dead core.
                    error = self.registry.error or EngineDeadError(RuntimeError("ended"))
                    for command in commands:
                        command.fail(outbox, error)
                    break
                command = commands.popleft()
                try:
                    self._apply(engine, command, outbox)
                except BaseException as exc:
                    # The engine broke mid-command: die() can't see this batch.
                    self.die(exc)
                    error = self.registry.error or exc
                    for failed in (command, *commands):
                        failed.fail(outbox, error)
                    outbox.flush()
                    raise
            if outbox:
                # Answer the commands before stepping: a step can take long, or
                # (a request vLLM took but its core dropped) never return.
                self._flush(engine, outbox)
            stepping = not inbox.closed and self._may_step(engine)
            if stepping and (step_anyway or self._output_waiting()):
                self._step(engine, outbox)
            self._flush(engine, outbox)

    def _wait(self, engine: EngineLike) -> tuple[deque[Command], bool]:
        """Take the next commands, sleeping as long as nothing else is due.

        Returns them, and whether to step even if no output is known to wait.
        """
        if not self._may_step(engine):
            return self.inbox.take(block=True), False
        if self._output_waiting():
            return self.inbox.take(block=False), False
        if self._hook_fired:
            return self.inbox.take(block=True, timeout=_POLL_SECONDS), False
        began = time.monotonic()
        commands = self.inbox.take(block=True, timeout=_FIRST_WAIT_SECONDS)
        waited = time.monotonic() - began >= _FIRST_WAIT_SECONDS
        return commands, waited and not self._hook_fired

    def _may_step(self, engine: EngineLike) -> bool:
        return self.registry.control.stepping and engine.has_unfinished_requests()

    def _output_waiting(self) -> bool:
        ready = self._output_ready
        return ready is None or ready()

    def _step(self, engine: EngineLike, outbox: Outbox) -> None:
        counters = self.counters
        began = counters.in_step_since = time.perf_counter()
        outputs = engine.step()
        counters.in_step_since = None
        counters.count_step(began)
        delivered, finished = self.registry.dispatch(outputs, outbox)
        counters.outputs_delivered += delivered
        counters.requests_finished += finished
        if self.registry.control.pending:
            steps = counters.steps
            self._change(engine, outbox, lambda c: c.stepped(steps), None)

    def _flush(self, engine: EngineLike, outbox: Outbox) -> None:
        """Send the loops their answers, then settle what the pass changed.

        A closed loop's requests are aborted here; and whatever ended the last
        request in flight (a step, an abort, a closed loop) ends a "wait" pause
        now, not at a step that may never come.
        """
        for loop in outbox.flush():
            self._forget_loop(engine, loop)
        if self.registry.control.drains and not engine.has_unfinished_requests():
            self._change(engine, outbox, lambda c: c.drained(), None)
            for loop in outbox.flush():
                self._forget_loop(engine, loop)

    # -- commands ------------------------------------------------------------------

    def _apply(self, engine: EngineLike, command: Command, outbox: Outbox) -> None:
        match command:
            case Add():
                self._change(engine, outbox, lambda c: c.add(command), command)
            case Abort():
                for request_id in command.request_ids:
                    self._abort(engine, request_id, outbox, command.why)
                if command.reply is not None:
                    command.reply.ok(outbox)
            case Call():
                try:
                    result = command.fn(engine)
                except Exception as exc:
                    if is_engine_dead(exc):
                        raise
                    # A call into a core that died meanwhile fails with the watchdog's
                    # cause: report the death, as every other command gets.
                    command.reply.fail(outbox, self.registry.dead_error or exc)
                else:
                    command.reply.ok(outbox, result)
            case Hold():
                steps = self.counters.steps
                self._change(
                    engine,
                    outbox,
                    lambda c: c.hold(
                        command.token, command.at_step, steps, command.reply, command.caller_holds
                    ),
                    command,
                )
            case Release():
                self._change(engine, outbox, lambda c: (c.release(command.token), []), None)
            case Pause():
                busy = engine.has_unfinished_requests()
                emit(logging.INFO, "generation paused", mode=command.mode, step=self.counters.steps)
                self._change(
                    engine,
                    outbox,
                    lambda c: c.pause(
                        command.mode, command.clear_cache, command.reply, busy, command.caller_holds
                    ),
                    command,
                )
            case Resume():
                admitted = len(self.registry.control.parked)
                self._change(engine, outbox, lambda c: c.resume(command.reply), command)
                emit(
                    logging.INFO, "generation resumed", step=self.counters.steps, admitted=admitted
                )
            case _:
                assert_never(command)

    def _change(
        self,
        engine: EngineLike,
        outbox: Outbox,
        transition: Transition,
        command: Command | None,
    ) -> None:
        """Make a control transition and carry out its effects.

        Once ended (died or closed mid-pass), ``command`` gets the error instead.
        """
        effects = self.registry.change(transition)
        if isinstance(effects, BaseException):
            if command is not None:
                command.fail(outbox, effects)
            return
        for effect in effects:
            self._carry_out(engine, effect, outbox)

    def _carry_out(self, engine: EngineLike, effect: Effect[Add, Reply], outbox: Outbox) -> None:
        match effect:
            case Admit():
                self._admit(engine, effect.request, outbox)
            case AbortParked():
                # Admitted and aborted at once, so that it ends like any aborted request.
                self._admit(engine, effect.request, outbox)
                self._abort_route(engine, effect.request.request_id, outbox, "explicit")
            case AbortAll():
                for request_id in list(self.registry.routes):
                    self._abort_route(engine, request_id, outbox, effect.why)
            case Answer():
                effect.reply.ok(outbox, effect.value)
            case Fail():
                effect.reply.fail(outbox, effect.error)
            case ResetCache():
                engine.reset_prefix_cache(reset_running_requests=effect.running)
            case PauseCore():
                pause_core_scheduler(engine, effect.clear_cache)
            case ResumeCore():
                resume_core_scheduler(engine)
            case _:
                assert_never(effect)

    def _admit(self, engine: EngineLike, add: Add, outbox: Outbox) -> None:
        request_id = add.request_id
        if request_id in self.registry.routes:
            # vLLM can't tell two live requests with one id apart: aborting one
            # would abort both.
            duplicate = ValueError(f"request id {request_id!r} is already in flight")
            outbox.post(add.sink.loop, add.sink.fail, duplicate)
            return
        try:
            engine.add_request(request_id, add.prompt, add.params, **add.kwargs)
        except Exception as exc:
            if is_engine_dead(exc):
                raise
            # Bad input: this caller's problem only. add_request may have
            # registered the request before raising; left there, it would make
            # the worker step for a request that never runs.
            try:
                engine.abort_request([request_id])
            except Exception as cleanup:
                emit(logging.DEBUG, "abort after refusal failed", error=str(cleanup))
            outbox.post(add.sink.loop, add.sink.fail, exc)
            return
        if not self.registry.routes:
            self.counters.busy_since = time.perf_counter()
        error = self.registry.add_route(request_id, Route(add.sink, add.sink.loop))
        if error is not None:  # closed or dead meanwhile: the end can't see it
            outbox.post(add.sink.loop, add.sink.fail, error)
            return
        self.counters.loops.add(add.sink.loop)
        if enabled(logging.DEBUG):
            emit(logging.DEBUG, "request added", request_id=request_id, step=self.counters.steps)

    def _abort(self, engine: EngineLike, request_id: str, outbox: Outbox, why: str) -> None:
        if self.registry.control.parked:
            self._change(
                engine, outbox, lambda c: c.abort_parked(lambda a: a.request_id == request_id), None
            )
        self._abort_route(engine, request_id, outbox, why)

    def _abort_route(self, engine: EngineLike, request_id: str, outbox: Outbox, why: str) -> None:
        route = self.registry.pop_route(request_id)
        if route is None:
            return  # unknown or finished: a no-op
        outbox.post(route.loop, route.sink.aborting, why)
        for out in abort_outputs(engine, request_id):
            outbox.post(route.loop, route.sink.push, out)
            self.counters.outputs_delivered += 1
        # Runs after the pushes; a no-op if one of them was final.
        outbox.post(route.loop, route.sink.abort)
        engine.abort_request([request_id])
        self.counters.requests_aborted += 1
        self.counters.requests_finished += 1

    def _forget_loop(self, engine: EngineLike, loop: asyncio.AbstractEventLoop) -> None:
        # Nobody can read the outputs of a closed loop's streams: stop computing them.
        ids = self.registry.forget(loop)
        if ids:
            engine.abort_request(ids)
            self.counters.requests_aborted += len(ids)


def _freeze_heap() -> None:
    """Take everything alive now out of the garbage collector's full scans.

    Right after the engine is built, that is torch, vLLM and the engine's
    client side, which live as long as the process. vLLM's own server does
    the same (``vllm.utils.gc_utils.freeze_gc_heap``): without it, a full
    collection triggered by a burst of requests scans millions of objects
    while holding the GIL, and every thread waits (0.5 s on the H200 run).
    """
    gc.collect()
    gc.freeze()
