"""The worker thread: sole owner of the ``LLMEngine``, its lifecycle and restarts.

Everything in ``Worker._main`` and below runs on the worker thread, which is
the only thread that ever calls the engine; the public methods (``start``,
``close``, ``die``, ``stats``, ``health``) may be called from any thread.
``_main`` builds the engine and serves it: ``_serve`` starts the watchdog, answers
``start()``, then runs the step loop (``_loop``: commands, step, dispatch)
until the engine is closed or dies. One built engine and what belongs to it
(its generation, the watchdog's fault, the commands to carry over, the
output hook) is an ``EngineRun`` (``_run.py``), replaced whole by a rebuild.
Admission, holds and pauses are the pure state machine of ``_control.py``;
what waits for an answer lives in the ``Registry``, whose lock ``die`` and
``close`` take from other threads.

A planned restart (a ``Restart`` command, ``engine.restart()``) takes the
same path without a death: the worker stops at that command between two
steps, reads each request's resume state, shuts the engine down, rebuilds it
(from the same arguments or new ones) and resumes the requests, applying the
commands queued after the ``Restart`` on the new engine. A pool's ``Vacate``
(a drain) is applied here too: the requests are taken out of the engine and
handed to the other members (``handoff``), as a dying member's are.

With a ``RestartPolicy`` a death doesn't end the streams: the worker keeps
the inbox open (commands wait there), rebuilds the engine, re-adds every
unfinished request as its continuation (``_resume.py``), and serves again;
the commands it was applying when the engine died are applied again first.
The lifecycle (``_life.py``, a pure machine kept in the ``Registry``)
decides, at each death, whether the policy allows it; ``Recovery``
(``_recover.py``) rebuilds.

The step loop: each pass takes the inbox's commands in FIFO order and
applies them, answers them, then steps once if requests are unfinished and
nothing stops the stepping; otherwise it sleeps on the inbox, so an idle
engine costs no CPU. It answers the loops only through an ``Outbox``.
A request's input is processed off this thread (the ``Add``'s ``prepared``,
built on vLLM's renderer pool): a pass that meets one not yet built while an
output waits reads that step first and comes back to it, in order, so the
worker never tokenizes while requests are waiting for their next token.

With vLLM's engine-core process, ``step()`` blocks until the core's next
output. The worker doesn't wait there: it sleeps on the inbox until a command
*or* that output arrives (vLLM's output thread nudges the inbox,
``EngineRun.output_arrived``), and steps once the output is there. That nudge
is a hook into vLLM's internals, so every such sleep is bounded: were the
hook to stop firing, the worker would only poll, and before the hook has
ever fired it steps anyway (blocking, as without the hook).

A death the watchdog reports, or an engine that raises mid-command, ends the
loop by raising; with a ``RestartPolicy`` the commands not yet applied are
kept in the run's ``carry``, to be applied first on the new engine.
Under load the worker thread keeps off the cores the model workers are bound
to (``_placement.py``); it gets every CPU back before a rebuild.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._bridge._channel import Add, Inbox, Outbox, Reply, Restart
from .._bridge._loops import Loop
from .._errors import EngineClosedError, EngineDeadError
from .._log import emit
from .._stats import EngineStats
from .._types import RestartPolicy
from .._vllm import EngineLike, has_core_process, shutdown_core
from . import _watchdog
from ._apply import Applier
from ._counters import Counters, Health
from ._handoff import Handoff, Order, Vacate
from ._life import GiveUp
from ._placement import Placement
from ._recover import ClosedMeanwhile, GaveUp, Rebuilt, Recovery, decode
from ._registry import Registry
from ._resume import Decoded
from ._run import EngineRun
from ._steps import StepHub

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

__all__ = ("Handoff", "Worker")

# Bounds on the sleep while the core computes (see the module docstring).
_POLL_SECONDS = 0.05  # once the output hook has fired: a silent hook only slows us
_FIRST_WAIT_SECONDS = 0.02  # before it ever fired: then step (and block) anyway


class Worker:
    """Owns one engine on a thread of its own; see the module docstring."""

    def __init__(
        self,
        build: Callable[[], EngineLike],
        freeze_gc: bool = False,
        restart: RestartPolicy | None = None,
        rebuild: Callable[[], EngineLike] | None = None,
        keep_off_model_cores: bool = True,
    ) -> None:
        self.inbox: Inbox[Order] = Inbox()
        self.registry = Registry(self.inbox)
        self.counters = Counters()
        """Written by the worker only; read by anyone (``stats``, ``health``)."""
        self.steps = StepHub()
        """The readers of ``engine.steps()``: a record per step while there are any."""
        self._build = build
        self._freeze_gc = freeze_gc
        self.placement = Placement(keep_off_model_cores)
        """The worker thread's CPUs (``_placement.py``): changed by the worker only."""
        self._closing = threading.Event()  # wakes the watchdog on close
        self._thread = threading.Thread(target=self._main, name="asynckv-engine", daemon=True)
        self._started: Reply | None = None
        self._run: EngineRun | None = None
        """The engine served now (None until built): replaced whole by a rebuild (worker)."""
        self._applier = Applier(
            self.registry, self.counters, tracking=restart is not None, faulted=self._faulted
        )
        self._recovery = (
            None
            if restart is None
            else Recovery(restart, rebuild or build, self.registry, self.counters)
        )
        self.handoff: Handoff | None = None
        """Set by a pool: hands a dead engine's requests to a live member, returns the rest."""
        self.forwarded: dict[str, Inbox[Order]] = {}
        """Request id -> the inbox of the pool member that adopted it (aborts go there)."""

    # -- any thread ----------------------------------------------------------------

    def start(self, reply: Reply | None) -> None:
        """Start the thread; it builds the engine, then answers ``reply``."""
        self._started = reply
        self.registry.start()
        self._thread.start()

    @property
    def restarting(self) -> bool:
        """Whether the engine is being rebuilt now, after a death or on request."""
        return self.registry.restarting

    @property
    def resumable(self) -> bool:
        """Whether requests keep their resume state (a ``RestartPolicy`` is set)."""
        return self._recovery is not None

    @property
    def draining(self) -> bool:
        """Whether a close is letting the admitted requests finish (new ones are refused)."""
        return self.registry.draining and not self.registry.ended

    @property
    def admission_paused(self) -> bool:
        """Whether ``pause_generation()`` is in force (admissions wait)."""
        return not self.registry.control.admitting

    @property
    def dead_error(self) -> BaseException | None:
        """The ``EngineDeadError`` if the engine died, even once closed after; else None."""
        return self.registry.dead_error

    @property
    def processes(self) -> list[BaseProcess]:
        """The engine processes of the engine served now (none before it is built)."""
        run = self._run
        return [] if run is None else run.processes

    @property
    def started(self) -> bool:
        """Whether ``start`` was called."""
        return self._thread.ident is not None

    def stats(self) -> EngineStats:
        """The counters and states now, read without a lock (fields may span two steps)."""
        registry, control = self.registry, self.registry.control
        return self.counters.stats(
            in_flight=len(registry.routes),
            waiting=len(control.parked),
            paused=not control.admitting or not control.stepping,
            commands_queued=len(self.inbox),
        )

    def health(self) -> Health:
        """What ``check_health`` reads, without a lock (fields may span two steps)."""
        registry, counters = self.registry, self.counters
        return Health(
            dead_error=registry.dead_error,
            restart_cause=registry.restart_cause,
            restarting=registry.restarting,
            in_step_since=counters.in_step_since,
            last_step_end=counters.last_step_end,
            busy_since=counters.busy_since,
            in_flight=len(registry.routes),
            held=not registry.control.stepping,
        )

    def close(self, timeout: float, drain: float = 0.0) -> None:
        """Stop the worker, end everything in flight with ``EngineClosedError``, join.

        Blocking; idempotent; any thread but the worker. With ``drain`` > 0 it
        first lets the admitted requests finish, for up to ``drain`` seconds:
        meanwhile every new request is refused (``EngineClosedError`` with
        ``draining``) and the worker steps on; a death ends the drain. Then it
        ends what is left and returns within about ``timeout`` seconds more,
        even if the worker is stuck inside ``step()``: then the engine
        processes are killed and the (daemon) thread is left behind.

        The engine core is told to stop with no grace of its own, as ``vllm
        serve`` does by default: its requests are done or ended by then, and
        vLLM kills its processes after their SIGTERM instead of waiting out
        their interpreters' teardown (``_vllm.shutdown_core``).
        """
        if drain > 0 and self.started:
            self._drain(drain)
        self._end(True, EngineClosedError())
        self._closing.set()
        run = self._run
        if run is not None:
            run.left.set()
        if self.started and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        for process in self.processes:  # a rebuild may have replaced the run meanwhile
            if process.is_alive():
                try:
                    process.kill()
                    process.join(5)
                except Exception as exc:  # already reaped elsewhere: nothing left to kill
                    emit(logging.DEBUG, "engine process kill failed", error=str(exc))
        emit(logging.INFO, "engine closed", steps=self.counters.steps)

    def _drain(self, seconds: float) -> None:
        """Refuse new requests and wait until none is in flight, the engine ends, or time is up.

        Polls (10 ms): it runs once per engine, on the closing thread, and the
        routes are read without the lock (one length).
        """
        registry = self.registry
        registry.draining = True
        self.inbox.nudge()  # an idle worker need not wake, but a parked Add should be refused
        deadline = time.monotonic() + seconds
        in_flight = len(registry.routes)
        if in_flight:
            emit(logging.INFO, "engine draining", in_flight=in_flight, seconds=seconds)
        while registry.routes and not registry.ended and time.monotonic() < deadline:
            time.sleep(0.01)
        if registry.routes:
            emit(logging.INFO, "engine drain cut short", in_flight=len(registry.routes))

    def die(self, cause: BaseException, deaths: tuple[BaseException, ...] = ()) -> None:
        """Declare the engine dead: end everything in flight with ``EngineDeadError``.

        Idempotent, any thread. Ignored once closed: a close kills the processes.
        ``deaths``: every death's cause, when a restart policy is spent.
        """
        if self._end(False, EngineDeadError(cause, deaths)):
            emit(logging.ERROR, "engine dead", error=str(self.registry.error), exc_info=cause)

    def _faulted(self) -> bool:
        # The Applier asks: did the watchdog see the engine die? (one word each)
        run = self._run
        return run is not None and run.fault is not None

    def _end(self, closing: bool, error: BaseException) -> bool:
        ended = self.registry.end(closing, error)
        if ended is None:
            return False
        outbox = Outbox()
        ended.fail(outbox)
        self.steps.end(error, outbox)
        outbox.flush()
        return True

    # -- the thread: builds, serves, restarts ------------------------------------------

    def _main(self) -> None:
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
        run = EngineRun(engine, 0, self.inbox.nudge)
        answer: Reply | None = None  # a planned restart's, answered once the new engine serves
        while True:
            planned: Restart | None = None
            decoded: Decoded | None = None
            refused = False  # a planned restart refused: serve on, same engine
            try:
                planned = self._serve(run, outbox, began, answer)
                if planned is None:
                    # Closed: what the loop had put off for a later pass (an Add whose
                    # input was still being built) ends with the close's error.
                    self._fail_carried(run, outbox, None)
                    return
                decoded = self._planned(run, planned, outbox)
                refused = decoded is None and not self.registry.ended
            except BaseException as exc:  # step() or the engine broke: the engine is dead
                cause = run.fault or exc
                decoded = self._died(run, cause)
            finally:
                if not refused:
                    run.left.set()
                    shutdown_core(run.engine, 0.0)
                    # The next engine's processes are started from this thread: all CPUs.
                    self.placement.release()
            if refused:
                answer = None
                continue
            answer = None if planned is None else planned.reply
            if decoded is None:
                self._fail_carried(run, outbox, answer)
                return
            assert self._recovery is not None  # no decoded without one
            match self._recovery.rebuilt(decoded):
                case Rebuilt(rebuilt):
                    run = EngineRun(rebuilt, run.generation + 1, self.inbox.nudge, run.carry)
                case GaveUp(causes):
                    self.die(causes[-1], causes)
                    self._fail_carried(run, outbox, answer)
                    return
                case ClosedMeanwhile():
                    self._fail_carried(run, outbox, answer)
                    return

    def _fail_carried(self, run: EngineRun, outbox: Outbox, answer: Reply | None) -> None:
        # No engine will apply them: the commands kept for a new engine or a later pass fail now.
        error = self.registry.error or EngineDeadError(RuntimeError("ended"))
        if answer is not None:
            answer.fail(outbox, error)
        while run.carry:
            run.carry.popleft().fail(outbox, error)
        outbox.flush()

    def _planned(self, run: EngineRun, restart: Restart, outbox: Outbox) -> Decoded | None:
        """A planned restart: say what the engine decoded to rebuild (before its shutdown).

        None if the lifecycle refuses it (the engine is not running): then
        ``restart``'s caller gets the error and the engine serves on.
        """
        recovery = self._recovery
        if recovery is None or not recovery.planned(restart.build):
            error = self.registry.error or RuntimeError(
                "the engine can't be restarted: it has no RestartPolicy"
            )
            restart.reply.fail(outbox, error)
            outbox.flush()
            return None
        return recovery.decoded(run.engine)

    def _died(self, run: EngineRun, cause: BaseException) -> Decoded | None:
        """The engine died: die, or say what it decoded to rebuild (before its shutdown).

        With a pool, the requests go to a live member first (``handoff``).
        """
        recovery = self._recovery
        if recovery is None:
            self.die(cause)
            return None
        action = recovery.died(cause)
        if isinstance(action, GiveUp):
            self.die(cause, action.deaths.causes)
            return None
        decoded = recovery.decoded(run.engine)
        if self.handoff is not None and self.registry.routes:
            kept = self.handoff(self.registry.take_routes(), decoded, cause)
            self.registry.put_routes(kept)
        return decoded

    def _serve(
        self, run: EngineRun, outbox: Outbox, began: float, answer: Reply | None
    ) -> Restart | None:
        """Serve ``run``'s engine until closed (None) or a planned restart (its command).

        ``answer``: a planned restart's reply, answered once this engine is served.
        """
        engine, first = run.engine, run.generation == 0
        if self._run is run:  # a refused restart: serve on
            return self._loop(run)
        self._run = run
        if self._closing.is_set():  # closed before this run was seen: stop its watchdog
            run.left.set()
        self.placement.attach(engine, run.processes)
        if first:
            self.registry.set_core(has_core_process(engine))
            if self._freeze_gc:
                _freeze_heap()
        on_death = self.die if self._recovery is None else run.died
        _watchdog.start(run.processes, engine, on_death, run.left, self._thread)
        self.registry.running()
        if first:
            emit(
                logging.INFO,
                "engine started",
                model=getattr(getattr(engine, "model_config", None), "model", None),
                mode="multiprocess" if run.processes else "in-process",
                seconds=round(time.monotonic() - began, 3),
            )
            if self._started is not None:
                self._started.ok(outbox)
            outbox.flush()
        if answer is not None:
            answer.ok(outbox)
            outbox.flush()
        return self._loop(run)

    # -- the step loop ---------------------------------------------------------------

    def _loop(self, run: EngineRun) -> Restart | None:
        engine, inbox = run.engine, self.inbox
        while not inbox.closed:
            commands, step_anyway = self._wait(run)
            if run.fault is not None:
                run.carry.extend(commands)
                raise run.fault
            outbox = Outbox()
            while commands:
                if run.fault is not None:
                    # The core died mid-batch (the watchdog): the rest waits for the new one.
                    run.carry.extend(commands)
                    outbox.flush()
                    raise run.fault
                if self.registry.ended:
                    # Died mid-batch (the watchdog): the rest must not reach the dead core.
                    error = self.registry.error or EngineDeadError(RuntimeError("ended"))
                    for command in commands:
                        command.fail(outbox, error)
                    break
                if self._step_first(engine, run, commands[0]):
                    # Its input is still being processed off this thread: read the
                    # step that waits meanwhile, and come back to it (and, in
                    # order, to what came after it) on the next pass.
                    run.carry.extend(commands)
                    break
                command = commands.popleft()
                try:
                    match command:
                        case Restart():
                            # What came after it is applied on the new engine.
                            run.carry.extend(commands)
                            self._flush(engine, outbox)
                            return command
                        case Vacate():
                            self._vacate(engine, command, outbox)
                        case _:
                            self._applier.apply(engine, command, outbox)
                except BaseException as exc:
                    if self._recovery is not None and not self.registry.ended:
                        # Restarting: the command is applied again on the new engine.
                        run.carry.extend((command, *commands))
                        outbox.flush()
                        raise
                    # The engine broke mid-command: die() can't see this batch.
                    self.die(exc)
                    error = self.registry.error or exc
                    for failed in (command, *commands):
                        failed.fail(outbox, error)
                    outbox.flush()
                    raise
            # Before the answers go out: an abort or close may have ended the load.
            self.placement.follow(len(self.registry.routes))
            if outbox:
                # Answer the commands before stepping: a step can take long, or
                # (a request vLLM took but its core dropped) never return.
                self._flush(engine, outbox)
            stepping = not inbox.closed and self._may_step(engine)
            if stepping and (step_anyway or run.output_waiting()):
                self._step(engine, outbox)
            elif not inbox.closed and self._stats_waiting(run):
                # Nothing unfinished, yet the core sent an output: the scheduler
                # stats of the step after the last abort or finish. vLLM's gauges
                # (requests running, KV cache usage) are recorded as a step reads
                # them; read now, they drop at once, as on AsyncLLM, not at the
                # next request's first step.
                self._step(engine, outbox)
            self._flush(engine, outbox)
        return None

    def _step_first(self, engine: EngineLike, run: EngineRun, head: Order) -> bool:
        """Whether to step before ``head``: a request whose input isn't built yet, and an
        output waiting to be read meanwhile."""
        return (
            isinstance(head, Add)
            and not head.ready()
            and self._may_step(engine)
            and run.output_waiting()
        )

    def _vacate(self, engine: EngineLike, vacate: Vacate, outbox: Outbox) -> None:
        """A pool drains this member: hand its requests over, then answer once it is empty.

        Between two steps: each request's resume state is read from the
        engine, the pool's ``handoff`` places it on another member (an
        ``Adopt`` there), and only what was placed is aborted here; what no
        member took stays and finishes here, as everything does without
        ``handoff``.
        """
        moved: list[str] = []
        if vacate.handoff and self.handoff is not None and self.registry.routes:
            taken = self.registry.take_routes()
            decoded = decode(engine, taken)
            kept = self.handoff(taken, decoded, None)
            self.registry.put_routes(kept)
            stays = {request_id for request_id, _ in kept}
            engine_ids: list[str] = []
            for request_id, route in taken:
                if request_id not in stays:
                    moved.append(request_id)
                    engine_ids += route.engine_ids(request_id)
            if engine_ids:
                engine.abort_request(engine_ids)
            emit(logging.INFO, "requests handed over", moved=len(moved), stayed=len(kept))
        stayed = list(self.registry.routes)
        self.registry.idle.append((vacate.reply, (tuple(moved), tuple(stayed))))

    def _wait(self, run: EngineRun) -> tuple[deque[Order], bool]:
        """Take the next commands, sleeping as long as nothing else is due.

        Returns them, and whether to step even if no output is known to wait.
        """
        if run.carry:
            carried, run.carry = run.carry, deque()
            carried.extend(self.inbox.take(block=False))
            return carried, False
        if not self._may_step(run.engine):
            # Woken by a command, or by the output hook's nudge (a stats-only output).
            return self.inbox.take(block=not self._stats_waiting(run)), False
        if run.output_waiting():
            return self.inbox.take(block=False), False
        if run.hook_fired:
            return self.inbox.take(block=True, timeout=_POLL_SECONDS), False
        began = time.monotonic()
        commands = self.inbox.take(block=True, timeout=_FIRST_WAIT_SECONDS)
        waited = time.monotonic() - began >= _FIRST_WAIT_SECONDS
        return commands, waited and not run.hook_fired

    def _may_step(self, engine: EngineLike) -> bool:
        return self.registry.control.stepping and engine.has_unfinished_requests()

    def _stats_waiting(self, run: EngineRun) -> bool:
        """Whether an output waits that only a step with nothing unfinished would read.

        Only where the output hook can tell (multiprocess mode): in-process, a
        step with nothing unfinished would compute an empty step, and blind
        stepping would spin.
        """
        return self.registry.control.stepping and run.output_known_waiting()

    def _step(self, engine: EngineLike, outbox: Outbox) -> None:
        counters = self.counters
        feeds = self.steps.feeds  # nobody listening: no telemetry at all
        if feeds:
            self.steps.before(engine)
        began = counters.in_step_since = time.perf_counter()
        outputs = engine.step()
        counters.in_step_since = None
        counters.count_step(began)
        if feeds:
            self.steps.after(counters.steps, outputs, outbox)
        delivered, finished = self.registry.dispatch(outputs, outbox)
        counters.outputs_delivered += delivered
        counters.requests_finished += finished
        self.placement.follow(len(self.registry.routes))
        if self.registry.stopped:
            # A resumed completion ended by a stop string across its join.
            stopped, self.registry.stopped = self.registry.stopped, []
            engine.abort_request(stopped)
        if self.registry.control.pending:
            steps = counters.steps
            self._applier.change(engine, outbox, lambda c: c.stepped(steps), None)

    def _flush(self, engine: EngineLike, outbox: Outbox) -> None:
        """Send the loops their answers, then settle what the pass changed.

        A closed loop's requests are aborted here; and whatever ended the last
        request in flight (a step, an abort, a closed loop) ends a "wait" pause
        now, not at a step that may never come.
        """
        self._answer_idle(outbox)
        forgot = False
        for loop in outbox.flush():
            self._forget(engine, loop)
            forgot = True
        if forgot and self._answer_idle(outbox):  # a closed loop's requests were the last
            outbox.flush()
        if self.registry.control.drains and not engine.has_unfinished_requests():
            self._applier.change(engine, outbox, lambda c: c.drained(), None)
            for loop in outbox.flush():
                self._forget(engine, loop)

    def _answer_idle(self, outbox: Outbox) -> bool:
        """Answer the drains waiting for nothing in flight, if nothing is; whether it did."""
        registry = self.registry
        if not registry.idle or registry.in_flight:
            return False
        waiting, registry.idle = registry.idle, []
        for reply, value in waiting:
            reply.ok(outbox, value)
        return True

    def _forget(self, engine: EngineLike, loop: Loop) -> None:
        self._applier.forget_loop(engine, loop)
        self.steps.forget(loop)


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
