"""Prefix-cache resets and pauses, applied at step boundaries on the real engine.

Every test runs on asyncio and on trio (anyio's plugin, ``anyio_backend``).
"""

from __future__ import annotations

import anyio
import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine
from support import unfinished

pytestmark = pytest.mark.anyio

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT = "A robot may not injure a human being " * 6


async def test_reset_when_idle(engine: AsyncEngine) -> None:
    """With nothing running, a reset succeeds."""
    await engine.generate(PROMPT, GREEDY)
    assert await engine.reset_prefix_cache() is True


async def test_reset_refused_while_requests_run(engine: AsyncEngine) -> None:
    """Running requests hold blocks: a plain reset returns False and they finish normally."""
    stream = engine.generate(PROMPT, GREEDY)
    async for _ in stream:
        assert await engine.reset_prefix_cache() is False
        break
    # The break aborted it; the next request still runs normally.
    out = await engine.generate(PROMPT, GREEDY)
    assert len(out.outputs[0].token_ids) == 24


async def test_reset_running_requests_keeps_greedy_tokens(engine: AsyncEngine) -> None:
    """A reset that preempts running requests leaves their greedy tokens unchanged."""
    prompts = [PROMPT + str(i) for i in range(4)]
    reference = [await engine.generate(p, GREEDY) for p in prompts]
    assert await engine.reset_prefix_cache() is True

    streams = [engine.generate(p, GREEDY) for p in prompts]
    async with engine.paused(at_step=engine.step_count + 5):
        assert await engine.reset_prefix_cache(reset_running_requests=True) is True
    outs = [await s for s in streams]
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        list(r.outputs[0].token_ids) for r in reference
    ]
    assert await unfinished(engine) == 0


async def test_paused_at_step_applies_commands_at_that_boundary(
    engine: AsyncEngine,
) -> None:
    """Inside ``paused(at_step=k)`` exactly k steps are done and commands apply there."""
    stream = engine.generate(PROMPT, SamplingParams(max_tokens=60, ignore_eos=True))
    target = engine.step_count + 4
    async with engine.paused(at_step=target) as step:
        assert step == target
        assert engine.step_count == target
        seen = await engine.run_on_engine(lambda e: e.get_num_unfinished_requests())
        added = engine.generate("added in the pause", SamplingParams(max_tokens=3))
        seen_after_add = await engine.run_on_engine(lambda e: e.get_num_unfinished_requests())
        assert engine.step_count == target
    assert (seen, seen_after_add) == (1, 2)
    assert len((await added).outputs[0].token_ids) == 3
    assert (await stream).outputs[0].finish_reason == "length"


async def test_paused_at_passed_step_raises(engine: AsyncEngine) -> None:
    """``paused(at_step=k)`` for a step already passed raises ValueError."""
    await engine.generate(PROMPT, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="has passed"):
        async with engine.paused(at_step=0):
            pass


async def test_pause_abort_mode(engine: AsyncEngine) -> None:
    """Mode "abort" ends in-flight requests with "abort"; later ones wait for resume."""
    running = engine.generate(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    await engine.run_on_engine(lambda e: None)
    await engine.pause_generation(mode="abort")
    assert await engine.is_paused()
    assert (await running).outputs[0].finish_reason == "abort"
    waiting = engine.generate(
        "submitted while paused", SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert await unfinished(engine) == 0  # parked, not admitted
    await engine.resume_generation()
    assert not await engine.is_paused()
    assert len((await waiting).outputs[0].token_ids) == 4


async def test_one_abort_of_several_parked_requests(engine: AsyncEngine) -> None:
    """One ``abort()`` of several parked ids ends exactly those; the others run on resume."""
    await engine.pause_generation(mode="abort")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    streams = [engine.generate(f"parked {i}", params) for i in range(5)]
    doomed = [streams[i].request_id for i in (0, 2, 3)]
    await engine.abort([*doomed, "unknown", doomed[0]])
    await engine.resume_generation()
    outcomes = [(await s).outputs[0] for s in streams]
    assert [o.finish_reason for o in outcomes] == ["abort", "length", "abort", "abort", "length"]
    assert [len(o.token_ids) for o in outcomes] == [0, 4, 0, 0, 4]
    assert await unfinished(engine) == 0


async def test_pause_wait_mode(engine: AsyncEngine) -> None:
    """Mode "wait" returns once in-flight requests have finished normally."""
    running = engine.generate(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    await engine.run_on_engine(lambda e: None)
    await engine.pause_generation(mode="wait")
    assert running.finished
    assert (await running).outputs[0].finish_reason == "length"
    waiting = engine.generate(
        "submitted while paused", SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert await unfinished(engine) == 0
    await engine.resume_generation()
    assert len((await waiting).outputs[0].token_ids) == 4


async def test_pause_keep_mode(engine: AsyncEngine) -> None:
    """Mode "keep" freezes in-flight requests; on resume they finish with all their tokens."""
    reference = await engine.generate(PROMPT, GREEDY)
    running = engine.generate(PROMPT, GREEDY)
    await engine.run_on_engine(lambda e: None)
    await engine.pause_generation(mode="keep", clear_cache=True)
    frozen_at = engine.step_count
    assert await unfinished(engine) == 1
    assert engine.step_count == frozen_at
    assert not running.finished
    # The engine-core process, which steps on its own, is frozen too.
    assert await engine.run_on_engine(lambda e: e.engine_core.call_utility("is_scheduler_paused"))
    await engine.resume_generation()
    assert not await engine.run_on_engine(
        lambda e: e.engine_core.call_utility("is_scheduler_paused")
    )
    out = await running
    assert list(out.outputs[0].token_ids) == list(reference.outputs[0].token_ids)


async def test_invalid_pause_mode(engine: AsyncEngine) -> None:
    """An unknown pause mode is refused before anything changes."""
    with pytest.raises(ValueError, match="mode must be one of"):
        await engine.pause_generation(mode="later")  # type: ignore[arg-type]
    assert not await engine.is_paused()


async def test_step_count_advances(engine: AsyncEngine) -> None:
    """Each output step advances ``step_count``."""
    before = engine.step_count
    await engine.generate("count", SamplingParams(max_tokens=5, ignore_eos=True))
    assert engine.step_count >= before + 5


async def test_commands_do_not_wait_for_the_cores_next_output(engine: AsyncEngine) -> None:
    """With the engine-core process silent, commands and new requests are still served.

    The worker waits for a command *or* the core's next output, never inside a
    blocking ``step()``: here the core's own scheduler is frozen behind the
    worker's back, so no output comes while a request is unfinished. (Before,
    the worker sat in ``step()`` and this command was never answered.)
    """
    from asynckv._vllm import pause_core_scheduler, resume_core_scheduler

    stream = engine.generate(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
    first = aiter(stream)  # kept: dropping an unfinished iterator aborts its request
    await anext(first)
    assert await engine.run_on_engine(lambda e: pause_core_scheduler(e, clear_cache=False))
    try:
        # No output comes now. (The timeout only keeps a regression from hanging the suite.)
        with anyio.fail_after(60):
            assert await engine.run_on_engine(lambda e: e.get_num_unfinished_requests()) == 1
        late = engine.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True))
        with anyio.fail_after(60):
            assert await engine.run_on_engine(lambda e: e.get_num_unfinished_requests()) == 2
    finally:
        await engine.run_on_engine(resume_core_scheduler)
    assert len((await late).outputs[0].token_ids) == 4
    await stream.aclose()
    assert await unfinished(engine) == 0
