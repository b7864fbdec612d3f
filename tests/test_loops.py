"""One started engine serves any event loop: in turn, at once, and cheaply."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import psutil
from vllm import SamplingParams

from asynckv import AsyncEngine, RequestStream
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


def test_closed_loop_requests_are_aborted(engine: AsyncEngine) -> None:
    """Streams of a loop that closed are aborted: nobody can read them any more."""
    kept: list[RequestStream] = []

    async def leave_running() -> None:
        kept.append(engine.generate("orphan", SamplingParams(max_tokens=400, ignore_eos=True)))
        await engine.run_on_engine(lambda e: None)

    asyncio.run(leave_running())

    async def count() -> int:
        # Aborted at the next step: a "wait" pause returns once nothing is in flight.
        await engine.pause_generation(mode="wait")
        await engine.resume_generation()
        return await unfinished(engine)

    assert asyncio.run(count()) == 0


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
