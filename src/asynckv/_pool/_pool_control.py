"""The pool's controls, on ``AsyncEnginePool``: reset, pause, stats and health over its engines.

Runs on the caller's thread, usually an event loop (asyncio or trio); the
calls to every engine at once go through ``_gather``. Each call is the engine's
own (``AsyncEngineAPI``), applied to every live engine, with one validation
path (``_checks``) shared with ``AsyncEngine``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .._errors import EngineClosedError, EngineDeadError
from .._loop import _checks
from .._stats import EngineStats
from ._gather import gather

if TYPE_CHECKING:
    from .._loop._engine import AsyncEngine
    from .._types import PauseMode
    from ._affinity import Router

__all__ = ("PoolControl",)


class PoolControl:
    """The controls of ``AsyncEnginePool``; see the module docstring and the pool."""

    if TYPE_CHECKING:
        _engines: tuple[AsyncEngine, ...]
        _lock: threading.Lock
        _router: Router

        def _check_open(self) -> None: ...

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> list[bool]:
        """Reset every engine's prefix cache, concurrently; return each engine's answer.

        The list follows ``engines``; each answer is ``AsyncEngine.reset_prefix_cache``'s,
        and False for a dead engine. The pool forgets the prefixes of the
        engines that answered True, since their caches no longer hold them.

        Raises:
            EngineDeadError: every engine is dead.
            EngineClosedError: the pool was closed.
        """
        self._check_open()
        if all(engine.errored for engine in self._engines):
            raise self._all_dead()
        results = await gather(
            functools.partial(self._reset_one, engine, reset_running_requests, reset_connector)
            for engine in self._engines
        )
        with self._lock:
            self._router.prefixes.forget(lambda index: results[index])
        return results

    @staticmethod
    async def _reset_one(engine: AsyncEngine, running: bool, connector: bool) -> bool:
        try:
            return await engine.reset_prefix_cache(running, connector)
        except (EngineDeadError, EngineClosedError):
            return False

    def stats(self) -> EngineStats:
        """The engines' ``stats()`` combined; never blocks, safe from any thread.

        Counts and rates are summed over the engines (dead ones keep what they
        counted), ``last_step_seconds`` is the largest, ``seconds_since_last_step``
        the smallest, ``loops_served`` the largest (a loop may use several engines),
        and ``paused`` is whether any engine is paused or held.
        """
        return EngineStats.combine([engine.stats() for engine in self._engines])

    async def check_health(self, stall_timeout: float | None = None) -> None:
        """Raise unless the pool can serve: some engine is alive and none of the live ones stalls.

        Never waits for a worker. A dead engine alone doesn't fail the check
        (the pool routes around it); a stalled live one does, since requests
        routed to it make no progress.

        Raises:
            EngineClosedError: the pool was closed.
            EngineDeadError: every engine is dead.
            EngineStalledError: a live engine is stalled (``AsyncEngine.check_health``).
        """
        self._check_open()
        live = self._live()
        for engine in live:
            await engine.check_health(stall_timeout)

    async def pause_generation(
        self, *, mode: PauseMode = "abort", clear_cache: bool = True
    ) -> None:
        """``pause_generation`` on every live engine, concurrently; returns once all have.

        Raises as ``AsyncEngine.pause_generation`` (the first error of any
        engine), and ``EngineDeadError`` if every engine is dead.
        """
        mode = _checks.pause_mode(mode)
        self._check_open()
        await self._on_live(lambda e: e.pause_generation(mode=mode, clear_cache=clear_cache))

    async def resume_generation(self) -> None:
        """``resume_generation`` on every live engine, concurrently."""
        self._check_open()
        await self._on_live(lambda e: e.resume_generation())

    async def is_paused(self) -> bool:
        """Whether ``pause_generation`` is in force on any live engine."""
        self._check_open()
        return any([await engine.is_paused() for engine in self._live()])

    def _live(self) -> list[AsyncEngine]:
        live = [engine for engine in self._engines if not engine.errored]
        if not live:
            raise self._all_dead()
        return live

    async def _on_live(self, call: Callable[[AsyncEngine], Awaitable[None]]) -> None:
        # An engine that dies meanwhile has ended its own streams: skip it.
        async def one(engine: AsyncEngine) -> None:
            try:
                await call(engine)
            except EngineDeadError:
                if not engine.errored:
                    raise

        await gather(functools.partial(one, engine) for engine in self._live())

    def _all_dead(self) -> BaseException:
        dead = [
            error
            for engine in self._engines
            if engine.errored and isinstance(error := engine.dead_error, Exception)
        ]
        if not dead:
            return EngineClosedError()  # every engine was closed on its own
        return EngineDeadError(ExceptionGroup("every engine in the pool is dead", dead))
