"""The pool's hand-over on the worker thread: ``Adopt``, and the ``Handoff`` a pool installs.

``Adopt`` is built on a dying pool member's worker thread (``_pool/_failover.py``)
and applied on the adopting member's worker thread (``Applier``); it travels
through that member's inbox like any command, so ``Order`` is what a worker's
inbox holds: the loops' commands and the pool's hand-overs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .._bridge._channel import Command, Outbox
from ._registry import Route
from ._resume import Decoded

__all__ = ("Adopt", "Handoff", "Order")


@dataclass(eq=False)
class Adopt:
    """Continue a request of a pool member that died on this engine (pool failover).

    ``route`` keeps the request's stream and ``Progress``; ``detokenizers``
    are the dead engine's, taken before its shutdown.
    """

    request_id: str
    route: Route
    detokenizers: Decoded
    cause: BaseException

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        outbox.post(self.route.loop, self.route.sink.fail, error)


Order = Command | Adopt
"""What a worker's inbox holds."""

Handoff = Callable[[list[tuple[str, Route]], Decoded, BaseException], list[tuple[str, Route]]]
"""A pool's failover: (routes, detokenizers, cause) -> the routes it could not place."""
