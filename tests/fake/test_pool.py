"""AsyncEnginePool: routing, prefix affinity, resets and dead engines.

Routing and failures at exact moments use fake engines held inside a step
(their requests stay in flight until the test lets them go). Two real CPU
engines, started once for the module, show the prefix cache actually hitting
on the engine that affinity picks, and a SIGKILLed engine failing only its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from vllm import EngineArgs, SamplingParams
from vllm.inputs import TokensPrompt

from asynckv import (
    AsyncEngine,
    AsyncEnginePool,
    EngineClosedError,
    EngineDeadError,
    EngineHeldError,
    EngineNotStartedError,
    RequestStream,
)
from fakes import FakeEngine

FIVE = SamplingParams(max_tokens=5)
PREFIX = "A robot may not injure a human being or, through inaction, allow harm. " * 4


Fakes = tuple[AsyncEnginePool, list[FakeEngine]]


@contextlib.asynccontextmanager
async def fake_pool(
    n: int = 2, **options: Any
) -> AsyncIterator[tuple[AsyncEnginePool, list[FakeEngine]]]:
    """A pool of fake engines whose steps block until the test opens their gates."""
    fakes = [FakeEngine() for _ in range(n)]
    for fake in fakes:
        fake.gate.clear()
    pool = AsyncEnginePool([AsyncEngine(fake) for fake in fakes], **options)
    try:
        yield pool, fakes
    finally:
        for fake in fakes:
            fake.gate.set()
        await pool.aclose()


def where(pool: AsyncEnginePool, streams: list[RequestStream]) -> list[int | None]:
    return [pool.engine_of(s.request_id) for s in streams]


async def test_burst_goes_to_least_loaded() -> None:
    """A burst spreads evenly, and an engine whose requests finished takes the next ones."""
    async with fake_pool() as (pool, fakes):
        first = [pool.generate(f"r{i}", FIVE) for i in range(4)]
        assert where(pool, first) == [0, 1, 0, 1]
        fakes[1].gate.set()
        for stream in first[1::2]:
            assert (await stream).finished
        # Engine 1 holds at most one of them (its requests run to the end at once).
        second = [pool.generate(f"s{i}", FIVE) for i in range(2)]
        assert where(pool, second) == [1, 1]
        fakes[0].gate.set()
        for stream in first[::2] + second:
            assert len((await stream).outputs[0].token_ids) == 5


async def test_prefix_affinity_until_overloaded() -> None:
    """A shared prefix keeps its engine while within affinity_slack of the least loaded."""
    async with fake_pool(affinity_slack=2) as (pool, fakes):
        other = pool.generate("unrelated", FIVE)
        same = [pool.generate(PREFIX + str(i), FIVE) for i in range(5)]
        # The first goes to the idle engine 1, and the prefix sticks there until
        # engine 1 would hold more than 2 over engine 0's one request.
        assert where(pool, [other, *same]) == [0, 1, 1, 1, 1, 0]
        fresh = pool.generate("B" * len(PREFIX), FIVE)  # a prefix nobody has seen
        assert pool.engine_of(fresh.request_id) == 0  # 2 vs 4: least loaded
        # The same text as a TextPrompt, tokens as a TokensPrompt, a cache salt:
        text = pool.generate({"prompt": "B" * len(PREFIX) + "!"}, FIVE)
        assert pool.engine_of(text.request_id) == 0
        salted = pool.generate({"prompt": "B" * len(PREFIX), "cache_salt": "x"}, FIVE)
        assert pool.engine_of(salted.request_id) == 1  # no match; 4 vs 4, round-robin
        tokens = [
            pool.generate(TokensPrompt(prompt_token_ids=[*range(40), i]), FIVE) for i in range(2)
        ]
        assert where(pool, tokens) == [0, 0]  # 4 vs 5: least loaded; then affinity
        for fake in fakes:
            fake.gate.set()
        streams = [other, *same, fresh, text, salted, *tokens]
        assert all([(await s).finished for s in streams])


async def test_request_ids_are_unique_across_engines() -> None:
    """An id in flight anywhere in the pool is refused at once; once finished it is free."""
    async with fake_pool() as (pool, fakes):
        first = pool.generate("a", FIVE, request_id="same")
        assert pool.engine_of("same") == 0
        with pytest.raises(ValueError, match="already in flight"):
            pool.generate("b", FIVE, request_id="same")  # engine 1 would take it
        with pytest.raises(TypeError):
            pool.generate("c", FIVE, request_id=7)  # type: ignore[arg-type]
        fakes[0].gate.set()
        await first
        assert pool.engine_of("same") is None
        again = pool.generate("d", FIVE, request_id="same")
        fakes[1].gate.set()
        assert (await again).finished


async def test_abort_goes_to_the_owning_engine() -> None:
    """abort() sends each id to the engine that holds it and ignores unknown ids."""
    async with fake_pool() as (pool, fakes):
        long = SamplingParams(max_tokens=50)
        streams = [pool.generate(f"r{i}", long) for i in range(4)]
        assert where(pool, streams) == [0, 1, 0, 1]
        # Once inside a step, a worker takes no command: the aborts queue up.
        for fake in fakes:
            assert await asyncio.to_thread(fake.step_entered.wait, 10)
        queued = [e.stats().commands_queued + 1 for e in pool.engines]
        aborting = asyncio.ensure_future(
            pool.abort([streams[0].request_id, streams[1].request_id, "unknown"])
        )
        for _ in range(100):
            await asyncio.sleep(0)
            if [e.stats().commands_queued for e in pool.engines] == queued:
                break
        for fake in fakes:
            fake.gate.set()
        await aborting
        for stream in streams[:2]:
            assert (await stream).outputs[0].finish_reason == "abort"
        for stream in streams[2:]:
            assert (await stream).outputs[0].finish_reason == "length"
        aborted = [[line for line in fake.log if line.startswith("abort")] for fake in fakes]
        assert aborted == [[f"abort {streams[0].request_id}"], [f"abort {streams[1].request_id}"]]
        await pool.abort("finished long ago")


async def test_dead_engine_fails_only_its_own_requests() -> None:
    """One engine dying fails its streams only; the rest keep serving until all are dead."""
    async with fake_pool() as (pool, fakes):
        streams = [pool.generate(f"r{i}", FIVE) for i in range(4)]
        fakes[1].fail_with = RuntimeError("GPU 1 fell off the bus")
        fakes[1].gate.set()
        for stream in streams[1::2]:
            with pytest.raises(EngineDeadError, match="fell off the bus"):
                await stream
        assert pool.engines[1].errored
        later = [pool.generate(PREFIX + str(i), FIVE) for i in range(3)]
        assert where(pool, later) == [0, 0, 0]
        fakes[0].gate.set()
        for stream in streams[::2] + later:
            assert len((await stream).outputs[0].token_ids) == 5
        assert await pool.reset_prefix_cache() == [True, False]
        await pool.abort([s.request_id for s in streams])  # a dead engine is no error

        fakes[0].fail_with = RuntimeError("GPU 0 too")
        with pytest.raises(EngineDeadError, match="GPU 0 too"):
            await pool.generate("the last one", FIVE)
        with pytest.raises(EngineDeadError, match="every engine in the pool is dead"):
            pool.generate("nobody left")
        with pytest.raises(EngineDeadError, match="every engine in the pool is dead"):
            await pool.reset_prefix_cache()


async def test_pool_speaks_the_engines_control_api() -> None:
    """stats, check_health, pause/resume/is_paused apply to every live engine, as on one engine."""
    async with fake_pool(2) as (pool, fakes):
        for fake in fakes:
            fake.gate.set()
        long = [pool.generate(f"long {i}", SamplingParams(max_tokens=10**6)) for i in range(2)]
        assert set(where(pool, long)) == {0, 1}
        await pool.check_health(stall_timeout=60)
        await pool.pause_generation(mode="keep")
        assert await pool.is_paused()
        assert all([await engine.is_paused() for engine in pool.engines])
        stats = pool.stats()
        assert stats.paused and stats.requests_in_flight == 2
        assert stats.requests_in_flight == sum(e.stats().requests_in_flight for e in pool.engines)
        with pytest.raises(EngineHeldError):
            await pool.pause_generation(mode="wait")
        with pytest.raises(ValueError, match="mode must be one of"):
            await pool.pause_generation(mode="later")  # type: ignore[arg-type]
        await pool.resume_generation()
        assert not await pool.is_paused()
        await pool.pause_generation(mode="abort")
        finals = [await stream for stream in long]
        assert all(f.outputs[0].finish_reason == "abort" for f in finals)
        assert pool.stats().requests_aborted == 2
        await pool.resume_generation()


async def test_lifecycle_errors() -> None:
    """Not started, closed, and a failed start (which closes every engine) raise at once."""
    args = [EngineArgs(model="/no/such/model"), EngineArgs(model="/no/such/model/either")]
    pool = AsyncEnginePool.from_engine_args(args)
    with pytest.raises(EngineNotStartedError):
        pool.generate("too early")
    with pytest.raises(Exception) as info:
        await pool.start()
    assert not isinstance(info.value, EngineDeadError)
    with pytest.raises(EngineClosedError):
        pool.generate("after a failed start")
    await pool.aclose()  # idempotent
    with pytest.raises(ValueError):
        AsyncEnginePool([])
