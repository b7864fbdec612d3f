"""Restart and resume on a fake engine: the policy, the resumed streams, and what waits meanwhile.

The real-engine tests (a SIGKILLed engine core) are in tests/reliability/test_kill_and_resume.py,
the pure rules (deaths in a window, the splice) in tests/unit/test_restart_rules.py; these pin
what a real engine can't be made to do at a chosen moment.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import MutableMapping
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.outputs import RequestOutput

from asynckv import (
    AsyncEngine,
    AsyncEnginePool,
    EngineClosedError,
    EngineDeadError,
    EngineRestartingError,
    RequestNotResumedError,
    RestartPolicy,
)
from fakes import FakeEngine

TWENTY = SamplingParams(max_tokens=20)


def failing_after(fake: FakeEngine, steps: int, error: BaseException) -> None:
    """Make ``fake``'s step raise ``error`` once ``steps`` steps have run."""
    step = fake.step
    count = 0

    def counted() -> list[RequestOutput]:
        nonlocal count
        count += 1
        if count > steps:
            raise error
        return step()

    fake.step = counted  # type: ignore[method-assign]


class GatedRebuild:
    """A ``rebuild`` that says when it starts (``building``) and returns only on ``release``."""

    def __init__(self) -> None:
        self.building, self.release = threading.Event(), threading.Event()
        self.engine = FakeEngine()  # the engine it builds

    def __call__(self) -> FakeEngine:
        self.building.set()
        self.release.wait(10)
        return self.engine


def restarting() -> tuple[AsyncEngine, GatedRebuild]:
    """An engine whose fake fails at its fourth step ("device lost"), rebuilt only on release."""
    first = FakeEngine()
    failing_after(first, 3, OSError("device lost"))
    rebuild = GatedRebuild()
    return AsyncEngine(first, rebuild=rebuild), rebuild


def test_policy_checks_its_arguments() -> None:
    """A negative max_restarts or a non-positive window is refused."""
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="window"):
        RestartPolicy(window=0)
    with pytest.raises(ValueError, match="rebuild"):
        AsyncEngine(FakeEngine(), restart=RestartPolicy())


async def test_raising_step_restarts_and_resumes(logs: list[MutableMapping[str, Any]]) -> None:
    """A raising step(): the engine is rebuilt and every stream continues from its last token."""
    first, second = FakeEngine(), FakeEngine()
    failing_after(first, 5, OSError("device lost"))
    engine = AsyncEngine(first, rebuild=lambda: second)
    first.gate.clear()  # so that all five are in before the death
    streams = [engine.generate(f"r{i}", TWENTY, request_id=f"r{i}") for i in range(5)]
    first.gate.set()
    finals = await asyncio.wait_for(asyncio.gather(*streams), 10)
    for final in finals:
        (completion,) = final.outputs
        assert completion.token_ids == list(range(20))
        assert completion.finish_reason == "length"
        assert final.prompt_token_ids == [1]
    # The new engine got each request as its continuation: the prompt, then 5 tokens.
    assert second.log.count("add r0") == 1
    assert all(s.metrics is not None and s.metrics.restarts == 1 for s in streams)
    assert engine.stats().restarts == 1
    assert first.shut_down.is_set()
    (event,) = [e for e in logs if e["event"] == "engine restarted"]
    assert event["cause"] == "OSError: device lost"
    assert event["requests_resumed"] == 5
    assert event["downtime"] >= 0
    await engine.aclose()


async def test_beyond_the_policy_every_stream_ends_naming_each_death() -> None:
    """More deaths within the window than max_restarts: EngineDeadError naming every death."""
    fakes = [FakeEngine() for _ in range(3)]
    for i, fake in enumerate(fakes):
        failing_after(fake, 2, OSError(f"death {i + 1}"))
    rebuilt = iter(fakes[1:])
    engine = AsyncEngine(
        fakes[0], rebuild=lambda: next(rebuilt), restart=RestartPolicy(max_restarts=1)
    )
    fakes[0].gate.clear()  # so that all three are in before the first death
    streams = [engine.generate(f"r{i}", TWENTY) for i in range(3)]
    fakes[0].gate.set()
    for stream in streams:
        with pytest.raises(EngineDeadError) as info:
            await asyncio.wait_for(stream, 10)
        error = info.value
        assert [str(d) for d in error.deaths] == ["death 1", "death 2"]
        assert "died 2 times" in str(error)
        assert "1) OSError: death 1; 2) OSError: death 2" in str(error)
        assert error.__cause__ is error.deaths[-1]
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    await engine.aclose()


async def test_failed_rebuild_ends_everything() -> None:
    """A rebuild that raises ends every stream with EngineDeadError naming both failures."""
    first = FakeEngine()
    failing_after(first, 2, OSError("device lost"))

    def rebuild() -> FakeEngine:
        raise RuntimeError("no memory for a new engine")

    engine = AsyncEngine(first, rebuild=rebuild)
    with pytest.raises(EngineDeadError, match="no memory for a new engine") as info:
        await asyncio.wait_for(engine.generate("r", TWENTY), 10)
    assert "OSError: device lost" in str(info.value)
    await engine.aclose()


