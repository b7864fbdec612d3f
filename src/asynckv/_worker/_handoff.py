"""The pool's hand-over on the worker thread: ``Adopt``, ``Vacate``, and the pool's ``Handoff``.

``Adopt`` is built on a pool member's worker thread as it hands a request
over (``_pool/_failover.py``: it died, or it is drained) and applied on the
adopting member's worker thread (``Applier``); it travels through that
member's inbox like any command. ``Vacate`` is put by a pool's ``drain`` (the
caller's loop) and applied by the drained member's worker itself. ``Order``
is what a worker's inbox holds: the loops' commands, a restart, and the
pool's hand-overs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .._bridge._channel import Command, Outbox, Reply, Restart
from ._registry import Route
from ._resume import Decoded

__all__ = ("Adopt", "Handoff", "Order", "Vacate")


@dataclass(eq=False)
class Adopt:
    """Continue a request of another pool member on this engine (failover or drain).

    ``route`` keeps the request's stream and ``Progress``; ``detokenizers``
    are the other engine's, taken before its shutdown (or before the request
    was aborted there, for a drain).
    """

    request_id: str
    route: Route
    detokenizers: Decoded
    cause: BaseException | None
    """The death that moved it (None: a drain moved it)."""

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        outbox.post(self.route.loop, self.route.sink.fail, error)


@dataclass(eq=False)
class Vacate:
    """A pool drains this member: hand its requests to the others (``handoff``), then wait.

    ``reply`` is answered with ``(moved, stayed)`` (request ids: handed over,
    left to finish here) once nothing is in flight on this member.
    """

    handoff: bool
    reply: Reply

    def fail(self, outbox: Outbox, error: BaseException) -> None:
        self.reply.fail(outbox, error)


Order = Command | Restart | Adopt | Vacate
"""What a worker's inbox holds."""

Handoff = Callable[
    [list[tuple[str, Route]], Decoded, BaseException | None], list[tuple[str, Route]]
]
"""A pool's hand-over: (routes, detokenizers, cause or None for a drain) -> the routes it
could not place."""
