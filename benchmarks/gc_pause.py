"""Measure the garbage collector's pauses during bursts of requests, with and without freeze_gc.

    python benchmarks/gc_pause.py            # AsyncEngine's default: freeze_gc=True
    python benchmarks/gc_pause.py --no-freeze

One engine (the tiny model), bursts of 256 and 1,024 streams of 16 tokens;
prints, per burst, the event loop's worst lag (a 1 ms sleeper) and the three
longest collections (generation, milliseconds) seen through ``gc.callbacks``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm import EngineArgs, SamplingParams
from vllm.inputs import TokensPrompt

from asynckv import AsyncEngine
from asynckv.testing import tiny_model

_pauses: list[tuple[int, float]] = []
_began: list[float] = [0.0]


def _on_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _began[0] = time.perf_counter()
    else:
        _pauses.append((int(info["generation"]), time.perf_counter() - _began[0]))


async def burst(engine: AsyncEngine, n: int) -> str:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16)
    lags: list[float] = []
    stop = asyncio.Event()

    async def probe() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            before = loop.time()
            await asyncio.sleep(0.001)
            lags.append(loop.time() - before - 0.001)

    async def one(i: int) -> None:
        async for _ in engine.generate(TokensPrompt(prompt_token_ids=[5 + i % 400] * 64), params):
            pass

    _pauses.clear()
    lag = asyncio.create_task(probe())
    await asyncio.sleep(0.01)
    began = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    seconds = time.perf_counter() - began
    stop.set()
    await lag
    longest = sorted(_pauses, key=lambda p: -p[1])[:3]
    return (
        f"{n:>5} streams: {seconds:.2f} s, loop lag max {max(lags) * 1e3:.0f} ms, "
        f"{len(_pauses)} collections, longest (gen, ms) "
        f"{[(g, round(s * 1e3, 1)) for g, s in longest]}"
    )


async def main(freeze: bool) -> None:
    args = EngineArgs(
        model=str(tiny_model()), max_model_len=512, max_num_seqs=256, disable_log_stats=True
    )
    engine = AsyncEngine.from_engine_args(args, freeze_gc=freeze)
    await engine.start()
    gc.callbacks.append(_on_gc)
    try:
        for n in (256, 1024, 1024):
            print(await burst(engine, n), flush=True)
    finally:
        gc.callbacks.remove(_on_gc)
        await engine.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-freeze", action="store_true", help="AsyncEngine(freeze_gc=False)")
    asyncio.run(main(not parser.parse_args().no_freeze))
