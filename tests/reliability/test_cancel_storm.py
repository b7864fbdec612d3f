"""Cancel storm: 1,000 requests leaving by every path end exactly as their path says."""

from __future__ import annotations

import asyncio
import collections
import gc
import random
import time
import warnings
from collections.abc import Callable

import psutil
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from asynckv import AsyncEngine
from support import unfinished

PATHS = (
    "complete",
    "cancel_before_output",
    "cancel_mid_stream",
    "break",
    "aclose",
    "abort",
    "drop",
)


async def storm(
    engine: AsyncEngine, seed: int, total: int, in_flight: int
) -> collections.Counter[str]:
    """Run ``total`` requests, ``in_flight`` at a time; check each one's ending; count outcomes."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(in_flight)
    outcomes: collections.Counter[str] = collections.Counter()

    async def one(i: int) -> None:
        path = rng.choice(PATHS)
        prompt = TokensPrompt(
            prompt_token_ids=[rng.randrange(4, 500) for _ in range(rng.randint(8, 256))]
        )
        max_tokens = rng.randint(1, 64)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        stop_after = rng.randint(1, max(1, max_tokens // 4))
        async with gate:
            stream = engine.generate(prompt, params)
            if path == "complete":
                out = await stream
                assert len(out.outputs[0].token_ids) == max_tokens
                assert out.outputs[0].finish_reason == "length"
            elif path in ("cancel_before_output", "cancel_mid_stream"):
                seen = asyncio.Event()

                async def consume() -> None:
                    async for _ in stream:
                        seen.set()

                task = asyncio.create_task(consume())
                await asyncio.sleep(0)  # the task is waiting for its first output
                if path == "cancel_mid_stream":
                    await seen.wait()
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    path += ":cancelled"
                else:
                    path += ":finished first"  # it completed before the cancel landed
            elif path in ("break", "aclose", "abort"):
                count = 0
                async for _ in stream:
                    count += 1
                    if count >= stop_after:
                        if path == "aclose":
                            await stream.aclose()
                        elif path == "abort":
                            await engine.abort(stream.request_id)
                        break
                if path != "aclose":
                    final = await stream
                    reason = final.outputs[0].finish_reason
                    assert reason in ("abort", "length"), reason
                    if reason == "length":
                        assert len(final.outputs[0].token_ids) == max_tokens
                    path += f":{reason}"
                assert stream.finished
            else:  # drop it unreferenced
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ResourceWarning)
                    del stream
                    gc.collect()
        outcomes[path] += 1

    await asyncio.gather(*(one(i) for i in range(total)))
    return outcomes


async def test_cancel_storm(engine: AsyncEngine, figures: Callable[[str], None]) -> None:
    """After two storms of 1,000 requests the engine holds nothing and memory is flat (5%)."""
    me = psutil.Process()
    began = time.monotonic()
    first = await storm(engine, seed=1, total=1000, in_flight=64)
    assert await unfinished(engine) == 0
    gc.collect()
    rss_first = me.memory_info().rss
    second = await storm(engine, seed=2, total=1000, in_flight=64)
    assert await unfinished(engine) == 0
    gc.collect()
    rss_second = me.memory_info().rss
    seconds = time.monotonic() - began
    assert sum(first.values()) == sum(second.values()) == 1000
    assert rss_second <= rss_first * 1.05, (rss_first, rss_second)
    assert engine.stats().requests_in_flight == 0
    figures(
        f"2 x 1000 requests, 64 in flight, {len(PATHS)} paths, {seconds:.1f} s; "
        f"outcomes {dict(sorted((first + second).items()))}; "
        f"RSS {rss_first / 2**20:.0f} -> {rss_second / 2**20:.0f} MiB"
    )
