"""RequestStream: the loop side of one request.

Everything here runs on the event loop that created the stream, except
``_Sink.push`` and ``_Sink.fail``, which the worker schedules onto that loop
with ``call_soon_threadsafe`` (never calls directly). So no lock is needed:
the buffer is only ever touched by its own loop.
"""

from __future__ import annotations

import asyncio
import copy
import warnings
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from ._metrics import RequestMetrics, Timeline

__all__ = ("RequestStream",)


class _Sink:
    """The buffer between the worker and one stream's consumer.

    It holds at most one pending output, so a slow consumer costs constant
    memory however many steps pass: DELTA outputs are merged into the pending
    one, a CUMULATIVE or FINAL_ONLY output replaces it. For ``n > 1`` it keeps
    the latest completion of each index, because vLLM's streaming kinds emit
    one child per output.
    """

    __slots__ = (
        "_error",
        "_last",
        "_latest",
        "_pending",
        "_waiter",
        "finished",
        "kind",
        "loop",
        "n",
        "request_id",
        "timeline",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        request_id: str,
        kind: RequestOutputKind,
        n: int,
    ) -> None:
        self.loop = loop
        self.request_id = request_id
        self.kind = kind
        self.n = n
        self.finished = False  # the final output or an error has been received
        self._last: RequestOutput | None = None
        self._pending: RequestOutput | None = None
        self._latest: dict[int, CompletionOutput] = {}
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.timeline = Timeline(request_id)

    def push(self, out: RequestOutput) -> None:
        """Take one output from the engine (on the loop, scheduled by the worker)."""
        if self.finished:
            return
        if self.kind is RequestOutputKind.DELTA:
            if self._pending is None:
                self._pending = out
            else:
                # The pending output was never handed out, so merging into it is safe.
                self._pending.add(out, aggregate=True)
        elif self.n > 1 and self.kind is RequestOutputKind.CUMULATIVE:
            for completion in out.outputs:
                self._latest[completion.index] = completion
            merged = copy.copy(out)
            merged.outputs = [self._latest[i] for i in sorted(self._latest)]
            self._pending = merged
        else:
            self._pending = out
        self._last = out if self.kind is RequestOutputKind.DELTA else self._pending
        if out.finished:
            self.finished = True
        self._wake()
        # Bookkeeping last: whatever it raises, the consumer has its output.
        self.timeline.output(out, self.kind)
        if out.finished:
            self.timeline.finish(self._pending or out, self.kind)

    def aborting(self, why: str) -> None:
        """Note why the request is being aborted (on the loop, before its final output)."""
        self.timeline.abort_reason = why

    def abort(self) -> None:
        """End the stream with a final "abort" output, if the engine gave none.

        The engine's own abort output is preferred (it is exact); this is the
        fallback that keeps the promise that every request ends.
        """
        if self.finished:
            return
        delta = self.kind is RequestOutputKind.DELTA
        last = self._last
        if last is None:
            final = RequestOutput(
                request_id=self.request_id,
                prompt=None,
                prompt_token_ids=None,
                prompt_logprobs=None,
                outputs=[CompletionOutput(i, "", [], None, None) for i in range(self.n)],
                finished=True,
            )
        else:
            final = copy.copy(last)
            final.finished = True
            final.outputs = [copy.copy(c) for c in last.outputs]
        for completion in final.outputs:
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
            if delta:
                completion.text, completion.token_ids = "", []
        self.push(final)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (on the loop, scheduled by the worker)."""
        if self.finished:
            return
        self.finished = True
        self._error = error
        self._wake()
        self.timeline.fail(error)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def take(self) -> RequestOutput | None:
        """Return the pending output, or None if there is none yet.

        Raises the stream's error, or StopAsyncIteration after the final output.
        """
        out = self._pending
        if out is not None:
            self._pending = None
            if self.n > 1 and self.kind is RequestOutputKind.DELTA:
                out.outputs.sort(key=_index)
            return out
        if self._error is not None:
            raise self._error
        if self.finished:
            raise StopAsyncIteration
        return None

    async def wait(self) -> None:
        """Wait until ``push`` or ``fail`` is called."""
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    @property
    def exhausted(self) -> bool:
        """Whether the consumer has taken everything, final output or error included."""
        return self.finished and self._pending is None and self._error is None


def _index(completion: CompletionOutput) -> int:
    return int(completion.index)


class RequestStream:
    """The outputs of one request, to iterate or to await.

    A stream belongs to the event loop that created it: use it only there.
    ``async for out in stream`` yields ``RequestOutput``s in the order the
    engine produced them, following ``sampling_params.output_kind``; the last
    one has ``finished=True``. ``await stream`` consumes what is left and
    returns the final output, with all ``n`` completions ordered by index
    (for DELTA, the concatenation of the deltas it consumed).

    ``async with engine.generate(...) as stream:`` guarantees the abort on
    every exit from the block, even a cancellation before the stream was
    first awaited. Every path away from an unfinished stream aborts the
    request in the engine before its next step: cancelling the task that
    awaits or iterates it, ``break`` out of ``async for`` (the iterator is
    dropped), ``aclose()``, and garbage collection (which also warns with
    ``ResourceWarning``).
    Every stream ends with a final output or an exception: ``EngineDeadError``,
    ``EngineClosedError`` or the engine's own error for a bad request.
    """

    __slots__ = ("__weakref__", "_abandoned", "_abort", "_final", "_sink", "request_id")

    def __init__(self, request_id: str, sink: _Sink, abort: Callable[[str, str], None]) -> None:
        self.request_id = request_id
        """The request's id in the engine, given or generated."""
        self._sink = sink
        self._abort = abort
        self._final: RequestOutput | None = None
        self._abandoned = False

    @property
    def finished(self) -> bool:
        """Whether the engine is done with this request (final output or error received)."""
        return self._sink.finished

    @property
    def metrics(self) -> RequestMetrics | None:
        """Timings and counts of the request, once its final output has arrived."""
        return self._sink.timeline.metrics

    def _check_loop(self) -> None:
        if asyncio.get_running_loop() is not self._sink.loop:
            raise RuntimeError(
                f"stream {self.request_id!r} belongs to another event loop; "
                "use it only on the loop that called generate()"
            )

    async def _next(self) -> RequestOutput:
        # The hot path: one coroutine per output, no future when one is pending.
        self._check_loop()
        sink = self._sink
        while (out := sink.take()) is None:
            try:
                await sink.wait()
            except BaseException:
                # Cancelled (or interrupted) while waiting: nobody wants the rest.
                self._abandon("cancelled")
                raise
        if out.finished:
            self._final = out
        return out

    def _abandon(self, why: str) -> None:
        if not self._sink.finished and not self._abandoned:
            self._abandoned = True
            self._abort(self.request_id, why)

    def __aiter__(self) -> _StreamIterator:
        return _StreamIterator(self)

    def __await__(self) -> Generator[object, None, RequestOutput]:
        return self._result().__await__()

    async def _result(self) -> RequestOutput:
        merged: RequestOutput | None = None
        delta = self._sink.kind is RequestOutputKind.DELTA
        while not self._sink.exhausted:
            out = await self._next()
            if delta and merged is not None:
                merged.add(out, aggregate=True)
            elif delta:
                merged = _copy_delta(out)
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

    async def __aexit__(self, *_: object) -> None:
        """Leaving the block, by any exit, aborts the request if it is unfinished.

        It doesn't wait for the abort (a cancellation must not wait on the
        engine): the request is out of the engine before its next step.
        """
        self._abandon("cancelled" if _cancelling() else "disconnected")

    def __del__(self) -> None:
        if not self._sink.finished and not self._abandoned:
            self._abort(self.request_id, "disconnected")
            warnings.warn(
                f"RequestStream {self.request_id!r} was garbage-collected unfinished; "
                "its request was aborted",
                ResourceWarning,
                stacklevel=1,
            )


class _StreamIterator:
    """The iterator ``async for`` uses; dropping it unfinished aborts the request.

    It is a separate object so that ``break`` (which drops the iterator but
    not the stream) is seen at once, by reference counting.
    """

    __slots__ = ("_stream",)

    def __init__(self, stream: RequestStream) -> None:
        self._stream = stream

    def __aiter__(self) -> _StreamIterator:
        return self

    def __anext__(self) -> Coroutine[Any, Any, RequestOutput]:
        return self._stream._next()

    def __del__(self) -> None:
        self._stream._abandon("disconnected")


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _copy_delta(out: RequestOutput) -> RequestOutput:
    """Copy a DELTA output deeply enough that merging into it changes nothing shared."""
    merged = copy.copy(out)
    merged.outputs = [copy.copy(c) for c in out.outputs]
    for c in merged.outputs:
        c.token_ids = list(c.token_ids)
        if c.logprobs is not None:
            c.logprobs = copy.copy(c.logprobs)
    return merged
