"""The trio half of the loop seam: a trio run's handle and its futures.

Imported only once a trio run calls into asynckv (``_loops.current``), so
trio stays an optional dependency. ``TrioRun.post`` runs on whichever thread
answers (the worker, usually); everything else runs inside the trio run.

The worker reaches a run through its ``TrioToken.run_sync_soon``, which is
trio's own cross-thread entry queue (``trio/_core/_entry_queue.py``): thread-
and signal-safe, and either it raises ``RunFinishedError`` or the callback is
guaranteed to run before ``trio.run`` returns. So a finished run is seen at
the first ``post`` after it, exactly like a closed asyncio loop.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import outcome
import trio

if TYPE_CHECKING:
    from ._loops import Future

__all__ = ("TrioFuture", "TrioRun", "current")

T = TypeVar("T")


class TrioRun:
    """The handle of one ``trio.run``: what ``_loops.Loop`` asks of a loop."""

    __slots__ = ("__weakref__", "_token")

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token

    @property
    def native(self) -> object:
        return self._token

    def post(self, fn: Callable[[T], None], arg: T, /) -> bool:
        try:
            self._token.run_sync_soon(fn, arg)
        except trio.RunFinishedError:
            return False
        return True

    def futures(self) -> Callable[[], TrioFuture[Any]]:
        return TrioFuture

    def is_current(self) -> bool:
        try:
            return trio.lowlevel.current_trio_token() is self._token
        except RuntimeError:  # not in a trio run at all
            return False

    async def wait(self, future: Future[Any], timeout: float) -> None:
        with trio.move_on_after(timeout):
            await future

    def __repr__(self) -> str:
        return f"<trio run {self._token!r}>"


# One handle per run, kept by the run itself: it goes when the run goes.
_RUN: trio.lowlevel.RunVar[TrioRun | None] = trio.lowlevel.RunVar("asynckv_run", default=None)


def current() -> TrioRun | None:
    """The running trio run's handle (the same object for the whole run), or None."""
    try:
        run = _RUN.get()
    except RuntimeError:  # no trio run here
        return None
    if run is None:
        run = TrioRun(trio.lowlevel.current_trio_token())
        _RUN.set(run)
    return run


class TrioFuture(Generic[T]):
    """A one-shot answer for one trio task: ``asyncio.Future``'s subset, on trio's lowest level.

    One task awaits it (``wait_task_rescheduled``); ``set_result`` and
    ``set_exception``, called in the same run (by a ``run_sync_soon``
    callback, usually), reschedule that task. A cancelled wait leaves the
    future done, so that a late answer is dropped, as with asyncio. Not
    thread-safe: the worker reaches it only through ``TrioRun.post``.
    """

    __slots__ = ("_cancelled", "_outcome", "_task")

    def __init__(self) -> None:
        self._outcome: outcome.Outcome[T] | None = None
        self._task: trio.lowlevel.Task | None = None
        self._cancelled = False

    def done(self) -> bool:
        """Whether it has an answer, or its waiter was cancelled."""
        return self._outcome is not None or self._cancelled

    def set_result(self, result: T, /) -> None:
        """Answer with ``result``; wake the waiting task."""
        self._settle(outcome.Value(result))

    def set_exception(self, exception: BaseException, /) -> None:
        """Answer with ``exception``, raised in the waiting task."""
        self._settle(outcome.Error(exception))

    def _settle(self, result: outcome.Outcome[T]) -> None:
        if self.done():
            raise RuntimeError("the future is already done")
        self._outcome = result
        task, self._task = self._task, None
        if task is not None:
            trio.lowlevel.reschedule(task, result)

    def __await__(self) -> Generator[Any, None, T]:
        return self._wait().__await__()

    async def _wait(self) -> T:
        if self._task is not None:
            raise RuntimeError("a TrioFuture is awaited by one task only")
        if self._outcome is not None:
            # Answered already (not on asynckv's paths, where a future is
            # awaited before any answer can run): still a schedule point.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return self._outcome.unwrap()
        self._task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._task = None
            self._cancelled = True
            return trio.lowlevel.Abort.SUCCEEDED

        value: T = await trio.lowlevel.wait_task_rescheduled(abort)
        return value
