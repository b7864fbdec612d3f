"""Applying commands and effects on the worker thread: the worker's hands on the engine.

Runs on the worker thread only (it calls the ``LLMEngine``). ``Applier``
applies each command of a pass, makes its control transition through the
registry, and carries out the effects the transition returns: admitting and
aborting requests, resets, the core's own pause, and the answers. Every
reset of the prefix cache, asked for (``Reset``) or made by a pause
(``ResetCache``), goes through ``_reset`` and is logged there.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, assert_never

from .._bridge._channel import (
    Abort,
    Add,
    Call,
    Command,
    Hold,
    Outbox,
    Pause,
    Release,
    Reply,
    Reset,
    Resume,
)
from .._errors import EngineClosedError, RequestNotResumedError
from .._log import emit, enabled
from .._vllm import (
    EngineLike,
    Prepared,
    abort_outputs,
    add_prepared,
    add_request,
    is_engine_dead,
    made_for,
    pause_core_scheduler,
    resume_core_scheduler,
)
from ._control import Abort as AbortParked
from ._control import AbortAll, Admit, Answer, Effect, Fail, PauseCore, ResetCache, ResumeCore
from ._handoff import Adopt, Order
from ._registry import Changed, Refused, Route
from ._resume import Progress

if TYPE_CHECKING:
    from .._bridge._loops import Loop
    from ._counters import Counters
    from ._registry import Registry, Transition

__all__ = ("Applier",)


class Applier:
    """Applies commands and control effects to one engine (worker thread only)."""

    def __init__(
        self,
        registry: Registry,
        counters: Counters,
        *,
        tracking: bool,
        faulted: Callable[[], bool],
    ) -> None:
        self.registry = registry
        self.counters = counters
        self.tracking = tracking
        """Whether requests keep a ``Progress`` (a restart policy is set)."""
        self.faulted = faulted
        """Whether the watchdog saw the engine die (then a failing call is the death's)."""

    def apply(self, engine: EngineLike, command: Command | Adopt, outbox: Outbox) -> None:
        # Restart and Vacate are the worker's own (they change what it serves).
        match command:
            case Add():
                if self.registry.draining:
                    outbox.post(
                        command.sink.loop, command.sink.fail, EngineClosedError(draining=True)
                    )
                    return
                self.change(engine, outbox, lambda c: c.add(command), command)
            case Abort():
                self._abort(engine, command.request_ids, outbox, command.why)
                if command.reply is not None:
                    command.reply.ok(outbox)
            case Call():
                try:
                    result = command.fn(engine)
                except Exception as exc:
                    if is_engine_dead(exc) or self.faulted():
                        raise
                    # A call into a core that died meanwhile fails with the watchdog's
                    # cause: report the death, as every other command gets.
                    command.reply.fail(outbox, self.registry.dead_error or exc)
                else:
                    command.reply.ok(outbox, result)
            case Hold():
                steps = self.counters.steps
                self.change(
                    engine,
                    outbox,
                    lambda c: c.hold(
                        command.token, command.at_step, steps, command.reply, command.caller_holds
                    ),
                    command,
                )
            case Release():
                self.change(engine, outbox, lambda c: (c.release(command.token), []), None)
            case Pause():
                busy = engine.has_unfinished_requests()
                emit(logging.INFO, "generation paused", mode=command.mode, step=self.counters.steps)
                self.change(
                    engine,
                    outbox,
                    lambda c: c.pause(
                        command.mode, command.clear_cache, command.reply, busy, command.caller_holds
                    ),
                    command,
                )
            case Adopt():
                self._adopt(engine, command, outbox)
            case Reset():
                try:
                    done = self._reset(engine, command.running, command.connector)
                except Exception as exc:
                    if is_engine_dead(exc) or self.faulted():
                        raise
                    command.reply.fail(outbox, self.registry.dead_error or exc)
                else:
                    command.reply.ok(outbox, done)
            case Resume():
                admitted = len(self.registry.control.parked)
                self.change(engine, outbox, lambda c: c.resume(command.reply), command)
                emit(
                    logging.INFO, "generation resumed", step=self.counters.steps, admitted=admitted
                )
            case _:
                assert_never(command)

    def change(
        self,
        engine: EngineLike,
        outbox: Outbox,
        transition: Transition,
        command: Order | None,
    ) -> None:
        """Make a control transition and carry out its effects.

        Once ended (died or closed mid-pass), ``command`` gets the error instead.
        """
        match self.registry.change(transition):
            case Changed(effects):
                for effect in effects:
                    self._carry_out(engine, effect, outbox)
            case Refused(error):
                if command is not None:
                    command.fail(outbox, error)

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
                self._reset(engine, effect.running, False)
            case PauseCore():
                pause_core_scheduler(engine, effect.clear_cache)
            case ResumeCore():
                resume_core_scheduler(engine)
            case _:
                assert_never(effect)

    def _reset(self, engine: EngineLike, running: bool, connector: bool) -> bool:
        in_flight = len(self.registry.routes)
        done = bool(engine.reset_prefix_cache(running, connector))
        emit(
            logging.INFO if done else logging.WARNING,
            "prefix cache reset",
            result=done,
            step=self.counters.steps,
            reset_running_requests=running,
            requests_preempted=in_flight if done and running else 0,
        )
        return done

    def _admit(self, engine: EngineLike, add: Add, outbox: Outbox) -> None:
        request_id = add.request_id
        if request_id in self.registry.routes:
            # vLLM can't tell two live requests with one id apart: aborting one
            # would abort both.
            duplicate = ValueError(f"request id {request_id!r} is already in flight")
            outbox.post(add.sink.loop, add.sink.fail, duplicate)
            return
        try:
            prepared = _prepared(engine, add)
            if prepared is None:
                add_request(engine, request_id, add.prompt, add.params, add.kwargs)
            else:
                add_prepared(engine, prepared)
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
        progress = Progress(add) if self.tracking else None
        error = self.registry.add_route(request_id, Route(add.sink, add.sink.loop, progress))
        if error is not None:  # closed or dead meanwhile: the end can't see it
            outbox.post(add.sink.loop, add.sink.fail, error)
            return
        self.counters.loops.add(add.sink.loop)
        if enabled(logging.DEBUG):
            emit(logging.DEBUG, "request added", request_id=request_id, step=self.counters.steps)

    def _adopt(self, engine: EngineLike, adopt: Adopt, outbox: Outbox) -> None:
        # A dead pool member's request, continued here as a restart would continue it.
        route, request_id = adopt.route, adopt.request_id
        assert route.progress is not None
        failure: BaseException | None = None
        if request_id in self.registry.routes:
            failure = ValueError(f"request id {request_id!r} is already in flight")
        else:
            try:
                readmissions = route.progress.readmissions(adopt.detokenizers)
            except RequestNotResumedError as refused:
                refused.__cause__ = adopt.cause
                failure = refused
        if failure is not None:
            outbox.post(route.loop, route.sink.fail, failure)
            return
        for item in readmissions:
            add_request(engine, item.engine_id, item.prompt, item.params, item.kwargs)
        error = self.registry.add_route(request_id, route)
        if error is not None:  # closed or dead meanwhile
            outbox.post(route.loop, route.sink.fail, error)
            return
        self.registry.readmitted(request_id, route)
        outbox.post(route.loop, route.sink.resumed)

    def _abort(
        self, engine: EngineLike, request_ids: Sequence[str], outbox: Outbox, why: str
    ) -> None:
        if self.registry.control.parked:
            # One pass over the parked requests for all the ids: one per id made
            # aborting N parked requests O(N^2) (10 s for 10,000; benchmarks/NOTES.md).
            wanted = set(request_ids)
            self.change(
                engine, outbox, lambda c: c.abort_parked(lambda a: a.request_id in wanted), None
            )
        for request_id in request_ids:
            self._abort_route(engine, request_id, outbox, why)

    def _abort_route(self, engine: EngineLike, request_id: str, outbox: Outbox, why: str) -> None:
        route = self.registry.pop_route(request_id)
        if route is None:
            return  # unknown or finished: a no-op
        outbox.post(route.loop, route.sink.aborting, why)
        if route.progress is None or not route.progress.resumed:
            for out in abort_outputs(engine, request_id):
                if route.progress is not None:
                    out = route.progress.see(out) or out
                outbox.post(route.loop, route.sink.push, out)
                self.counters.outputs_delivered += 1
        # Runs after the pushes; a no-op if one of them was final (resumed: the only end).
        outbox.post(route.loop, route.sink.abort)
        engine.abort_request(route.engine_ids(request_id))
        self.counters.requests_aborted += 1
        self.counters.requests_finished += 1

    def forget_loop(self, engine: EngineLike, loop: Loop) -> None:
        # Nobody can read the outputs of a closed loop's streams: stop computing them.
        ids = self.registry.forget(loop)
        if ids:
            engine.abort_request(ids)
            self.counters.requests_aborted += len(ids)


def _prepared(engine: EngineLike, add: Add) -> Prepared | None:
    """The request built off the worker for ``add``, or None where the worker must build it.

    Waits for it if it isn't built yet (the worker only gets here once it is,
    or when it has nothing to step meanwhile), and raises its processing
    error: a bad request's. None where there was none to build, it was
    cancelled (the pool shut down), or it was built for an engine that a
    restart has replaced since.
    """
    if add.prepared is None:
        return None
    try:
        prepared = add.prepared.result()
    except concurrent.futures.CancelledError:
        return None
    return prepared if made_for(engine, prepared) else None
