"""AsyncEnginePool over two real CPU engines, started once for the module.

The prefix cache actually hitting on the engine that affinity picks, and a
SIGKILLed engine failing only its own. Routing and failures at exact moments
are in tests/fake/test_pool.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from asynckv import (
    AsyncEngine,
    AsyncEnginePool,
    EngineDeadError,
    RequestStream,
)
from support import engine_args, result, unfinished

FIVE = SamplingParams(max_tokens=5)


def where(pool: AsyncEnginePool, streams: list[RequestStream]) -> list[int | None]:
    return [pool.engine_of(s.request_id) for s in streams]


# -- two real engines --------------------------------------------------------------


class Pair(NamedTuple):
    engines: tuple[AsyncEngine, ...]
    cores: set[int]  # their engine-core processes, in no particular order


def _cores() -> set[int]:
    return {p.pid for p in psutil.Process().children() if "EngineCore" in p.name()}


@pytest.fixture(scope="module")
def pair(model_path: Path) -> Iterator[Pair]:
    """Two real engines, started together by a pool; each test routes through a pool of its own.

    Only this fixture closes them (a test's pool would close them with it).
    The SIGKILL test kills one, so it comes last.
    """
    before = _cores()
    pool = AsyncEnginePool.from_engine_args([engine_args(model_path) for _ in range(2)])
    asyncio.run(pool.start())
    try:
        yield Pair(pool.engines, _cores() - before)
    finally:
        for engine in pool.engines:
            engine.shutdown()


GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def test_real_engines_share_a_burst(pair: Pair) -> None:
    """A burst spreads over both real engines and each returns the same greedy tokens."""
    pool = AsyncEnginePool(pair.engines)
    prompts = ["To be or not to be,", "Call me Ishmael.", "In the beginning", "It was the"]
    params = SamplingParams(max_tokens=8, **GREEDY)
    streams = [pool.generate(p, params) for p in prompts]
    assert sorted(where(pool, streams)) == [0, 0, 1, 1]  # type: ignore[type-var]
    outs = await asyncio.gather(*streams)
    direct = await asyncio.gather(*(pair.engines[0].generate(p, params) for p in prompts))
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        list(d.outputs[0].token_ids) for d in direct
    ]


async def test_affinity_hits_the_prefix_cache(pair: Pair) -> None:
    """A request sharing a long prefix goes to the engine that cached it, and hits there."""
    block = await pair.engines[0].run_on_engine(lambda e: e.vllm_config.cache_config.block_size)
    tokenizer = pair.engines[0].get_tokenizer()
    prefix = (tokenizer.encode("A robot may not injure a human being. ") * 200)[: 2 * block]
    params = SamplingParams(max_tokens=4, **GREEDY)
    pool = AsyncEnginePool(pair.engines)

    warm = pool.generate(TokensPrompt(prompt_token_ids=[*prefix, 11]), params)
    first = pool.engine_of(warm.request_id)
    assert first is not None
    assert (await warm).num_cached_tokens == 0
    # Make that engine the busier one: affinity must outweigh it.
    busy = pair.engines[first].generate("keep busy", SamplingParams(max_tokens=400))
    await pair.engines[first].run_on_engine(lambda e: None)
    again = pool.generate(TokensPrompt(prompt_token_ids=[*prefix, 12]), params)
    assert pool.engine_of(again.request_id) == first
    assert (await again).num_cached_tokens >= block
    await busy.aclose()

    cold = pair.engines[1 - first].generate(TokensPrompt(prompt_token_ids=[*prefix, 12]), params)
    assert (await cold).num_cached_tokens == 0  # the other engine never saw it

    assert await pool.reset_prefix_cache() == [True, True]
    after = await pool.generate(TokensPrompt(prompt_token_ids=[*prefix, 13]), params)
    assert after.num_cached_tokens == 0
    for engine in pair.engines:
        assert await unfinished(engine) == 0


async def test_killed_engine_fails_only_its_own(pair: Pair) -> None:
    """SIGKILL of one engine-core process fails that engine's streams; the pool serves on."""
    pool = AsyncEnginePool(pair.engines)
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    streams = [pool.generate(f"doomed or not {i}", long) for i in range(4)]
    owners = where(pool, streams)
    await asyncio.gather(*(e.run_on_engine(lambda e: None) for e in pair.engines))
    os.kill(min(pair.cores), signal.SIGKILL)
    for _ in range(200):
        if any(e.errored for e in pair.engines):
            break
        await asyncio.sleep(0.05)
    (dead,) = [i for i, e in enumerate(pair.engines) if e.errored]
    await pool.abort([s.request_id for s in streams])  # the dead engine's are no error
    for stream, owner in zip(streams, owners, strict=True):
        if owner == dead:
            with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
                await asyncio.wait_for(result(stream), timeout=20)
    for stream, owner in zip(streams, owners, strict=True):
        if owner != dead:
            assert (await stream).outputs[0].finish_reason == "abort"

    later = [pool.generate(f"later {i}", FIVE) for i in range(3)]
    assert where(pool, later) == [1 - dead] * 3
    assert all(len(o.outputs[0].token_ids) == 5 for o in await asyncio.gather(*later))
    results = await pool.reset_prefix_cache()
    assert results[dead] is False and results[1 - dead] is True
