"""The worker thread: sole owner of the ``LLMEngine``, its lifecycle and restarts.

Everything in ``Worker._run`` and below runs on the worker thread, which is
the only thread that ever calls the engine; the public methods (``start``,
``close``, ``die``, ``snapshot``) may be called from any thread. ``_run``
builds the engine and serves it: ``_serve`` starts the watchdog, answers
``start()``, then runs the step loop (``_step_loop.py``: commands, step,
dispatch) until the engine is closed or dies. Admission, holds and pauses
are the pure state machine of ``_control.py``; what waits for an answer lives
in the ``Registry``, whose lock ``die`` and ``close`` take from other threads.

With a ``RestartPolicy`` a death doesn't end the streams: the worker keeps
the inbox open (commands wait there), rebuilds the engine, re-adds every
unfinished request as its continuation (``_resume.py``), and serves again;
the commands it was applying when the engine died are applied again first.
``_restart.py`` decides, at each death, whether the policy allows it.
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

from .._bridge._commands import Command, Outbox, Reply
from .._bridge._inbox import Inbox
from .._errors import EngineClosedError, EngineDeadError
from .._log import emit
from .._types import RestartPolicy
from .._vllm import (
    EngineLike,
    engine_processes,
    has_core_process,
    shutdown_core,
    watch_outputs,
)
from . import _watchdog
from ._apply import Applier
from ._counters import Counters, Snapshot
from ._placement import Placement
from ._recover import Recovery
from ._registry import Life, Registry
from ._resume import Decoded
from ._step_loop import StepLoop
from ._steps import StepHub

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from ._registry import Route


__all__ = ("Handoff", "Worker")

Handoff = Callable[[list[tuple[str, "Route"]], Decoded, BaseException], list[tuple[str, "Route"]]]
"""A pool's failover: (routes, detokenizers, cause) -> the routes it could not place."""


class Worker(StepLoop):
    """Owns one engine on a thread of its own; see the module docstring."""

    def __init__(
        self,
        build: Callable[[], EngineLike],
        freeze_gc: bool = False,
        restart: RestartPolicy | None = None,
        rebuild: Callable[[], EngineLike] | None = None,
        keep_off_model_cores: bool = True,
    ) -> None:
        self.inbox: Inbox[Command] = Inbox()
        self.registry = Registry(self.inbox)
        self.counters = Counters()
        """Written by the worker only; read by anyone (``snapshot``)."""
        self.steps = StepHub()
        """The readers of ``engine.steps()``: a record per step while there are any."""
        self._build = build
        self._freeze_gc = freeze_gc
        self.placement = Placement(keep_off_model_cores)
        """The worker thread's CPUs (``_placement.py``): changed by the worker only."""
        self._processes: list[BaseProcess] = []
        self._closing = threading.Event()  # wakes the watchdog on close
        self._thread = threading.Thread(target=self._run, name="asynckv-engine", daemon=True)
        self._started: Reply | None = None
        # Multiprocess mode: whether the core's next output is waiting (see StepLoop._wait).
        self._output_ready: Callable[[], bool] | None = None
        self._hook_fired = False
        self._applier = Applier(self.registry, self.counters)
        # -- restarts (only with a policy) --
        self._recovery = (
            None
            if restart is None
            else Recovery(restart, rebuild or build, self.registry, self.counters)
        )
        self._generation = 0  # which engine the watchdog's reports are about
        self._fault: BaseException | None = None
        """A death the watchdog saw (written there, read by the worker: one word)."""
        self._carry: deque[Command] = deque()  # commands to apply again on the new engine
        self._left = threading.Event()  # set once the worker leaves the current engine
        self.handoff: Handoff | None = None
        """Set by a pool: hands a dead engine's requests to a live member, returns the rest."""
        self.forwarded: dict[str, Inbox[Command]] = {}
        """Request id -> the inbox of the pool member that adopted it (aborts go there)."""
        self._applier.tracking = restart is not None
        self._applier.faulted = lambda: self._fault is not None

    # -- any thread ----------------------------------------------------------------

    def start(self, reply: Reply | None) -> None:
        """Start the thread; it builds the engine, then answers ``reply``."""
        self._started = reply
        self.registry.set_life(Life.STARTING)
        self._thread.start()

    @property
    def restart_cause(self) -> BaseException | None:
        """While a dead engine is being rebuilt, the death that began it; else None."""
        return None if self._recovery is None else self._recovery.cause

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
        self._left.set()
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

    def die(self, cause: BaseException, deaths: tuple[BaseException, ...] = ()) -> None:
        """Declare the engine dead: end everything in flight with ``EngineDeadError``.

        Idempotent, any thread. Ignored once closed: a close kills the processes.
        ``deaths``: every death's cause, when a restart policy is spent.
        """
        if self._end(Life.DEAD, EngineDeadError(cause, deaths)):
            emit(logging.ERROR, "engine dead", error=str(self.registry.error), exc_info=cause)

    def _core_died(self, generation: int, cause: BaseException) -> None:
        # The watchdog, with a restart policy: the worker restarts (it notices at
        # its next pass, or its blocked step() raises ``cause``).
        if generation == self._generation:
            self._fault = cause
            self.inbox.nudge()

    def _end(self, life: Life, error: BaseException) -> bool:
        ended = self.registry.end(life, error)
        if ended is None:
            return False
        outbox = Outbox()
        ended.fail(outbox)
        self.steps.end(error, outbox)
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
        first = True
        while True:
            decoded: Decoded = {}
            try:
                self._serve(engine, outbox, began, first)
                return
            except BaseException as exc:  # step() or the engine broke: the engine is dead
                cause = self._fault or exc
                recovery = self._recovery
                if recovery is None or self.registry.ended:
                    self.die(cause)
                    return
                if (deaths := recovery.died(cause)) is not None:
                    self.die(cause, deaths)
                    return
                decoded = recovery.decoded(engine)
                if self.handoff is not None and self.registry.routes:
                    kept = self.handoff(self.registry.take_routes(), decoded, cause)
                    self.registry.put_routes(kept)
            finally:
                self._left.set()
                shutdown_core(engine)
                # The next engine's processes are started from this thread: all CPUs.
                self.placement.release()
            self._generation += 1
            self._fault = None
            self._left = threading.Event()
            rebuilt = recovery.rebuilt(decoded)
            if isinstance(rebuilt, tuple):
                self.die(rebuilt[-1], rebuilt)
            if rebuilt is None or isinstance(rebuilt, tuple):
                return
            engine, first = rebuilt, False

    def _serve(self, engine: EngineLike, outbox: Outbox, began: float, first: bool = True) -> None:
        self._processes = engine_processes(engine)
        self.placement.attach(engine, self._processes)
        if first:
            self.registry.set_core(has_core_process(engine))
        self._hook_fired = False
        self._output_ready = watch_outputs(engine, self._output_arrived)
        if self._freeze_gc and first:
            _freeze_heap()
        generation = self._generation
        if self._recovery is None:
            on_death: Callable[[BaseException], None] = self.die
        else:
            on_death = lambda cause: self._core_died(generation, cause)  # noqa: E731
        _watchdog.start(self._processes, engine, on_death, self._left, self._thread)
        self.registry.set_life(Life.RUNNING)
        if not first:
            self._loop(engine)
            return
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
