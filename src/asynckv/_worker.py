"""The worker thread: sole owner of the ``LLMEngine``.

Everything in ``Worker._run`` and below runs on the worker thread, which is
the only thread that ever calls the engine. It applies the inbox's commands
in FIFO order between two steps, steps only while requests are unfinished and
nothing holds it, and otherwise sleeps on the inbox, so an idle engine costs
no CPU. It answers the loops only through an ``Outbox``.

With vLLM's engine-core process, ``step()`` blocks until the core's next
output. The worker doesn't wait there: it sleeps on the inbox until a command
*or* that output arrives (vLLM's output thread nudges the inbox), and steps
only once the output is there. So requests submitted during a step reach the
engine core at once, not after the step: a burst of ``generate()`` calls
doesn't trickle in one step at a time.

Two things run elsewhere, under ``Worker._lock``, and touch no engine method:
``die`` (called by the worker, or by the watchdog thread when an engine
process dies) and ``close`` (called by the thread that closes the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection
from typing import TYPE_CHECKING, Any, TypeVar

from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

from ._commands import (
    Abort,
    Add,
    Call,
    Command,
    Hold,
    Outbox,
    Pause,
    Release,
    Reply,
    Resume,
    fail_all,
)
from ._errors import EngineClosedError, EngineDeadError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from vllm import LLMEngine

    from ._stream import _Sink

from ._inbox import Inbox
from ._log import emit, enabled
from ._vllm import (
    abort_outputs,
    engine_processes,
    exit_status,
    fail_utility_calls,
    pause_core_scheduler,
    resume_core_scheduler,
    unblock_step,
    watch_outputs,
)

__all__ = ("Worker",)

T = TypeVar("T")
# What still waits for an answer: the loop to answer on and how to fail it there.
_Waiting = list[tuple["asyncio.AbstractEventLoop", Callable[[BaseException], None]]]


@dataclass(eq=False, slots=True)
class _Route:
    sink: _Sink
    loop: asyncio.AbstractEventLoop


class Worker:
    """Owns one ``LLMEngine`` on a thread of its own; see the module docstring."""

    def __init__(self, build: Callable[[], LLMEngine], freeze_gc: bool = False) -> None:
        self.inbox: Inbox[Command] = Inbox()
        self.step_count = 0
        """Completed steps; written by the worker only, read by anyone."""
        self.admission_paused = False
        """Whether ``Pause`` is in force; written by the worker only."""
        self.dead_error: EngineDeadError | None = None
        # Counters for stats(): written by the worker only.
        self.outputs_delivered = 0
        self.requests_finished = 0
        self.requests_aborted = 0
        self.last_step_seconds = 0.0
        self.step_seconds_avg = 0.0
        self.last_step_end: float | None = None
        self.busy_since = 0.0  # when the worker last went from no request to some
        self.in_step_since: float | None = None  # when the step() now running began
        self.loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
        self._build = build
        self._freeze_gc = freeze_gc
        self._engine: LLMEngine | None = None
        self._processes: list[BaseProcess] = []
        self._closing = threading.Event()
        # Guards what die() and close() take from another thread: the routes and
        # every command that waits on the worker for its answer.
        self._lock = threading.Lock()
        self._routes: dict[str, _Route] = {}
        self._parked: list[Add] = []
        self._holds: set[object] = set()
        self._pending_holds: list[Hold] = []
        self._drain_waiters: list[tuple[Reply, bool]] = []
        self._keep = False
        self._core_paused = False  # the engine core's own scheduler is paused ("keep")
        self._thread = threading.Thread(target=self._run, name="asynckv-engine", daemon=True)
        self._started: Reply | None = None
        # Multiprocess mode: whether the core's next output is waiting (see _loop).
        self._output_ready: Callable[[], bool] | None = None

    # -- lifecycle, called from the loop side -------------------------------------

    def start(self, reply: Reply | None) -> None:
        """Start the thread; it builds the engine, then answers ``reply``."""
        self._started = reply
        self._thread.start()

    @property
    def held(self) -> bool:
        """Whether a ``paused()`` block or a "keep" pause stops the stepping."""
        return bool(self._holds) or self._keep

    @property
    def waiting(self) -> int:
        """Requests parked by ``Pause``, not yet admitted."""
        return len(self._parked)

    @property
    def in_flight(self) -> int:
        """Requests admitted and unfinished."""
        return len(self._routes)

    @property
    def started(self) -> bool:
        """Whether ``start`` was called."""
        return self._thread.ident is not None

    def close(self, timeout: float) -> None:
        """Stop the worker, end everything in flight with ``EngineClosedError``, join.

        Blocking; idempotent; any thread but the worker. Returns within about
        ``timeout`` seconds even if the worker is stuck inside ``step()``: then the
        engine processes are killed and the (daemon) thread is left behind.
        """
        error = EngineClosedError()
        with self._lock:
            self._closing.set()
            leftovers = list(self.inbox.close(error))
            waiting = self._take_waiting()
        fail_all(leftovers, error)
        _fail_waiting(waiting, error)
        if self.started and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for process in self._processes:
            if process.is_alive():
                with contextlib.suppress(Exception):
                    process.kill()
                    process.join(5)
        emit(logging.INFO, "engine closed", steps=self.step_count)

    def die(self, cause: BaseException) -> None:
        """Declare the engine dead: end everything in flight with ``EngineDeadError``.

        Idempotent, any thread. Ignored once closing: a close kills the processes.
        """
        with self._lock:
            if self.dead_error is not None or self._closing.is_set():
                return
            error = self.dead_error = EngineDeadError(cause)
            leftovers = list(self.inbox.close(error))
            waiting = self._take_waiting()
        emit(logging.ERROR, "engine dead", error=str(error), exc_info=cause)
        fail_all(leftovers, error)
        _fail_waiting(waiting, error)

    def _take_waiting(self) -> _Waiting:
        # Called with the lock held: everything that still waits for an answer.
        waiting: _Waiting = [(r.loop, r.sink.fail) for r in self._routes.values()]
        waiting += [(a.sink.loop, a.sink.fail) for a in self._parked]
        waiting += [(h.reply.loop, _fail_future(h.reply)) for h in self._pending_holds]
        waiting += [(r.loop, _fail_future(r)) for r, _ in self._drain_waiters]
        self._routes, self._parked = {}, []
        self._pending_holds, self._drain_waiters = [], []
        return waiting

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        outbox = Outbox()
        began = time.monotonic()
        emit(logging.INFO, "engine starting")
        try:
            engine = self._engine = self._build()
        except BaseException as exc:
            if self._started is not None:
                self._started.fail(outbox, exc)
            self.die(exc)
            outbox.flush()
            return
        self._processes = engine_processes(engine)
        self._output_ready = watch_outputs(engine, self.inbox.nudge)
        if self._freeze_gc:
            _freeze_heap()
        if self._processes:
            threading.Thread(target=self._watch, name="asynckv-watchdog", daemon=True).start()
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
        try:
            self._loop(engine)
        except BaseException as exc:  # step() or the engine broke: the engine is dead
            self.die(exc)
        finally:
            with contextlib.suppress(BaseException):
                engine.engine_core.shutdown()
            self._engine = None

    def _loop(self, engine: LLMEngine) -> None:
        inbox = self.inbox
        while not inbox.closed:
            commands = inbox.take(block=not self._step_ready(engine))
            outbox = Outbox()
            while commands:
                if self.dead_error is not None:
                    # Died mid-batch (the watchdog): the rest must not reach the dead core.
                    fail_all(list(commands), self.dead_error)
                    break
                command = commands.popleft()
                try:
                    self._apply(engine, command, outbox)
                except BaseException as exc:
                    # The engine broke mid-command: die() can't see this batch.
                    self.die(exc)
                    fail_all([command, *commands], self.dead_error or exc)
                    outbox.flush()
                    raise
            if outbox:
                # Answer the commands before stepping: a step can take long, or
                # (a request vLLM took but its core dropped) never return.
                self._flush(engine, outbox)
            if self._step_ready(engine) and not inbox.closed:
                began = self.in_step_since = time.perf_counter()
                outputs = engine.step()
                self.in_step_since = None
                self._count_step(began)
                self._dispatch(outputs, outbox)
                self._after_step(engine, outbox)
            self._flush(engine, outbox)

    def _flush(self, engine: LLMEngine, outbox: Outbox) -> None:
        """Send the loops their answers, then settle what the pass changed.

        A closed loop's requests are aborted here; and whatever ended the last
        request in flight (a step, an abort, a closed loop) ends a "wait" pause
        now, not at a step that may never come.
        """
        for loop in outbox.flush():
            self._forget_loop(engine, loop)
        if self._drain_waiters and not engine.has_unfinished_requests():
            self._finish_drain(engine, outbox)
            for loop in outbox.flush():
                self._forget_loop(engine, loop)

    def _count_step(self, began: float) -> None:
        now = time.perf_counter()
        took = self.last_step_seconds = now - began
        # Interval between step ends, so the rate includes the worker's own overhead.
        interval = took if self.last_step_end is None else now - self.last_step_end
        avg = self.step_seconds_avg
        self.step_seconds_avg = interval if avg == 0.0 else 0.9 * avg + 0.1 * interval
        self.last_step_end = now
        self.step_count += 1

    def _may_step(self, engine: LLMEngine) -> bool:
        return not self._holds and not self._keep and engine.has_unfinished_requests()

    def _step_ready(self, engine: LLMEngine) -> bool:
        """Whether to step now: allowed to, and (multiprocess) the core's output is in."""
        if not self._may_step(engine):
            return False
        ready = self._output_ready
        return ready is None or ready()

    def _dispatch(self, outputs: list[Any], outbox: Outbox) -> None:
        routes = self._routes
        delivered = finished = 0
        with self._lock:
            for out in outputs:
                route = routes.get(out.request_id)
                if route is None:
                    continue  # aborted since, or not ours
                outbox.post(route.loop, route.sink.push, out)
                delivered += 1
                if out.finished:
                    del routes[out.request_id]
                    finished += 1
        self.outputs_delivered += delivered
        self.requests_finished += finished

    def _after_step(self, engine: LLMEngine, outbox: Outbox) -> None:
        if self._pending_holds:
            with self._lock:
                due = [h for h in self._pending_holds if h.at_step == self.step_count]
                self._pending_holds = [h for h in self._pending_holds if h not in due]
            for hold in due:
                self._holds.add(hold.token)
                hold.reply.ok(outbox, self.step_count)

    # -- commands ------------------------------------------------------------------

    def _apply(self, engine: LLMEngine, command: Command, outbox: Outbox) -> None:
        if isinstance(command, Add):
            if self.admission_paused:
                self._enlist(self._parked, command, command.sink.loop, command.sink.fail, outbox)
            else:
                self._admit(engine, command, outbox)
        elif isinstance(command, Abort):
            for request_id in command.request_ids:
                self._abort(engine, request_id, outbox, command.why)
            if command.reply is not None:
                command.reply.ok(outbox)
        elif isinstance(command, Call):
            try:
                result = command.fn(engine)
            except VllmEngineDeadError:
                raise
            except Exception as exc:
                # A call into a core that died meanwhile fails with the watchdog's
                # cause: report the death, as every other command gets.
                command.reply.fail(outbox, self.dead_error or exc)
            else:
                command.reply.ok(outbox, result)
        elif isinstance(command, Hold):
            self._hold(command, outbox)
        elif isinstance(command, Release):
            if command.token in self._holds:
                self._holds.discard(command.token)
                emit(logging.DEBUG, "engine released", step=self.step_count)
            with self._lock:
                self._pending_holds = [
                    h for h in self._pending_holds if h.token is not command.token
                ]
        elif isinstance(command, Pause):
            self._pause(engine, command, outbox)
        elif isinstance(command, Resume):
            self._resume(engine, outbox)
            command.reply.ok(outbox)

    def _enlist(
        self,
        items: list[T],
        item: T,
        loop: asyncio.AbstractEventLoop,
        fail: Callable[[BaseException], None],
        outbox: Outbox,
    ) -> None:
        # die() and close() may run in the middle of a pass: what they can't see
        # any more must be answered here.
        with self._lock:
            if (error := self.inbox.error) is None:
                items.append(item)
        if error is not None:
            outbox.post(loop, fail, error)

    def _admit(self, engine: LLMEngine, command: Add, outbox: Outbox) -> None:
        request_id = command.request_id
        if request_id in self._routes:
            # vLLM can't tell two live requests with one id apart: aborting one
            # would abort both.
            duplicate = ValueError(f"request id {request_id!r} is already in flight")
            outbox.post(command.sink.loop, command.sink.fail, duplicate)
            return
        try:
            engine.add_request(request_id, command.prompt, command.params, **command.kwargs)
        except VllmEngineDeadError:
            raise
        except Exception as exc:  # bad input: this caller's problem only
            # add_request may have registered the request before raising; left
            # there, it would make the worker step for a request that never runs.
            with contextlib.suppress(Exception):
                engine.abort_request([request_id])
            outbox.post(command.sink.loop, command.sink.fail, exc)
            return
        with self._lock:
            if (error := self.inbox.error) is None:
                if not self._routes:
                    self.busy_since = time.perf_counter()
                self._routes[request_id] = _Route(command.sink, command.sink.loop)
                self.loops.add(command.sink.loop)
        if error is None and enabled(logging.DEBUG):
            emit(logging.DEBUG, "request added", request_id=request_id, step=self.step_count)
        if error is not None:  # closed or dead meanwhile: die()/close() can't see it
            outbox.post(command.sink.loop, command.sink.fail, error)

    def _abort(self, engine: LLMEngine, request_id: str, outbox: Outbox, why: str) -> None:
        parked = next((a for a in self._parked if a.request_id == request_id), None)
        if parked is not None:
            # Admitted and aborted at once, so that it ends like any aborted request.
            with self._lock:
                self._parked.remove(parked)
            self._admit(engine, parked, outbox)
        with self._lock:
            route = self._routes.pop(request_id, None)
        if route is None:
            return  # unknown or finished: a no-op
        outbox.post(route.loop, route.sink.aborting, why)
        for out in abort_outputs(engine, request_id):
            outbox.post(route.loop, route.sink.push, out)
            self.outputs_delivered += 1
        # Runs after the pushes; a no-op if one of them was final.
        outbox.post(route.loop, route.sink.abort)
        engine.abort_request([request_id])
        self.requests_aborted += 1
        self.requests_finished += 1

    def _hold(self, hold: Hold, outbox: Outbox) -> None:
        if hold.at_step is None or hold.at_step == self.step_count:
            self._holds.add(hold.token)
            hold.reply.ok(outbox, self.step_count)
            emit(logging.DEBUG, "engine held", step=self.step_count)
        elif hold.at_step < self.step_count:
            error = ValueError(f"step {hold.at_step} has passed: {self.step_count} steps are done")
            hold.reply.fail(outbox, error)
        else:
            self._enlist(
                self._pending_holds,
                hold,
                hold.reply.loop,
                _fail_future(hold.reply),
                outbox,
            )

    def _pause(self, engine: LLMEngine, pause: Pause, outbox: Outbox) -> None:
        emit(logging.INFO, "generation paused", mode=pause.mode, step=self.step_count)
        self.admission_paused = True
        if pause.mode == "abort":
            for request_id in list(self._routes):
                self._abort(engine, request_id, outbox, "paused")
        elif pause.mode == "keep":
            self._keep = True
            # Multiprocess: the engine core steps on its own, ahead of step();
            # not calling step() would not freeze it, so pause its scheduler.
            if pause_core_scheduler(engine, pause.clear_cache):
                self._core_paused = True
            elif pause.clear_cache:
                engine.reset_prefix_cache(reset_running_requests=True)
            pause.reply.ok(outbox)
            return
        waiter = (pause.reply, pause.clear_cache)
        self._enlist(
            self._drain_waiters,
            waiter,
            pause.reply.loop,
            _fail_future(pause.reply),
            outbox,
        )
        if not engine.has_unfinished_requests():
            self._finish_drain(engine, outbox)

    def _finish_drain(self, engine: LLMEngine, outbox: Outbox) -> None:
        if any(clear for _, clear in self._drain_waiters):
            engine.reset_prefix_cache()  # before taking them: die() answers them if it raises
        with self._lock:
            waiters, self._drain_waiters = self._drain_waiters, []
        for reply, _ in waiters:
            reply.ok(outbox)

    def _resume(self, engine: LLMEngine, outbox: Outbox) -> None:
        if self._core_paused:
            resume_core_scheduler(engine)
            self._core_paused = False
        self.admission_paused = False
        self._keep = False
        with self._lock:
            parked, self._parked = self._parked, []
            waiters, self._drain_waiters = self._drain_waiters, []
        for reply, _ in waiters:
            reply.ok(outbox)
        emit(logging.INFO, "generation resumed", step=self.step_count, admitted=len(parked))
        for add in parked:
            self._admit(engine, add, outbox)

    def _forget_loop(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop) -> None:
        # Nobody can read the outputs of a closed loop's streams: stop computing them.
        with self._lock:
            ids = [rid for rid, route in self._routes.items() if route.loop is loop]
            for rid in ids:
                del self._routes[rid]
            self._parked = [a for a in self._parked if a.sink.loop is not loop]
        if ids:
            engine.abort_request(ids)
            self.requests_aborted += len(ids)

    # -- the watchdog thread -------------------------------------------------------

    def _watch(self) -> None:
        """Turn the death of an engine process into ``die`` (runs on its own thread).

        In multiprocess mode vLLM 0.32's ``step()`` can block forever once the
        engine-core process is gone, so the worker can't be the one to notice.
        """
        by_sentinel = {p.sentinel: p for p in self._processes}
        while not self._closing.is_set():
            ready = connection.wait(list(by_sentinel), timeout=1.0)
            if not ready or self._closing.is_set():
                continue
            process = by_sentinel[ready[0]]  # type: ignore[index]
            process.join(1.0)  # the sentinel fires before the exit code is reaped
            # vLLM's own shutdown may be reaping it on another thread at this moment:
            # then the code appears on the shared process object a moment later.
            for _ in range(20):
                if process.exitcode is not None or self._closing.wait(0.05):
                    break
            status = exit_status(process.exitcode)
            cause = ChildProcessError(f"engine process {process.name} (pid {process.pid}) {status}")
            self.die(cause)
            engine = self._engine
            if engine is not None:
                unblock_step(engine, cause)
            # A command the worker was already applying may still call into the
            # dead core after that: keep failing such calls until the worker stops.
            while engine is not None and not self._closing.is_set():
                self._thread.join(0.1)
                if not self._thread.is_alive():
                    break
                fail_utility_calls(engine, cause)
            return


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


def _fail_future(reply: Reply) -> Callable[[BaseException], None]:
    def fail(error: BaseException) -> None:
        if not reply.future.done():
            reply.future.set_exception(error)

    return fail


def _fail_waiting(waiting: _Waiting, error: BaseException) -> None:
    outbox = Outbox()
    for loop, fail in waiting:
        outbox.post(loop, fail, error)
    outbox.flush()
