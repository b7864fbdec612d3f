"""RequestStream: the loop side of one request.

Everything here runs on the event loop (asyncio loop or trio run) that
created the stream; the worker reaches it only through the stream's ``_Sink``
(``_sink.py``), by callbacks scheduled on that loop. So no lock is needed.
"""

from __future__ import annotations

import asyncio
import functools
import warnings
import weakref
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any

import anyio
from vllm.sampling_params import RequestOutputKind

from .._bridge._loops import running_asyncio_loop, task_of
from .._vllm import copy_delta, merge_delta
from ._sink import _index, _Sink

if TYPE_CHECKING:
    from vllm.outputs import RequestOutput

    from ._metrics import RequestMetrics

__all__ = ("RequestStream",)


class RequestStream:
    """The outputs of one request, to iterate or to await, like ``AsyncLLM.generate``'s generator.

    A stream belongs to the event loop (asyncio loop or trio run) that
    created it: use it only there.
    It is its own async iterator (``aiter(stream) is stream``; ``anext(stream)``
    works): ``async for out in stream`` yields ``RequestOutput``s in the order
    the engine produced them, following ``sampling_params.output_kind``; the
    last one has ``finished=True``. ``await stream`` consumes what is left and
    returns the final output, with all ``n`` completions ordered by index
    (for DELTA, the merge of the deltas not consumed before), also after a
    partial iteration.

    The request is aborted in the engine before its next step on every path
    away from an unfinished stream: ``aclose()``; leaving
    ``async with engine.generate(...) as stream:`` by any exit (even a
    cancellation before the stream was first awaited); a cancellation of
    the wait for its next output (on trio, a cancel scope around that wait);
    on asyncio also cancelling the task that last took an output, wherever
    it waits then; and dropping the stream (so ``break`` out of
    ``async for out in engine.generate(...)`` aborts at once). A stream
    dropped before anything was taken from it also warns with
    ``ResourceWarning``: that is usually a forgotten ``await``.
    Every stream ends with a final output or an exception: ``EngineDeadError``,
    ``EngineClosedError`` or the engine's own error for a bad request.
    """

    __slots__ = (
        "__weakref__",
        "_abandoned",
        "_abort",
        "_final",
        "_on_done",
        "_sink",
        "_task",
        "_touched",
        "request_id",
    )

    def __init__(self, request_id: str, sink: _Sink, abort: Callable[[str, str], None]) -> None:
        self.request_id = request_id
        """The request's id in the engine, given or generated."""
        self._sink = sink
        self._abort = abort
        self._final: RequestOutput | None = None
        self._abandoned = False
        self._touched = False  # something was asked of it: iterated, awaited, closed
        # asyncio: the task that last took an output, watched so that its
        # cancellation (wherever it is waiting then) aborts the request. trio
        # has no per-task done callback; there a cancellation reaches the
        # stream through its wait, an `async with` block, or the dropped stream.
        self._task: asyncio.Task[Any] | None = None
        self._on_done: Callable[[asyncio.Task[Any]], None] | None = None

    @property
    def finished(self) -> bool:
        """Whether the engine is done with this request (final output or error received)."""
        return self._sink.finished

    @property
    def metrics(self) -> RequestMetrics | None:
        """Timings and counts of the request, once its final output has arrived."""
        return self._sink.timeline.metrics

    def _check_loop(self) -> None:
        if running_asyncio_loop() is not self._sink.native and not self._sink.loop.is_current():
            raise self._wrong_loop()

    def _wrong_loop(self) -> RuntimeError:
        return RuntimeError(
            f"stream {self.request_id!r} belongs to another event loop; "
            "use it only on the loop that called generate()"
        )

    async def _next(self) -> RequestOutput:
        # The hot path: one coroutine per output, no future when one is pending;
        # on asyncio one C call checks the loop.
        sink = self._sink
        native = sink.native
        if running_asyncio_loop() is native:
            task = task_of(native)  # type: ignore[arg-type]  # native is this asyncio loop
            if task is not self._task:
                self._watch(task)
        elif not sink.loop.is_current():
            raise self._wrong_loop()
        self._touched = True
        try:
            while (out := sink.take()) is None:
                try:
                    await sink.wait()
                except BaseException:
                    # Cancelled (or interrupted) while waiting: nobody wants the rest.
                    self._abandon("cancelled")
                    raise
        except BaseException:
            if sink.finished:
                # Ended by an error: stop watching the task, or a long-lived task
                # that meets many failed streams would collect their callbacks.
                self._watch(None)
            raise
        if out.finished:
            self._final = out
            self._watch(None)
        return out

    def _watch(self, task: asyncio.Task[Any] | None) -> None:
        if self._task is not None and self._on_done is not None:
            self._task.remove_done_callback(self._on_done)
        self._task, self._on_done = task, None
        if task is not None:
            # The task holds only a weak reference, so dropping the stream still aborts.
            self._on_done = functools.partial(_abandon_if_cancelled, weakref.ref(self))
            task.add_done_callback(self._on_done)

    def _abandon(self, why: str) -> None:
        if not self._sink.finished and not self._abandoned:
            self._abandoned = True
            self._abort(self.request_id, why)

    def __aiter__(self) -> RequestStream:
        return self

    def __anext__(self) -> Coroutine[Any, Any, RequestOutput]:
        """The next output; ``StopAsyncIteration`` after the final one."""
        return self._next()

    def __await__(self) -> Generator[object, None, RequestOutput]:
        return self._result().__await__()

    async def _result(self) -> RequestOutput:
        merged: RequestOutput | None = None
        delta = self._sink.kind is RequestOutputKind.DELTA
        while not self._sink.exhausted:
            out = await self._next()
            if delta and merged is not None:
                merge_delta(merged, out)
            elif delta:
                merged = copy_delta(out)
            else:
                merged = out
        if merged is None:
            if self._final is None:
                raise RuntimeError(f"stream {self.request_id!r} was already consumed")
            return self._final
        if delta:
            merged.outputs.sort(key=_index)
        return merged

    async def aclose(self) -> None:
        """Abort the request if it is unfinished and wait until its stream has ended.

        Idempotent. Errors that end the stream (a dead engine, say) are not raised.
        """
        self._check_loop()
        self._touched = True
        self._abandon("disconnected")
        sink = self._sink
        while True:
            try:
                if sink.take() is None:
                    await sink.wait()
            except (StopAsyncIteration, Exception):
                return

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, _: object, exc: BaseException | None, __: object) -> None:
        """Leaving the block, by any exit, aborts the request if it is unfinished.

        It doesn't wait for the abort (a cancellation must not wait on the
        engine): the request is out of the engine before its next step.
        """
        self._touched = True
        self._abandon("cancelled" if _cancelling(exc) else "disconnected")

    def __del__(self) -> None:
        if self._sink.finished or self._abandoned:
            return
        self._abort(self.request_id, "disconnected")
        if not self._touched:
            warnings.warn(
                f"RequestStream {self.request_id!r} was garbage-collected unfinished "
                "before anything was taken from it; its request was aborted",
                ResourceWarning,
                stacklevel=1,
            )


def _abandon_if_cancelled(stream: weakref.ref[RequestStream], task: asyncio.Task[Any]) -> None:
    # A done callback of the task that last took an output (on the stream's loop).
    alive = stream()
    if alive is not None and task.cancelled():
        alive._abandon("cancelled")


def _cancelling(exc: BaseException | None) -> bool:
    # For the log's "why" only: trio's Cancelled or asyncio's CancelledError
    # leaving the block, or (asyncio) a cancellation pending on the task.
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return True
    task = asyncio.current_task() if running_asyncio_loop() is not None else None
    return task is not None and task.cancelling() > 0
