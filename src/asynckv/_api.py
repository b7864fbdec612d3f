"""The API that ``AsyncEngine`` and ``AsyncEnginePool`` share, as a Protocol (runs nowhere).

Runs nowhere: a type. Code written against ``AsyncEngineAPI`` takes either
one engine or a pool; mypy checks both against it (tests/unit/test_api.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm.sampling_params import SamplingParams

    from ._loop._stream import RequestStream
    from ._stats import EngineStats
    from ._types import PauseMode

__all__ = ("AsyncEngineAPI",)


class AsyncEngineAPI(Protocol):
    """What one ``AsyncEngine`` and an ``AsyncEnginePool`` both offer, with the same meaning.

    Each method's guarantees are those documented on ``AsyncEngine``; a pool
    applies them to every live engine (its docstrings say how it combines
    their answers).
    """

    async def start(self) -> None:
        """Start the engine(s) and wait until ready."""

    async def aclose(self, timeout: float = 30.0) -> None:
        """Close: end what is in flight with ``EngineClosedError``; idempotent."""

    def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **kwargs: Any,
    ) -> RequestStream:
        """Submit a request now and return its stream."""

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort requests; return once they are out of the engine."""

    def stats(self) -> EngineStats:
        """A snapshot of the counters, without waiting for a worker."""

    async def check_health(self, stall_timeout: float | None = None) -> None:
        """Raise unless usable (and, given ``stall_timeout``, making progress)."""

    async def pause_generation(
        self, *, mode: PauseMode = "abort", clear_cache: bool = True
    ) -> None:
        """Pause generation as ``AsyncLLM.pause_generation`` does."""

    async def resume_generation(self) -> None:
        """Undo ``pause_generation``."""

    async def is_paused(self) -> bool:
        """Whether ``pause_generation`` is in force."""
