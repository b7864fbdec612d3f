"""The worker thread's restart path: from a dead engine to a new one serving the same requests.

Runs on the worker thread only, between the death of one engine and the
first pass on the next, while the inbox stays open (commands wait there).
``Recovery`` asks the lifecycle (``_life.py``, through the registry) whether
the policy allows a restart, reads what the dead engine decoded, rebuilds,
and re-adds every unfinished request as its continuation (``_resume.py``).
It never ends the registry itself: it returns a named result (``Rebuilt``,
``GaveUp``, ``ClosedMeanwhile``), and the worker dies or serves with that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._bridge._channel import Outbox
from .._errors import RequestNotResumedError
from .._log import emit
from .._types import RestartPolicy
from .._vllm import EngineLike, add_request, detokenizers, pause_core_scheduler, shutdown_core
from ._life import Deaths, GiveUp, Rebuild

if TYPE_CHECKING:
    from ._counters import Counters
    from ._registry import Registry, Route
    from ._resume import Decoded

__all__ = ("ClosedMeanwhile", "GaveUp", "Rebuilt", "Recovery", "decode")


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """The engine was built again and its requests re-added: serve it."""

    engine: EngineLike


@dataclass(frozen=True, slots=True)
class GaveUp:
    """The rebuild (or a re-add) failed: die with every death's cause, the failure last."""

    causes: tuple[BaseException, ...]


@dataclass(frozen=True, slots=True)
class ClosedMeanwhile:
    """The worker was closed while the engine was rebuilt (the new one is shut down)."""


class Recovery:
    """Restarts one worker's engine within a ``RestartPolicy`` (worker thread only)."""

    def __init__(
        self,
        policy: RestartPolicy,
        rebuild: Callable[[], EngineLike],
        registry: Registry,
        counters: Counters,
    ) -> None:
        self.deaths = Deaths(policy)
        """Every death so far (replaced whole at each death)."""
        self._rebuild = rebuild
        self._registry = registry
        self._counters = counters
        self._down = 0.0

    def died(self, cause: BaseException) -> Rebuild | GiveUp:
        """Note a death: ``Rebuild`` (the registry is ``Restarting``) or ``GiveUp``.

        Gives up too once the worker has ended (dead or closed meanwhile).
        """
        self._down = time.monotonic()
        action = self._registry.died(self.deaths, cause, self._down)
        self.deaths = action.deaths
        if isinstance(action, GiveUp):
            return action
        emit(
            logging.WARNING,
            "engine died, restarting",
            error=_name(cause),
            restart=self.deaths.restarts,
            requests=len(self._registry.routes),
        )
        return action

    def planned(self, build: Callable[[], EngineLike] | None) -> bool:
        """A planned restart: the registry is ``Rebuilding``; False if not running.

        Not a death: the policy's count is left alone. ``build``, if given,
        builds this engine from now on (the restart's overrides).
        """
        if not self._registry.planned():
            return False
        self._down = time.monotonic()
        if build is not None:
            self._rebuild = build
        emit(logging.INFO, "engine restarting", requests=len(self._registry.routes))
        return True

    def decoded(self, engine: EngineLike) -> Decoded:
        """The engine's detokenizers of each request (taken before its shutdown)."""
        return decode(engine, list(self._registry.routes.items()))

    def rebuilt(self, decoded: Decoded) -> Rebuilt | GaveUp | ClosedMeanwhile:
        """Build the engine again and re-add every unfinished request.

        The registry stays ``Restarting`` (``Rebuilding``) until the worker
        serves the new engine.
        """
        cause = self._registry.restart_cause
        try:
            engine = self._rebuild()
        except BaseException as exc:
            return GaveUp((*self.deaths.causes, exc))
        if self._registry.ended:  # closed while rebuilding
            shutdown_core(engine)
            return ClosedMeanwhile()
        registry, outbox, resumed = self._registry, Outbox(), 0
        try:
            if registry.control.core_paused:  # a "keep" pause holds on the new core too
                pause_core_scheduler(engine, False)
            for request_id, route in list(registry.routes.items()):
                assert route.progress is not None
                try:
                    readmissions = route.progress.readmissions(decoded)
                except RequestNotResumedError as refused:
                    refused.__cause__ = cause
                    registry.pop_route(request_id)
                    outbox.post(route.loop, route.sink.fail, refused)
                    continue
                for item in readmissions:
                    add_request(engine, item.engine_id, item.prompt, item.params, item.kwargs)
                registry.readmitted(request_id, route)
                outbox.post(route.loop, route.sink.resumed)
                resumed += 1
        except BaseException as exc:
            shutdown_core(engine)
            outbox.flush()
            return GaveUp((*self.deaths.causes, exc))
        self._counters.restarts += 1
        emit(
            logging.WARNING if cause is not None else logging.INFO,
            "engine restarted",
            cause=_name(cause) or "planned",
            downtime=round(time.monotonic() - self._down, 3),
            requests_resumed=resumed,
            restarts=self._counters.restarts,
        )
        outbox.flush()
        return Rebuilt(engine)


def decode(engine: EngineLike, routes: list[tuple[str, Route]]) -> Decoded:
    """The engine's detokenizers of these requests' engine requests (read before they go)."""
    decoded: Decoded = {}
    for request_id, route in routes:
        for engine_id in route.engine_ids(request_id):
            decoded[engine_id] = detokenizers(engine, engine_id)
    return decoded


def _name(cause: BaseException | None) -> str:
    return "" if cause is None else f"{type(cause).__name__}: {cause}"
