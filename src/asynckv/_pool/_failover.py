"""Pool failover, on a member's worker thread: its requests continue on a live member.

``install`` runs once, on the thread that makes the pool. ``_fail_over``
runs on a member's worker thread, from its restart path (so only for members
with a ``RestartPolicy``), after the engine died and before it is rebuilt, or
from a drain (``Vacate``, between two steps, before the requests are aborted
there; then nothing dies and the member serves on): it routes each
unfinished request to a live member under the pool's lock, hands it over
through that member's inbox (an ``Adopt`` command, which continues it there
exactly as a restart would), and returns what no member could take, which
the dying member resumes itself once it is back (a drained one finishes it).
A dead member then restarts in the background and takes new requests
again once it is up (the router skips a restarting member while another can
serve).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._errors import EngineClosedError, EngineDeadError
from .._log import emit
from .._worker._handoff import Adopt

if TYPE_CHECKING:
    from .._loop._engine import AsyncEngine
    from .._worker._registry import Route
    from .._worker._resume import Decoded
    from ._affinity import Router

__all__ = ("install",)


def install(engines: Sequence[AsyncEngine], lock: threading.Lock, router: Router) -> None:
    """Make each member's restart hand its requests to the others first."""
    if len(engines) < 2:
        return
    for index, engine in enumerate(engines):
        engine._worker.handoff = functools.partial(_fail_over, engines, lock, router, index)


def _fail_over(
    engines: Sequence[AsyncEngine],
    lock: threading.Lock,
    router: Router,
    index: int,
    routes: list[tuple[str, Route]],
    detokenizers: Decoded,
    cause: BaseException | None,
) -> list[tuple[str, Route]]:
    kept: list[tuple[str, Route]] = []
    with lock:
        target = router.choose((), {index})
        if target is None or engines[target].restarting:
            return routes  # nobody serving: they wait for this member's own restart (or stay)
        adopter = engines[target]._worker
        for request_id, route in routes:
            try:
                adopter.inbox.put(Adopt(request_id, route, detokenizers, cause))
            except (EngineDeadError, EngineClosedError):
                kept.append((request_id, route))
                continue
            # A stream's abort goes through the engine that made it, wherever the request
            # went since (it may move again): every member that forwards it forwards it here.
            for member in engines:
                forwarded = member._worker.forwarded
                if member._worker is adopter:
                    forwarded.pop(request_id, None)
                elif member is engines[index] or request_id in forwarded:
                    forwarded[request_id] = adopter.inbox
            router.move(request_id, index, target)
    emit(
        logging.WARNING if cause is not None else logging.INFO,
        "requests failed over" if cause is not None else "requests handed over",
        engine=index,
        to_engine=target,
        requests=len(routes) - len(kept),
    )
    return kept
