"""The worker thread kept off the model workers' cores (``_placement.py``), over the real engine.

Where vLLM's CPU backend bound the model worker to some of this process's
CPUs, the worker thread and vLLM's output thread run on the others, and the
caller's thread is left where it was. The fake-engine side (the opt-out, a
restart) is in tests/fake/test_placement.py.
"""

from __future__ import annotations

import asyncio
import os
from multiprocessing.process import BaseProcess

import psutil
import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine
from asynckv._worker._placement import PIN_AT
from support import first_outputs, worker_cpus

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS"
)

OURS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def _bound_to_one_of_ours(processes: list[BaseProcess]) -> frozenset[int]:
    # What vLLM's CPU backend did to the model worker: every descendant of the
    # engine's core processes whose CPUs are fewer than ours.
    bound: set[int] = set()
    for process in processes:
        assert process.pid is not None
        core = psutil.Process(process.pid)
        for member in [core, *core.children(recursive=True)]:
            cpus = frozenset(member.cpu_affinity())
            if cpus < OURS:
                bound |= cpus
    return frozenset(bound)


async def test_real_engine_worker_runs_off_the_model_cores_under_load(
    engine: AsyncEngine,
) -> None:
    """Under load, the worker and vLLM's output thread on the CPUs no model worker is
    bound to; with the requests done, back on every CPU; the caller's thread never moved."""
    worker = engine._worker  # the one look inside: whose threads to read
    bound = _bound_to_one_of_ours(worker.processes)
    frontend = (OURS - bound) if bound and OURS - bound else OURS
    output_thread = await engine.run_on_engine(
        lambda e: e.engine_core.output_queue_thread.native_id
    )
    assert worker.placement.frontend == (frontend if frontend != OURS else None)
    # ignore_eos: the tiny random model may draw its EOS token (it did on an H100), and the
    # check below is that every request ran to its end, not where the model stops.
    sixteen = SamplingParams(max_tokens=16, ignore_eos=True)
    streams = [engine.generate(f"Hello {i}", sixteen) for i in range(PIN_AT)]
    await first_outputs(streams)
    assert worker_cpus(engine) == frontend
    assert os.sched_getaffinity(output_thread) == frontend
    assert os.sched_getaffinity(0) == OURS  # the caller's thread is never moved
    finals = await asyncio.wait_for(asyncio.gather(*streams), 120)
    assert all(len(final.outputs[0].token_ids) == 16 for final in finals)
    # The last step left none in flight: every CPU again.
    assert worker_cpus(engine) == OURS
    assert os.sched_getaffinity(output_thread) == OURS
    assert worker.placement.cpus is None
