"""The caller's event loop as the worker thread reaches it: the backend-specific seam.

asynckv serves asyncio loops and trio runs. Two things differ between them,
and both live here and in ``_trio.py``, nowhere else:

- How the worker thread posts to a caller: a ``Loop`` handle's ``post``.
  On asyncio that is ``loop.call_soon_threadsafe`` guarded by ``is_closed()``;
  on trio, the run's ``TrioToken.run_sync_soon``. A loop that has closed, or
  a trio run that has finished, makes ``post`` return False, and the worker
  takes its closed-loop path (the loop's requests are aborted).
- How a task waits for an answer: a ``Future`` made by ``Loop.futures()``.
  On asyncio it *is* an ``asyncio.Future`` (the cheapest wait asyncio has;
  ``anyio.Event`` costs more per output, docs/backends.md); on trio it is
  ``_trio.TrioFuture``, a one-shot ``wait_task_rescheduled``.

Threads: ``post`` runs on whichever thread answers (the worker, or the one
that closes or kills the engine); everything else runs on the loop that the
handle stands for. There is one handle per asyncio loop and one per trio run,
so the worker can group a pass's answers by handle identity. trio is imported
only once a trio run calls in: asyncio users need not install it.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from asyncio import _get_running_loop
from collections.abc import Callable, Generator
from typing import Any, Protocol, TypeVar

__all__ = ("Future", "Loop", "current", "running_asyncio_loop", "task_of")

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

running_asyncio_loop: Callable[[], asyncio.AbstractEventLoop | None] = _get_running_loop
"""The running asyncio loop of this thread, or None (a C function; never raises)."""

try:  # Python 3.12+: asyncio's current_task is a C function
    from _asyncio import current_task as _current_task  # type: ignore[attr-defined,unused-ignore]
except ImportError:  # 3.11: current_task is Python around this C-backed dict
    from asyncio.tasks import _current_tasks  # type: ignore[attr-defined,unused-ignore]

    _current_task = _current_tasks.get

task_of: Callable[[asyncio.AbstractEventLoop], asyncio.Task[Any] | None] = _current_task
"""The task running on ``loop`` (the running loop of this thread), or None.

``asyncio.current_task(loop)`` without its Python frame on 3.11: streams ask
once per output.
"""


class Future(Protocol[T_co]):
    """A one-shot answer that one task of the loop awaits (``asyncio.Future``'s subset).

    Set and read on its own loop only. Awaiting it raises the loop's
    cancellation exception when the waiting task is cancelled, after which
    ``done()`` is True and a late answer must be dropped (``done()`` first).
    """

    def done(self) -> bool: ...
    def set_result(self, result: Any, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...
    def __await__(self) -> Generator[Any, None, T_co]: ...


class Loop(Protocol):
    """A caller's event loop (an asyncio loop or a trio run), as the worker reaches it."""

    @property
    def native(self) -> object:
        """The asyncio loop or the ``TrioToken``: what ``generate`` compares to check a caller."""
        ...

    def post(self, fn: Callable[[T], None], arg: T, /) -> bool:
        """Schedule ``fn(arg)`` on the loop (any thread); False if the loop has ended."""
        ...

    def futures(self) -> Callable[[], Future[Any]]:
        """A factory of futures of this loop (call it on the loop only)."""
        ...

    def is_current(self) -> bool:
        """Whether the calling code runs on this loop."""
        ...

    async def wait(self, future: Future[Any], timeout: float) -> None:
        """Wait (on the loop) until ``future`` is done or ``timeout`` seconds have passed.

        A timeout leaves the future done with no answer, so a late answer is dropped.
        """
        ...


class AsyncioLoop:
    """The handle of one asyncio event loop.

    Holds the loop weakly: a handle is cached for as long as its loop lives
    (``current``), and a strong reference here would keep every loop alive.
    Whatever waits on the loop (a stream's buffer, a reply's future) holds the
    loop itself, so a loop nobody waits on may go, and then ``post`` says so.
    """

    __slots__ = ("__weakref__", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)

    @property
    def native(self) -> object:
        return self._loop()

    def post(self, fn: Callable[[T], None], arg: T, /) -> bool:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # closed between the check and the call
            return False
        return True

    def futures(self) -> Callable[[], Future[Any]]:
        loop = self._loop()
        if loop is None:  # unreachable from the loop itself, which is alive
            raise RuntimeError("the event loop is gone")
        return loop.create_future

    def is_current(self) -> bool:
        loop = running_asyncio_loop()
        return loop is not None and loop is self._loop()

    async def wait(self, future: Future[Any], timeout: float) -> None:
        loop = self._loop()
        assert loop is not None  # the loop runs this very coroutine
        timer = loop.call_later(timeout, _time_up, future)
        try:
            await future
        finally:
            timer.cancel()

    def __repr__(self) -> str:
        return f"<asyncio loop {self._loop()!r}>"


def _time_up(future: Future[Any]) -> None:
    if not future.done():
        future.set_result(None)


_handles: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncioLoop] = (
    weakref.WeakKeyDictionary()
)
# Loops in several threads ask at once; a WeakKeyDictionary is not safe for that.
_handles_lock = threading.Lock()


def current() -> Loop:
    """The handle of the running asyncio loop or trio run, the same object on every call.

    Raises:
        RuntimeError: neither an asyncio loop nor a trio run is running here.
    """
    loop = running_asyncio_loop()
    if loop is not None:
        with _handles_lock:
            handle = _handles.get(loop)
            if handle is None:
                handle = _handles[loop] = AsyncioLoop(loop)
        return handle
    if sys.modules.get("trio") is not None:  # a trio caller has imported trio
        from . import _trio

        run = _trio.current()
        if run is not None:
            return run
    raise RuntimeError("no running event loop: call this from asyncio or trio")
