"""Planned restarts, drains and rolling restarts on fake engines: who moves where, and when.

The real-engine tests (token-identical greedy streams through a roll and a
planned restart) are in tests/reliability/test_rolling.py; these pin the
moments a real engine can't be stopped at, and the calls that fail at once.
"""

from __future__ import annotations

import asyncio

import pytest
from vllm import SamplingParams

from asynckv import (
    AsyncEngine,
    AsyncEnginePool,
    Drained,
    EngineClosedError,
    EngineRestartingError,
    RestartPolicy,
)
from fakes import FakeEngine, hold_in_next_step

LONG = SamplingParams(max_tokens=200)


def pool_of_two() -> tuple[AsyncEnginePool, list[FakeEngine]]:
    """Two fake members with a restart policy; each rebuild makes a fresh fake."""
    fakes = [FakeEngine(), FakeEngine()]
    engines = [AsyncEngine(fake, rebuild=FakeEngine) for fake in fakes]
    return AsyncEnginePool(engines), fakes


async def test_planned_restart_resumes_every_stream_and_is_no_death() -> None:
    """restart() between two steps: every stream goes on from its last token; no death counted."""
    first, second = FakeEngine(), FakeEngine()
    engine = AsyncEngine(first, rebuild=lambda: second, restart=RestartPolicy(max_restarts=0))
    streams = [engine.generate(f"r{i}", LONG, request_id=f"r{i}") for i in range(4)]
    await hold_in_next_step(engine, first)
    restart = asyncio.create_task(engine.restart())
    await asyncio.sleep(0)  # the Restart is in the inbox, behind the held step
    later = engine.generate("later", LONG, request_id="later")  # applied on the new engine
    first.gate.set()
    await asyncio.wait_for(restart, 10)
    assert first.shut_down.is_set()
    assert not engine.restarting
    await engine.check_health()
    finals = await asyncio.wait_for(asyncio.gather(*streams, later), 10)
    for final in finals:
        assert final.outputs[0].token_ids == list(range(200))
    assert all(s.metrics is not None and s.metrics.restarts == 1 for s in streams)
    assert "add later" in second.log and "add later" not in first.log
    assert engine.stats().restarts == 1
    # max_restarts=0: a planned restart is not a death, so another one is allowed.
    await asyncio.wait_for(engine.restart(), 10)
    assert engine.stats().restarts == 2
    await engine.aclose()


async def test_restart_refuses_what_it_cannot_do() -> None:
    """No policy, overrides of a wrapped engine, a closed engine: each fails at once."""
    plain = AsyncEngine(FakeEngine())
    with pytest.raises(ValueError, match="RestartPolicy"):
        await plain.restart()
    await plain.aclose()
    engine = AsyncEngine(FakeEngine(), rebuild=FakeEngine)
    with pytest.raises(TypeError, match="from_engine_args"):
        await engine.restart(max_num_seqs=4)
    await engine.aclose()
    with pytest.raises(EngineClosedError):
        await engine.restart()


async def test_check_health_during_a_planned_restart() -> None:
    """While the planned rebuild runs, the engine is restarting (not dead); then healthy."""
    release = asyncio.Event()
    building = asyncio.Event()
    loop = asyncio.get_running_loop()

    def rebuild() -> FakeEngine:
        loop.call_soon_threadsafe(building.set)
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
        return FakeEngine()

    engine = AsyncEngine(FakeEngine(), rebuild=rebuild)
    restart = asyncio.create_task(engine.restart())
    await asyncio.wait_for(building.wait(), 10)
    assert engine.restarting
    with pytest.raises(EngineRestartingError, match="restarting"):
        await engine.check_health()
    assert (await engine.get_status())["engines"][0]["status"] == "unhealthy"
    release.set()
    await asyncio.wait_for(restart, 10)
    await engine.check_health()
    await engine.aclose()


async def test_drain_hands_over_between_two_steps() -> None:
    """drain(0): member 0's streams continue on member 1 from their last token; new ones too."""
    pool, (zero, one) = pool_of_two()
    streams = {f"r{i}": pool.generate(f"r{i}", LONG, request_id=f"r{i}") for i in range(4)}
    on_zero = {rid for rid in streams if pool.engine_of(rid) == 0}
    assert len(on_zero) == 2
    await hold_in_next_step(pool.engines[0], zero)
    drain = asyncio.create_task(pool.drain(0))
    await asyncio.sleep(0)
    new = pool.generate("new", LONG, request_id="new")
    assert pool.engine_of("new") == 1  # a drained member takes no new request
    zero.gate.set()
    drained = await asyncio.wait_for(drain, 10)
    assert isinstance(drained, Drained) and drained.index == 0
    assert set(drained.moved) == on_zero and drained.stayed == ()
    assert all(f"abort {rid}" in zero.log for rid in on_zero)
    assert all(pool.engine_of(rid) == 1 for rid in on_zero)
    for rid, stream in streams.items():
        assert (await asyncio.wait_for(stream, 10)).outputs[0].token_ids == list(range(200))
        assert stream.metrics is not None
        assert stream.metrics.restarts == (1 if rid in on_zero else 0)
    assert all(f"add {rid}" in one.log for rid in on_zero)
    await new
    assert pool.engines[0].stats().requests_in_flight == 0
    pool.readmit(0)
    back = [pool.generate(f"b{i}", LONG, request_id=f"b{i}") for i in range(2)]
    assert {pool.engine_of(f"b{i}") for i in range(2)} == {0, 1}
    await asyncio.gather(*back)
    await pool.aclose()