async def test_commands_during_a_restart_wait_then_proceed() -> None:
    """While rebuilding: check_health says restarting; new requests and calls wait, then run."""
    engine, rebuild = restarting()
    building, release, second = rebuild.building, rebuild.release, rebuild.engine
    before = engine.generate("before", TWENTY)
    assert await asyncio.to_thread(building.wait, 10)
    with pytest.raises(EngineRestartingError, match="restarting after OSError: device lost"):
        await engine.check_health()
    after = engine.generate("after", SamplingParams(max_tokens=3))
    on_engine = asyncio.ensure_future(engine.run_on_engine(lambda e: e))
    await asyncio.sleep(0.05)  # they reach the inbox (nothing could answer them yet)
    assert not on_engine.done()
    assert engine.stats().requests_in_flight == 1
    release.set()
    assert await asyncio.wait_for(on_engine, 10) is second
    assert (await after).outputs[0].token_ids == [0, 1, 2]
    assert (await before).outputs[0].token_ids == list(range(20))
    await engine.check_health()
    await engine.aclose()


async def test_structured_outputs_are_not_resumed() -> None:
    """A request whose sampling needs replayed state ends with RequestNotResumedError."""
    first, second = FakeEngine(), FakeEngine()
    failing_after(first, 3, OSError("device lost"))
    engine = AsyncEngine(first, rebuild=lambda: second)
    first.gate.clear()
    penalised = engine.generate("p", SamplingParams(max_tokens=20, presence_penalty=0.5))
    plain = engine.generate("q", TWENTY)
    first.gate.set()
    with pytest.raises(RequestNotResumedError, match="presence or frequency") as info:
        await asyncio.wait_for(penalised, 10)
    assert isinstance(info.value.__cause__, OSError)
    assert (await plain).outputs[0].token_ids == list(range(20))
    await engine.aclose()


async def test_abort_of_a_resumed_request() -> None:
    """Aborting a resumed request ends it with "abort" and takes it out of the new engine."""
    first, second = FakeEngine(), FakeEngine()
    failing_after(first, 3, OSError("device lost"))
    engine = AsyncEngine(first, rebuild=lambda: second)
    stream = engine.generate("a", SamplingParams(max_tokens=10**6), request_id="a")
    async for out in stream:
        if len(out.outputs[0].token_ids) > 6:
            break
    await engine.abort("a")
    await stream.aclose()
    assert "abort a" in second.log
    assert await engine.run_on_engine(lambda e: e.get_num_unfinished_requests()) == 0
    await engine.aclose()


async def test_pool_fails_over_and_the_member_rejoins() -> None:
    """A pool member dies: its requests resume on the live member; it rebuilds, then rejoins."""
    dying, spare = FakeEngine(), FakeEngine()
    failing_after(dying, 3, OSError("device lost"))
    rebuild = GatedRebuild()
    building, release = rebuild.building, rebuild.release

    pool = AsyncEnginePool(
        [AsyncEngine(dying, rebuild=rebuild), AsyncEngine(spare, rebuild=FakeEngine)]
    )
    dying.gate.clear()
    spare.gate.clear()
    streams = {f"r{i}": pool.generate(f"r{i}", TWENTY, request_id=f"r{i}") for i in range(4)}
    endless = pool.generate("e", SamplingParams(max_tokens=10**6), request_id="endless")
    on_dying = [rid for rid in [*streams, "endless"] if pool.engine_of(rid) == 0]
    assert "endless" in on_dying and len(on_dying) == 3  # least loaded first, in turn
    dying.gate.set()
    spare.gate.set()
    assert await asyncio.to_thread(building.wait, 10)
    assert pool.engines[0].restarting
    # While member 0 rebuilds, its requests run on member 1, and new ones go there too.
    for rid, stream in streams.items():
        assert (await stream).outputs[0].token_ids == list(range(20)), rid
        assert stream.metrics is not None
        assert stream.metrics.restarts == (1 if rid in on_dying else 0)
    assert all(f"add {rid}" in spare.log for rid in on_dying)
    assert pool.engine_of("endless") == 1
    later = pool.generate("later", TWENTY, request_id="later")
    assert pool.engine_of("later") == 1
    await endless.aclose()  # its abort follows it to member 1
    assert "abort endless" in spare.log
    with pytest.raises(EngineRestartingError):
        await pool.check_health()
    release.set()
    assert (await later).outputs[0].token_ids == list(range(20))
    await pool.engines[0].run_on_engine(lambda e: None)  # rebuilt and serving
    assert not pool.engines[0].restarting
    await pool.check_health()
    assert pool.stats().restarts == 1
    rejoined = [pool.generate(f"j{i}", TWENTY, request_id=f"j{i}") for i in range(4)]
    assert {pool.engine_of(f"j{i}") for i in range(4)} == {0, 1}
    await asyncio.gather(*rejoined)
    await pool.aclose()


