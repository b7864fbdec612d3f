"""One started engine serves any event loop, asyncio or trio: in turn, at once, and cheaply."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import psutil
import pytest
import trio
from vllm import SamplingParams

from asynckv import AsyncEngine, RequestStream
from asynckv._bridge._loops import Loop, current
from support import unfinished

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_successive_asyncio_runs(engine: AsyncEngine) -> None:
    """Two successive ``asyncio.run()`` calls use the same engine and get equal greedy tokens."""

    async def once() -> list[int]:
        out = await engine.generate("Same prompt, new loop", PARAMS)
        return list(out.outputs[0].token_ids)

    assert asyncio.run(once()) == asyncio.run(once())


def test_two_loops_in_two_threads_at_once(engine: AsyncEngine) -> None:
    """Loops in two threads stream at the same time, each getting its own outputs."""
    barrier = threading.Barrier(2)
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def serve(n: int) -> None:
        async def main() -> list[str]:
            barrier.wait()
            streams = [engine.generate(f"thread {n} prompt {i}", PARAMS) for i in range(10)]
            outs = await asyncio.gather(*streams)
            return [o.request_id for o in outs if len(o.outputs[0].token_ids) == 6]

        try:
            results[n] = asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [len(results[n]) for n in range(2)] == [10, 10]
    assert not set(results[0]) & set(results[1])


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_closed_loop_requests_are_aborted(engine: AsyncEngine, backend: str) -> None:
    """Streams of a closed asyncio loop or a finished trio run are aborted at the next step."""
    kept: list[RequestStream] = []
    aborted = engine.stats().requests_aborted

    async def leave_running() -> None:
        kept.append(engine.generate("orphan", SamplingParams(max_tokens=400, ignore_eos=True)))
        await engine.run_on_engine(lambda e: None)

    anyio.run(leave_running, backend=backend)

    async def count() -> int:
        # A "wait" pause returns once nothing is in flight: here, once the orphan is aborted.
        await engine.pause_generation(mode="wait")
        await engine.resume_generation()
        return await unfinished(engine)

    assert anyio.run(count, backend=backend) == 0
    # Aborted by the closed-loop path, not left to run its 400 tokens.
    assert engine.stats().requests_aborted == aborted + 1
    assert not kept[0].finished


def test_asyncio_and_trio_in_two_threads_at_once(engine: AsyncEngine) -> None:
    """An asyncio loop and a trio run stream at once, and trio's abort ends an asyncio stream."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    in_flight = {"asyncio": threading.Event(), "trio": threading.Event()}
    handoff: queue.Queue[str] = queue.Queue()
    results: dict[str, list[str]] = {}
    aborted: list[str | None] = []
    errors: list[BaseException] = []

    def both_in_flight(me: str) -> None:
        # Each side's requests are in the engine before either side reads: truly at once.
        in_flight[me].set()
        for event in in_flight.values():
            assert event.wait(60)

    async def on_asyncio() -> None:
        target = engine.generate("asyncio's long one", long)
        handoff.put(target.request_id)
        streams = [engine.generate(f"asyncio prompt {i}", params) for i in range(10)]
        await engine.run_on_engine(lambda e: None)
        await asyncio.to_thread(both_in_flight, "asyncio")
        outs = await asyncio.gather(*streams)
        results["asyncio"] = [o.request_id for o in outs if len(o.outputs[0].token_ids) == 6]
        aborted.append((await target).outputs[0].finish_reason)

    async def on_trio() -> None:
        streams = [engine.generate(f"trio prompt {i}", params) for i in range(10)]
        await engine.run_on_engine(lambda e: None)
        await trio.to_thread.run_sync(both_in_flight, "trio")
        outs: list[str] = []

        async def consume(stream: RequestStream) -> None:
            out = await stream
            if len(out.outputs[0].token_ids) == 6:
                outs.append(out.request_id)

        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(consume, stream)
        results["trio"] = outs
        await engine.abort(await trio.to_thread.run_sync(handoff.get, True, 60))

    def serve(run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=serve, args=(lambda: asyncio.run(on_asyncio()),)),
        threading.Thread(target=serve, args=(lambda: trio.run(on_trio),)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [len(results[name]) for name in ("asyncio", "trio")] == [10, 10]
    assert not set(results["asyncio"]) & set(results["trio"])
    assert aborted == ["abort"]


_WITHOUT_TRIO = """
import asyncio, sys
sys.modules["trio"] = None  # importing trio now fails, as if it were not installed
from vllm import SamplingParams
from asynckv import AsyncEngine
from fakes import FakeEngine

async def main() -> int:
    engine = AsyncEngine(FakeEngine(), freeze_gc=False)
    out = await engine.generate("x", SamplingParams(max_tokens=3))
    await engine.aclose()
    return len(out.outputs[0].token_ids)

print(asyncio.run(main()))
"""


def test_asyncio_callers_need_no_trio() -> None:
    """With trio impossible to import, asyncio callers are served as ever."""
    tests = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRIO],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, tests])},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "3"


def test_one_handle_per_loop_and_none_once_ended() -> None:
    """Each asyncio loop and trio run has one handle, whose posts fail once it has ended."""
    got: list[int] = []

    async def handles() -> tuple[Loop, Loop]:
        return current(), current()

    for backend in ("asyncio", "trio"):
        first, second = anyio.run(handles, backend=backend)
        assert first is second
        # The run is over: its loop is closed, or trio's entry queue refuses work.
        assert not first.post(got.append, 1)

    async def posts() -> None:
        loop = current()
        done = anyio.Event()
        assert loop.post(lambda _: done.set(), None)
        assert loop.post(got.append, 2)
        await done.wait()

    for backend in ("asyncio", "trio"):
        anyio.run(posts, backend=backend)
    assert got == [2, 2]


class _CountingLoop(asyncio.SelectorEventLoop):
    wakeups = 0

    def call_soon_threadsafe(self, *args, **kwargs):  # type: ignore[no-untyped-def,override]
        self.wakeups += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def test_one_wakeup_per_step_per_loop(engine: AsyncEngine) -> None:
    """Twenty streams on one loop cost that loop one wake-up per step, not one per stream."""
    loop = _CountingLoop()

    async def main() -> int:
        before = engine.step_count
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        await asyncio.gather(*(engine.generate(f"wake {i}", params) for i in range(20)))
        return engine.step_count - before

    try:
        steps = loop.run_until_complete(main())
    finally:
        loop.close()
    # One per step, plus the answers to commands between steps.
    assert loop.wakeups <= steps + 2
    assert steps >= 10


def test_idle_engine_uses_no_cpu(engine: AsyncEngine) -> None:
    """An idle engine (worker, watchdog and engine processes) uses almost no CPU."""

    async def warm() -> None:
        await engine.generate("warm", PARAMS)

    asyncio.run(warm())  # idle from here on
    me = psutil.Process()

    def cpu_seconds() -> float:
        total = float(sum(me.cpu_times()[:2]))
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += sum(child.cpu_times()[:2])
        return total

    # vLLM's executor worker spins on its shared-memory queue for 1 s after its
    # last read (SpinCondition.busy_loop_s) before it sleeps: let that pass.
    threading.Event().wait(1.5)
    start_cpu, start = cpu_seconds(), time.monotonic()
    threading.Event().wait(3.0)  # the interval being measured, not a synchronisation
    used = (cpu_seconds() - start_cpu) / (time.monotonic() - start)
    assert used < 0.1, f"idle engine used {used:.0%} of a core"
