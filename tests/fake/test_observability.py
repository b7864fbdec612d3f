"""Logs, per-request metrics, stats() and the progress-based health check."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine, EngineDeadError, EngineStalledError
from fakes import FakeEngine, hold_in_next_step


async def test_engine_dead_logged_once_with_traceback(logs: list[MutableMapping[str, Any]]) -> None:
    """A dying engine logs one "engine dead" event carrying the original exception."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    streams = [engine.generate(f"r{i}", SamplingParams(max_tokens=1000)) for i in range(3)]
    await engine.run_on_engine(lambda e: None)
    fake.fail_with = RuntimeError("kaput")
    for stream in streams:
        with pytest.raises(EngineDeadError):
            await stream
    await engine.aclose()
    dead = [e for e in logs if e["event"] == "engine dead"]
    assert len(dead) == 1
    assert isinstance(dead[0]["exc_info"], RuntimeError)
    assert dead[0]["log_level"] == "error"
    assert [e["event"] for e in logs][-1] == "engine closed"


async def test_check_health_detects_a_stalled_engine() -> None:
    """check_health(stall_timeout) raises EngineStalledError while a step hangs."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    await engine.check_health(stall_timeout=0.0)  # idle is not stalled
    stream = engine.generate("hang", SamplingParams(max_tokens=1000))
    await hold_in_next_step(engine, fake)
    await engine.check_health(stall_timeout=3600)  # not stalled for that long
    with pytest.raises(EngineStalledError, match="stalled"):
        await engine.check_health(stall_timeout=0.0)
    fake.gate.set()
    await engine.abort(stream.request_id)
    await engine.check_health(stall_timeout=0.0)  # nothing unfinished: not stalled
    await engine.aclose()


async def test_stats_count_a_scripted_workload() -> None:
    """stats() counts exactly the steps, outputs, finishes and aborts of a script."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    assert engine.stats().steps == 0
    a = engine.generate("a", SamplingParams(max_tokens=3))
    b = engine.generate("b", SamplingParams(max_tokens=3))
    await asyncio.gather(a, b)
    stats = engine.stats()
    assert (stats.steps, stats.outputs_delivered, stats.requests_finished) == (3, 6, 2)
    assert stats.requests_in_flight == 0 and stats.requests_aborted == 0
    assert stats.loops_served == 1 and stats.steps_per_second > 0

    async with engine.paused():
        c = engine.generate("c", SamplingParams(max_tokens=100))
        await engine.run_on_engine(lambda e: None)
        held = engine.stats()
    assert held.paused and held.requests_in_flight == 1
    await engine.abort(c.request_id)
    await c
    stats = engine.stats()
    assert stats.requests_aborted == 1 and stats.requests_finished == 3
    assert stats.requests_in_flight == 0 and stats.commands_queued == 0
    await engine.pause_generation(mode="abort")
    d = engine.generate("d", SamplingParams(max_tokens=2))
    await engine.run_on_engine(lambda e: None)
    assert engine.stats().requests_waiting == 1
    await engine.resume_generation()
    await d
    assert engine.stats().requests_waiting == 0
    await engine.aclose()


class _Stats:
    """Engine stats from another vLLM version: no preemption count."""

    first_token_ts = 0.0
    last_token_ts = 0.0
    scheduled_ts = 0.0


class _BrokenStats:
    """Engine stats whose every field raises."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"no {name}")


async def test_metrics_tolerate_other_engine_stats(logs: list[MutableMapping[str, Any]]) -> None:
    """Stats without a field, or whose fields raise, never keep a stream from ending."""
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    fake.metrics = _Stats()
    a, b = (engine.generate(r, SamplingParams(max_tokens=3)) for r in "ab")
    await asyncio.gather(a, b)
    assert a.metrics is not None and a.metrics.preemptions is None
    fake.metrics = _BrokenStats()
    c, d = (engine.generate(r, SamplingParams(max_tokens=3)) for r in "cd")
    outs = await asyncio.gather(c, d)
    assert all(o.finished for o in outs)
    assert any(e["event"] == "delivery failed" for e in logs)
    await engine.aclose()
