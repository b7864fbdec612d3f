"""The worker thread kept off the model workers' cores (``_placement.py``), over the fake engine.

With a stand-in core process bound to one CPU (what a real engine's worker
gets at start, but no engine does on demand): the opt-out, and a restart,
which gives the worker thread its CPUs back before the next engine is built.
The real engine's placement is in tests/engine/test_placement_engine.py.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections.abc import Iterator
from multiprocessing.process import BaseProcess
from types import SimpleNamespace

import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine
from asynckv._worker._placement import PIN_AT, UNPIN_AT
from fakes import FakeEngine
from support import first_outputs, worker_cpus

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS"
)

OURS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
HUNDRED = SamplingParams(max_tokens=100)
ENDLESS = SamplingParams(max_tokens=10**6)


@pytest.fixture
def bound_core() -> Iterator[BaseProcess]:
    """A stand-in engine-core process, bound to one of our CPUs as vLLM binds its worker."""
    if len(OURS) < 2:
        pytest.skip("needs two CPUs: one bound, one left")
    core = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    core.start()
    assert core.pid is not None
    os.sched_setaffinity(core.pid, {min(OURS)})
    yield core
    core.kill()
    core.join(10)


def _fake_with(core: BaseProcess) -> FakeEngine:
    fake = FakeEngine()
    fake.engine_core.resources = SimpleNamespace(engine_manager=SimpleNamespace(processes=[core]))
    return fake


async def test_fake_engine_kept_off_under_load_only_and_opt_out(bound_core: BaseProcess) -> None:
    """Kept off the bound CPU from PIN_AT requests in flight, not with fewer, back after;
    ``keep_off_model_cores=False`` never moves it."""
    kept = AsyncEngine(_fake_with(bound_core))
    left = AsyncEngine(_fake_with(bound_core), keep_off_model_cores=False)
    try:
        few = [kept.generate(f"f{i}", HUNDRED) for i in range(UNPIN_AT)]
        await first_outputs(few)
        assert worker_cpus(kept) == OURS  # a light load: left free
        # Too long to finish before the check: only the aclose below ends them.
        many = [kept.generate(f"m{i}", ENDLESS) for i in range(PIN_AT)]
        others = [left.generate(f"o{i}", HUNDRED) for i in range(PIN_AT)]
        await first_outputs(many + others)
        assert worker_cpus(kept) == OURS - {min(OURS)}
        assert worker_cpus(left) == OURS
        for stream in many:
            await stream.aclose()
        await asyncio.wait_for(asyncio.gather(*few, *others), 10)
        assert worker_cpus(kept) == OURS  # the aborts left UNPIN_AT or fewer in flight
        assert os.sched_getaffinity(0) == OURS
    finally:
        await kept.aclose()
        await left.aclose()


async def test_restart_builds_the_next_engine_with_every_cpu(bound_core: BaseProcess) -> None:
    """A death under load: the worker gets every CPU back before the rebuild (the new
    engine's processes inherit them), and is kept off the bound CPU again after."""
    first, second = _fake_with(bound_core), _fake_with(bound_core)
    seen: list[set[int]] = []

    def rebuild() -> FakeEngine:
        seen.append(os.sched_getaffinity(0))  # on the worker thread, where processes start
        return second

    engine = AsyncEngine(first, rebuild=rebuild)
    try:
        # Endless: only the aclose below ends them, so the load can't end before a check.
        streams = [engine.generate(f"r{i}", ENDLESS) for i in range(PIN_AT)]
        hundred = engine.generate("hundred", HUNDRED)  # ends whole, restart or not
        await first_outputs([*streams, hundred])
        assert worker_cpus(engine) == OURS - {min(OURS)}
        first.fail_with = OSError("device lost")

        async def until_restarted() -> None:
            while engine.stats().restarts == 0:
                await anext(streams[0])

        await asyncio.wait_for(until_restarted(), 20)
        final = await asyncio.wait_for(hundred, 20)
        assert len(final.outputs[0].token_ids) == 100
        assert engine.stats().restarts == 1
        assert seen == [OURS]
        # A new request's first output comes from a step of the next engine with every
        # continued stream still in flight: kept off the bound CPU again.
        after = engine.generate("after", ENDLESS)
        await asyncio.wait_for(anext(after), 20)
        assert worker_cpus(engine) == OURS - {min(OURS)}
        for stream in [*streams, after]:
            await stream.aclose()
        assert worker_cpus(engine) == OURS  # the aborts ended the load
    finally:
        await engine.aclose()
