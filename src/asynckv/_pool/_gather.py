"""Run calls concurrently on the caller's loop, asyncio or trio, and collect them all.

Runs on the caller's event loop. The pool calls every engine at once; this is
``asyncio.gather`` for both backends, on an anyio task group, with one
difference that structured concurrency brings: a failure doesn't leave the
other calls running unwatched. Every call runs to its end, then the first
failure (in the order of the calls) is raised.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import anyio

__all__ = ("gather", "settle")

T = TypeVar("T")


async def settle(calls: Iterable[Callable[[], Awaitable[T]]]) -> list[T | Exception]:
    """Run every call at once; return their results or exceptions, in order.

    Only ``Exception``s are collected: a cancellation (or ``KeyboardInterrupt``)
    cancels the other calls and propagates, as the task group makes it.
    """
    calls = list(calls)
    outcomes: list[T | Exception] = [RuntimeError("never ran")] * len(calls)

    async def one(index: int, call: Callable[[], Awaitable[T]]) -> None:
        try:
            outcomes[index] = await call()
        except Exception as exc:
            outcomes[index] = exc

    async with anyio.create_task_group() as group:
        for index, call in enumerate(calls):
            group.start_soon(one, index, call)
    return outcomes


async def gather(calls: Iterable[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run every call at once and return their results, in order.

    Raises the first call's exception, in the order of the calls, once all
    have ended.
    """
    results: list[T] = []
    for outcome in await settle(calls):
        if isinstance(outcome, Exception):
            raise outcome
        results.append(outcome)
    return results
