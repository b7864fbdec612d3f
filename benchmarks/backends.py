"""What one output costs the caller's loop on asyncio and on trio, and what an anyio wait would.

    python benchmarks/backends.py

No engine: a stream's buffer (``_Sink``) and its ``RequestStream`` are driven
by hand, as the worker's batch callbacks drive them. Per backend it prints
the Python calls (cProfile) and the CPU time (``process_time``, best of 15)
per output on the two paths of ``RequestStream._next``:

- ``pending``: an output is waiting when the consumer asks (no future);
- ``waiting``: the consumer waits for each output, which a callback of the
  loop then pushes (one future per output).

Then, per backend, the cost of one wait-and-wake with the primitive asynckv
uses and with ``anyio.Event``: the figures behind keeping ``asyncio.Future``
as asyncio's waiter (docs/backends.md). CPU time is noisy on a shared
machine; the call counts are exact.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Awaitable, Callable

import anyio
import outcome
import trio
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv._bridge._loops import current
from asynckv._loop._stream import RequestStream, _Sink

N = 20_000
REPEATS = 15


def _output(i: int, done: bool) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text="x",
        token_ids=[i],
        cumulative_logprob=None,
        logprobs=None,
        finish_reason="length" if done else None,
    )
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1],
        prompt_logprobs=None,
        outputs=[completion],
        finished=done,
    )


def _stream() -> tuple[_Sink, RequestStream, list[RequestOutput]]:
    sink = _Sink(current(), "r", RequestOutputKind.DELTA, 1)
    outs = [_output(i, i == N - 1) for i in range(N)]
    return sink, RequestStream("r", sink, lambda *_: None), outs


async def pending() -> None:
    """An output waits each time the consumer asks."""
    sink, stream, outs = _stream()
    for out in outs:
        sink.push(out)
        await stream._next()


async def waiting() -> None:
    """The consumer waits; a callback of the loop pushes the output, as the worker's batch does."""
    sink, stream, outs = _stream()
    loop = sink.loop
    for out in outs:
        loop.post(sink.push, out)
        await stream._next()


async def wake_future() -> None:
    """asynckv's own waiter: an asyncio future, or a TrioFuture."""
    loop = current()
    make = loop.futures()
    for _ in range(N):
        future = make()
        loop.post(future.set_result, None)
        await future


async def wake_anyio_event() -> None:
    """The same with ``anyio.Event``."""
    loop = current()
    for _ in range(N):
        event = anyio.Event()
        loop.post(lambda e: e.set(), event)
        await event.wait()


async def wake_trio_lowlevel() -> None:
    """trio's floor: reschedule a task from a run_sync_soon callback."""
    token = trio.lowlevel.current_trio_token()
    for _ in range(N):
        task = trio.lowlevel.current_task()
        token.run_sync_soon(trio.lowlevel.reschedule, task, outcome.Value(None))
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)


def cpu_per_op(fn: Callable[[], Awaitable[None]], backend: str) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        began = time.process_time()
        anyio.run(fn, backend=backend)
        best = min(best, time.process_time() - began)
    return best / N


def calls_per_op(fn: Callable[[], Awaitable[None]], backend: str) -> float:
    # The run's own start-up is a few hundred calls: negligible over N.
    profile = cProfile.Profile()
    profile.enable()
    anyio.run(fn, backend=backend)
    profile.disable()
    return pstats.Stats(profile).total_calls / N  # type: ignore[attr-defined,no-any-return]


def main() -> None:
    for backend in ("asyncio", "trio"):
        paths: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("pending", pending),
            ("waiting", waiting),
        ]
        for name, fn in paths:
            calls = calls_per_op(fn, backend)
            cpu = cpu_per_op(fn, backend) * 1e6
            print(f"{backend:7s} output, {name}: {calls:5.1f} calls, {cpu:6.2f} us CPU")
    waits: list[tuple[str, str, Callable[[], Awaitable[None]]]] = [
        ("asyncio", "asyncio.Future", wake_future),
        ("asyncio", "anyio.Event", wake_anyio_event),
        ("trio", "TrioFuture", wake_future),
        ("trio", "anyio.Event", wake_anyio_event),
        ("trio", "wait_task_rescheduled", wake_trio_lowlevel),
    ]
    for backend, name, fn in waits:
        calls = calls_per_op(fn, backend)
        cpu = cpu_per_op(fn, backend) * 1e6
        print(f"{backend:7s} wake, {name:22s}: {calls:5.1f} calls, {cpu:6.2f} us CPU")


if __name__ == "__main__":
    main()