async def test_close_during_a_restart() -> None:
    """aclose() while rebuilding: streams end with EngineClosedError; the new engine is shut."""
    engine, rebuild = restarting()
    building, release, second = rebuild.building, rebuild.release, rebuild.engine
    stream = engine.generate("r", TWENTY)
    assert await asyncio.to_thread(building.wait, 10)
    closing = asyncio.ensure_future(engine.aclose(timeout=10))
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(stream, 10)
    release.set()
    await asyncio.wait_for(closing, 10)
    assert await asyncio.to_thread(second.shut_down.wait, 10)
    assert second.log == []  # nothing was re-added to an engine that was closed


async def test_abort_during_a_restart() -> None:
    """A stream closed while the engine is rebuilt ends; its request leaves the new engine."""
    engine, rebuild = restarting()
    building, release, second = rebuild.building, rebuild.release, rebuild.engine
    leaving = engine.generate("leaving", SamplingParams(max_tokens=10**6), request_id="leaving")
    staying = engine.generate("staying", TWENTY)
    assert await asyncio.to_thread(building.wait, 10)
    closed = asyncio.ensure_future(leaving.aclose())
    await asyncio.sleep(0.05)  # the abort reaches the inbox; nothing can answer it yet
    release.set()
    await asyncio.wait_for(closed, 10)
    assert (await staying).outputs[0].token_ids == list(range(20))
    assert "abort leaving" in second.log
    assert await engine.run_on_engine(lambda e: e.get_num_unfinished_requests()) == 0
    await engine.aclose()


# -- vLLM's fault-tolerance calls read the restarts (issue 30) -------------------------


def _retry(request_id: str) -> Any:
    from vllm.v1.fault_tolerance.utils import FaultToleranceRequest

    return FaultToleranceRequest(instruction="retry", params={}, request_id=request_id)


def _status(status: str, **extra: str) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "total_engines": 1,
        "engines": [{"id": 0, "status": status, **extra}],
    }


async def test_fault_status_follows_a_restart() -> None:
    """get_status: healthy, unhealthy while rebuilt; a "retry" then waits for the rebuild."""
    engine, rebuild = restarting()
    assert await engine.get_status() == _status("healthy")
    refused = await engine.handle_fault(_retry("ft-1"))
    assert not refused.success
    assert refused.reason == "[FT] Rejecting retry on engine 0: status is HEALTHY"
    assert await engine.get_status() == _status(
        "healthy", last_ft_request_id="ft-1", ft_error=refused.reason
    )
    stream = engine.generate("r", TWENTY)
    assert await asyncio.to_thread(rebuild.building.wait, 10)
    status = await engine.get_status()
    entry = status["engines"][0]
    assert (entry["status"], entry["fault_info"], entry["last_ft_request_id"]) == (
        "unhealthy",
        "OSError",
        "ft-1",  # the last refusal stays, as in vLLM's client
    )
    retry = asyncio.ensure_future(engine.handle_fault(_retry("ft-2")))
    await asyncio.sleep(0)  # one pass of the loop: the retry reads the status, then waits
    rebuild.release.set()
    result = await asyncio.wait_for(retry, 10)
    assert (result.request_id, result.success, result.reason) == ("ft-2", True, None)
    assert (await engine.get_status())["engines"][0]["status"] == "healthy"
    assert (await stream).outputs[0].token_ids == list(range(20))
    await engine.aclose()
    with pytest.raises(EngineClosedError):
        await engine.get_status()


async def test_fault_status_of_a_dead_engine() -> None:
    """Beyond the policy the status is "dead", and check_health raises vLLM's EngineDeadError."""
    from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

    first = FakeEngine()
    failing_after(first, 2, OSError("device lost"))

    def rebuild() -> FakeEngine:
        raise RuntimeError("no memory for a new engine")

    engine = AsyncEngine(first, rebuild=rebuild)
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(engine.generate("r", TWENTY), 10)
    assert await engine.get_status() == _status("dead")
    result = await engine.handle_fault(_retry("ft-dead"))
    assert not result.success and result.reason.endswith("status is DEAD")
    with pytest.raises(VllmEngineDeadError):
        await engine.check_health()
    await engine.aclose()


async def test_check_health_raises_whenever_errored(monkeypatch: pytest.MonkeyPatch) -> None:
    """As AsyncLLM's: with ``errored`` true (patched), check_health raises EngineDeadError."""
    from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

    engine = AsyncEngine(FakeEngine())
    await engine.check_health()
    with monkeypatch.context() as patched:
        patched.setattr(AsyncEngine, "errored", property(lambda self: True))
        with pytest.raises(VllmEngineDeadError):
            await engine.check_health()
    await engine.check_health()
    await engine.aclose()
