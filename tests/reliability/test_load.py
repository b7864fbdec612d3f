"""Resets under load, slow and stuck consumers, leaks, and many loops in many threads."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
import tracemalloc
import weakref
from collections.abc import Callable

import psutil
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine, RequestStream
from fakes import FakeEngine
from support import random_prompts, unfinished

GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


async def test_resets_under_load(engine: AsyncEngine, figures: Callable[[str], None]) -> None:
    """20 resets of running requests at random steps: all True, every greedy token unchanged."""
    work = random_prompts(64, seed=5)
    reference = await asyncio.gather(*(engine.generate(p, GREEDY) for p in work))
    assert await engine.reset_prefix_cache()
    began = time.monotonic()
    streams = [engine.generate(p, GREEDY) for p in work]
    start = engine.step_count
    targets = sorted(random.Random(6).sample(range(start + 1, start + 44), 20))
    results = []
    for target in targets:
        async with engine.paused(at_step=target):
            results.append(await engine.reset_prefix_cache(reset_running_requests=True))
    outs = await asyncio.gather(*streams)
    assert results == [True] * 20
    same = sum(
        list(o.outputs[0].token_ids) == list(r.outputs[0].token_ids)
        for o, r in zip(outs, reference, strict=True)
    )
    assert same == 64
    assert await unfinished(engine) == 0
    figures(
        f"64 streams x 48 tokens, 20 resets at steps {targets}: "
        f"{same}/64 identical, {time.monotonic() - began:.1f} s"
    )


async def test_slow_and_stuck_consumers(
    engine: AsyncEngine, figures: Callable[[str], None]
) -> None:
    """64 slow DELTA readers and 8 unread streams: every token arrives, merged, none lost."""
    delta = SamplingParams(
        max_tokens=32, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
    )
    me = psutil.Process()
    rss_before = me.memory_info().rss
    stuck = [engine.generate(p, delta) for p in random_prompts(8, seed=7)]

    async def slow_reader(stream: RequestStream) -> tuple[int, int]:
        tokens = outputs = 0
        async for out in stream:
            tokens += len(out.outputs[0].token_ids)
            outputs += 1
            await asyncio.sleep(0.05)  # the consumer's own slowness: the workload, not a sync
        return tokens, outputs

    began = time.monotonic()
    slow = await asyncio.gather(
        *(slow_reader(engine.generate(p, delta)) for p in random_prompts(64, 8))
    )
    slow_seconds = time.monotonic() - began
    probe_began = time.monotonic()
    probe = await engine.generate("pace probe", GREEDY)
    probe_seconds = time.monotonic() - probe_began
    await asyncio.sleep(max(0.0, 5 - (time.monotonic() - began)))  # nobody reads `stuck` for 5 s
    stuck_outputs = [[out async for out in s] for s in stuck]
    rss_after = me.memory_info().rss

    assert all(tokens == 32 for tokens, _ in slow)
    assert all(len(outs) == 1 for outs in stuck_outputs)  # merged into one pending output
    assert all(len(outs[0].outputs[0].token_ids) == 32 for outs in stuck_outputs)
    assert len(probe.outputs[0].token_ids) == 48
    figures(
        f"64 slow readers got 32/32 tokens in {sum(o for _, o in slow)} outputs "
        f"({slow_seconds:.1f} s); 8 streams unread for 5 s gave 1 merged output each; "
        f"a 48-token probe took {probe_seconds:.2f} s; RSS {rss_before / 2**20:.0f} -> "
        f"{rss_after / 2**20:.0f} MiB"
    )


async def test_aborted_requests_leak_nothing(
    engine: AsyncEngine, figures: Callable[[str], None]
) -> None:
    """10,000 aborted requests at a rolling 64: traced memory grows < 5 MB, streams collected."""
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    gate = asyncio.Semaphore(64)
    samples: list[weakref.ref[RequestStream]] = []

    async def one(i: int) -> None:
        async with gate:
            stream = engine.generate(TokensPrompt(prompt_token_ids=[300 + i % 100, 7]), params)
            if i % 500 == 0:
                samples.append(weakref.ref(stream))
            async for _ in stream:
                break

    await asyncio.gather(*(one(i) for i in range(500)))  # warm caches and pools
    gc.collect()
    tracemalloc.start()
    began = time.monotonic()
    before = tracemalloc.get_traced_memory()[0]
    await asyncio.gather(*(one(i) for i in range(10_000)))
    assert await unfinished(engine) == 0
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 5 * 2**20, grown
    assert all(ref() is None for ref in samples)
    figures(
        f"10000 aborted requests in {time.monotonic() - began:.1f} s: traced memory "
        f"+{grown / 2**20:.2f} MiB, {len(samples)} sampled streams all collected"
    )


async def test_engines_created_and_closed(figures: Callable[[str], None]) -> None:
    """20 facades created, used and closed in turn: threads stable, RSS growth < 100 MB.

    Fake engines stand in for vLLM here (20 real starts would take 10 minutes);
    what is measured is the facade's own threads and memory.
    """
    me = psutil.Process()
    rss: list[int] = []
    threads: list[int] = []
    for _ in range(20):
        engine = AsyncEngine(FakeEngine())
        await asyncio.gather(
            *(engine.generate(f"r{i}", SamplingParams(max_tokens=5)) for i in range(50))
        )
        await engine.aclose()
        gc.collect()
        rss.append(me.memory_info().rss)
        threads.append(threading.active_count())
    assert len(set(threads)) == 1, threads
    assert rss[-1] - rss[0] < 100 * 2**20
    figures(
        f"20 facades: threads {threads[0]} throughout, RSS +{(rss[-1] - rss[0]) / 2**20:.1f} MiB"
    )


def test_many_loops_in_many_threads(engine: AsyncEngine, figures: Callable[[str], None]) -> None:
    """8 threads x 50 requests, loops closed with streams in flight: the engine serves on."""
    errors: list[BaseException] = []
    finished = [0] * 8
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    kept: list[RequestStream] = []

    def serve(n: int) -> None:
        async def main() -> None:
            outs = await asyncio.gather(*(engine.generate(f"t{n} r{i}", params) for i in range(45)))
            finished[n] = sum(len(o.outputs[0].token_ids) == 8 for o in outs)
            # The last 5 are left in flight when the loop closes.
            kept.extend(engine.generate(f"t{n} left {i}", long) for i in range(5))
            await engine.run_on_engine(lambda e: None)

        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)

    began = time.monotonic()
    workers = [threading.Thread(target=serve, args=(n,)) for n in range(8)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors
    assert finished == [45] * 8

    async def after() -> tuple[list[int], int]:
        # A closed loop's requests are aborted at the next step: a "wait" pause
        # returns once nothing is in flight, so once they are gone.
        before = await unfinished(engine)
        await engine.pause_generation(mode="wait")
        await engine.resume_generation()
        counts = [before, await unfinished(engine)]
        probe = await engine.generate("still here", params)
        return counts, len(probe.outputs[0].token_ids)

    counts, probe_tokens = asyncio.run(after())
    assert counts[-1] == 0 and probe_tokens == 8
    assert not engine.errored
    figures(
        f"8 loops x 50 requests ({len(kept)} left in flight at loop close) in "
        f"{time.monotonic() - began:.1f} s; unfinished after: {counts}; engine still serving"
    )