async def test_a_moved_stream_aborts_where_it_went() -> None:
    """A stream moved twice (0 -> 1 -> 0) is still aborted by its own aclose()."""
    pool, (zero, one) = pool_of_two()
    endless = SamplingParams(max_tokens=10**6)
    stream = pool.generate("e", endless, request_id="e")
    assert pool.engine_of("e") == 0
    async with pool.draining(0):
        assert pool.engine_of("e") == 1
    async with pool.draining(1):
        assert pool.engine_of("e") == 0
    await pool.engines[0].run_on_engine(lambda e: None)  # after the Adopt, in FIFO order
    assert zero.log.count("add e") == 2
    await stream.aclose()
    await pool.engines[0].run_on_engine(lambda e: None)  # the abort was applied before this
    assert zero.log.count("abort e") == 2 and one.log.count("abort e") == 1
    assert pool.stats().requests_in_flight == 0
    await pool.aclose()


async def test_drain_without_handoff_lets_them_finish_in_place() -> None:
    """handoff=False: the member's requests finish there; the drain returns once they have."""
    pool, (_, one) = pool_of_two()
    streams = [pool.generate(f"r{i}", LONG, request_id=f"r{i}") for i in range(4)]
    on_zero = {f"r{i}" for i in range(4) if pool.engine_of(f"r{i}") == 0}
    drained = await asyncio.wait_for(pool.drain(0, handoff=False), 10)
    assert drained.moved == () and set(drained.stayed) == on_zero
    assert not any(f"add {rid}" in one.log for rid in on_zero)
    await asyncio.gather(*streams)
    pool.readmit(0)
    await pool.aclose()


async def test_drain_calls_that_cannot_complete_fail_at_once() -> None:
    """Unknown index, a second drain, handoff with no member to take them or no policy."""
    pool, _ = pool_of_two()
    with pytest.raises(IndexError):
        await pool.drain(2)
    with pytest.raises(TypeError):
        await pool.drain("0")  # type: ignore[arg-type]
    await pool.drain(0)
    with pytest.raises(ValueError, match="already"):
        await pool.drain(0)
    with pytest.raises(ValueError, match="no live member"):
        await pool.drain(1)
    # Every live member drained: the pool refuses as a draining engine does.
    await pool.drain(1, handoff=False)
    with pytest.raises(EngineClosedError):
        pool.generate("x", LONG)
    pool.readmit(0)
    pool.readmit(1)
    pool.readmit(1)  # a no-op
    await pool.aclose()
    plain = AsyncEnginePool([AsyncEngine(FakeEngine()), AsyncEngine(FakeEngine())])
    with pytest.raises(ValueError, match="RestartPolicy"):
        await plain.drain(0)
    with pytest.raises(ValueError, match="RestartPolicy"):
        await plain.rolling(lambda e: e.reset_prefix_cache())
    assert (await plain.drain(0, handoff=False)).moved == ()
    await plain.aclose()
    single = AsyncEnginePool([AsyncEngine(FakeEngine(), rebuild=FakeEngine)])
    with pytest.raises(ValueError, match="no live member"):
        await single.drain(0)
    await single.aclose()


async def test_a_drain_that_times_out_readmits_the_member() -> None:
    """A drain cut short by its timeout routes to the member again before raising."""
    pool, (zero, _) = pool_of_two()
    stream = pool.generate("r", LONG, request_id="r")
    await hold_in_next_step(pool.engines[0], zero)
    with pytest.raises(TimeoutError):
        await pool.drain(0, handoff=False, timeout=0.05)
    zero.gate.set()
    await stream
    await pool.drain(0, handoff=False)  # readmitted: it can be drained again
    await pool.aclose()


async def test_rolling_restart_keeps_every_stream() -> None:
    """rolling(restart): each member is drained, rebuilt, readmitted; every stream is exact."""
    pool, fakes = pool_of_two()
    for fake in fakes:
        fake.gate.clear()  # each member's first step waits: the roll begins mid-stream
    many = SamplingParams(max_tokens=2000)
    streams = [pool.generate(f"r{i}", many, request_id=f"r{i}") for i in range(6)]
    seen: list[int] = []

    async def restart(engine: AsyncEngine) -> None:
        seen.append(pool.engines.index(engine))
        await engine.restart()

    roll = asyncio.create_task(pool.rolling(restart))
    await asyncio.sleep(0)
    for fake in fakes:
        fake.gate.set()
    records = await asyncio.wait_for(roll, 10)
    assert seen == [0, 1] and [r.index for r in records] == [0, 1]
    for stream in streams:
        assert (await asyncio.wait_for(stream, 10)).outputs[0].token_ids == list(range(2000))
        assert stream.metrics is not None and stream.metrics.restarts >= 1
    assert [e.stats().restarts for e in pool.engines] == [1, 1]
    assert all(fake.shut_down.is_set() for fake in fakes)
    await pool.aclose()
