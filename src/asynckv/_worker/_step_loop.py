"""The worker's step loop: take the commands, apply and answer them, step once.

Runs on the worker thread only (``Worker._serve`` calls ``_loop``), except
``_output_arrived``, which vLLM's output thread calls. Each pass takes the
inbox's commands in FIFO order and applies them, answers them, then steps
once if requests are unfinished and nothing stops the stepping; otherwise it
sleeps on the inbox, so an idle engine costs no CPU. It answers the loops
only through an ``Outbox``.

With vLLM's engine-core process, ``step()`` blocks until the core's next
output. The worker doesn't wait there: it sleeps on the inbox until a command
*or* that output arrives (vLLM's output thread nudges the inbox), and steps
once the output is there. That nudge is a hook into vLLM's internals, so
every such sleep is bounded: were the hook to stop firing, the worker would
only poll, and before the hook has ever fired it steps anyway (blocking, as
without the hook).

A death the watchdog reports, or an engine that raises mid-command, ends the
loop by raising; with a ``RestartPolicy`` the commands not yet applied are
kept in ``_carry``, to be applied first on the new engine (``_worker.py``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._bridge._commands import Command, Outbox
from .._errors import EngineDeadError

if TYPE_CHECKING:
    from .._bridge._inbox import Inbox
    from .._bridge._loops import Loop
    from .._vllm import EngineLike
    from ._apply import Applier
    from ._counters import Counters
    from ._placement import Placement
    from ._recover import Recovery
    from ._registry import Registry
    from ._steps import StepHub

__all__ = ("StepLoop",)

# Bounds on the sleep while the core computes (see the module docstring).
_POLL_SECONDS = 0.05  # once the output hook has fired: a silent hook only slows us
_FIRST_WAIT_SECONDS = 0.02  # before it ever fired: then step (and block) anyway


class StepLoop:
    """The step loop of ``Worker``; see the module docstring and ``Worker``."""

    if TYPE_CHECKING:
        # Set by Worker.__init__; see there for which thread writes each.
        inbox: Inbox[Command]
        registry: Registry
        counters: Counters
        steps: StepHub
        _applier: Applier
        _recovery: Recovery | None
        _fault: BaseException | None
        _carry: deque[Command]
        _output_ready: Callable[[], bool] | None
        _hook_fired: bool
        placement: Placement

        def die(self, cause: BaseException, deaths: tuple[BaseException, ...] = ()) -> None: ...

    def _output_arrived(self) -> None:
        # On vLLM's output thread: a plain store and the inbox's own lock.
        self._hook_fired = True
        self.inbox.nudge()

    def _loop(self, engine: EngineLike) -> None:
        inbox = self.inbox
        while not inbox.closed:
            commands, step_anyway = self._wait(engine)
            if self._fault is not None:
                self._carry.extend(commands)
                raise self._fault
            outbox = Outbox()
            while commands:
                if self._fault is not None:
                    # The core died mid-batch (the watchdog): the rest waits for the new one.
                    self._carry.extend(commands)
                    outbox.flush()
                    raise self._fault
                if self.registry.ended:
                    # Died mid-batch (the watchdog): the rest must not reach the dead core.
                    error = self.registry.error or EngineDeadError(RuntimeError("ended"))
                    for command in commands:
                        command.fail(outbox, error)
                    break
                command = commands.popleft()
                try:
                    self._applier.apply(engine, command, outbox)
                except BaseException as exc:
                    if self._recovery is not None and not self.registry.ended:
                        # Restarting: the command is applied again on the new engine.
                        self._carry.extend((command, *commands))
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
            if stepping and (step_anyway or self._output_waiting()):
                self._step(engine, outbox)
            self._flush(engine, outbox)

    def _wait(self, engine: EngineLike) -> tuple[deque[Command], bool]:
        """Take the next commands, sleeping as long as nothing else is due.

        Returns them, and whether to step even if no output is known to wait.
        """
        if self._carry:
            carried, self._carry = self._carry, deque()
            carried.extend(self.inbox.take(block=False))
            return carried, False
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
        for loop in outbox.flush():
            self._forget(engine, loop)
        if self.registry.control.drains and not engine.has_unfinished_requests():
            self._applier.change(engine, outbox, lambda c: c.drained(), None)
            for loop in outbox.flush():
                self._forget(engine, loop)

    def _forget(self, engine: EngineLike, loop: Loop) -> None:
        self._applier.forget_loop(engine, loop)
        self.steps.forget(loop)
