"""The facade over vLLM's multiprocess executor with tensor parallelism (TP=2) on CPU.

The TP=2 engine runs one engine-core process that drives two model-worker
processes; the facade sees one ``LLMEngine`` either way. Its greedy tokens are
checked against a TP=1 engine built from the same arguments but the parallelism.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine, EngineDeadError
from support import (
    assert_delta_adds_up,
    assert_reset_keeps_a_running_request,
    assert_same_greedy_tokens,
    drained,
    engine_args,
    result,
    start_engine,
)

# Two tensor-parallel ranks need two devices: here, two CPU ranks; the device tool lends one GPU.
pytestmark = [pytest.mark.engine, pytest.mark.cpu_only]

GREEDY = {"temperature": 0.0, "ignore_eos": True}
# Both engines compute in float32. In bfloat16 (the model's own dtype) TP=2 sums
# each layer's two halves in another order than TP=1, and where the top two
# logits of the random tiny model lie within a rounding step the argmax flips
# (seen here: gaps of 0.06 and 0.125 in logprob); in float32 it never does.
FLOAT32 = {"dtype": "float32"}
PROMPTS = (
    "To be or not to be,",
    "It was the best of times, it was the worst of times,",
    "Call me Ishmael.",
    "In the beginning",
    "The quick brown fox jumps over the lazy dog",
)


@pytest.fixture(scope="module")
def tp1_engine(model_path: Path) -> Iterator[AsyncEngine]:
    """The reference: the same engine without tensor parallelism."""
    started = start_engine(engine_args(model_path, **FLOAT32))
    yield started
    started.shutdown()


@pytest.fixture(scope="module")
def tp_engine(model_path: Path, tp1_engine: AsyncEngine) -> Iterator[AsyncEngine]:
    """An engine with ``tensor_parallel_size=2`` on vLLM's multiprocess executor.

    Started after ``tp1_engine``, whose processes must not see the core binding.
    """
    # vLLM's CPU backend gives each rank its own OpenMP cores and, without this,
    # wants a NUMA node per rank (a 2-core machine has one). The engine's
    # processes read it once at start; the rest of the suite must not see it.
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    try:
        started = start_engine(
            engine_args(
                model_path, tensor_parallel_size=2, distributed_executor_backend="mp", **FLOAT32
            )
        )
    finally:
        if saved is None:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    yield started
    started.shutdown()


async def test_engine_runs_two_ranks(tp_engine: AsyncEngine) -> None:
    """The TP=2 engine runs two model ranks, each in a process of its own, both answering."""
    tp = await tp_engine.run_on_engine(lambda e: e.vllm_config.parallel_config.tensor_parallel_size)
    assert tp == 2
    assert await tp_engine.collective_rpc("check_health") == [None, None]
    ranks = [
        [w.pid for w in core.children() if "Worker_TP" in w.name()]
        for core in psutil.Process().children()
        if "EngineCore" in core.name()
    ]
    assert [len(r) for r in ranks if r] == [2]


async def test_greedy_tokens_match_tp1(tp1_engine: AsyncEngine, tp_engine: AsyncEngine) -> None:
    """Greedy decoding gives exactly TP=1's tokens under TP=2, prompt by prompt."""
    await assert_same_greedy_tokens(tp1_engine, tp_engine, PROMPTS)


async def test_delta_stream_concatenates_to_awaited(tp_engine: AsyncEngine) -> None:
    """DELTA iteration through TP=2 yields token by token and adds up to the awaited run."""
    await assert_delta_adds_up(tp_engine, PROMPTS[0])


async def test_abort_and_cancel(tp_engine: AsyncEngine) -> None:
    """abort(), break and task cancellation each take their request out of the TP=2 engine."""
    long = SamplingParams(max_tokens=400, **GREEDY)
    async for _ in tp_engine.generate("aborted", long):
        break  # nothing else holds the stream: dropped, it aborts the request
    assert await drained(tp_engine)

    explicit = tp_engine.generate("explicit abort", long)
    await tp_engine.run_on_engine(lambda e: None)  # it is in the engine now
    await tp_engine.abort(explicit.request_id)
    final = await explicit
    assert final.finished
    assert final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 400

    cancelled = asyncio.ensure_future(result(tp_engine.generate("cancelled", long)))
    await asyncio.sleep(0.2)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert await drained(tp_engine)
    assert tp_engine.stats().requests_in_flight == 0


async def test_reset_prefix_cache(tp_engine: AsyncEngine) -> None:
    """A reset is refused while a request runs, and one that preempts it keeps its tokens."""
    await assert_reset_keeps_a_running_request(tp_engine, PROMPTS[1] * 4)


async def test_killed_rank_kills_the_engine(tp_engine: AsyncEngine) -> None:
    """SIGKILL of one rank's process ends every stream with EngineDeadError (runs last)."""
    long = SamplingParams(max_tokens=400, **GREEDY)
    streams = [tp_engine.generate(f"doomed {i}", long) for i in range(3)]
    await tp_engine.run_on_engine(lambda e: None)  # they are in the engine now
    (rank, _) = [
        w.pid
        for core in psutil.Process().children()
        if "EngineCore" in core.name()
        for w in core.children()
        if "Worker_TP" in w.name()
    ]
    os.kill(rank, signal.SIGKILL)
    for stream in streams:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(result(stream), timeout=30)
    assert tp_engine.errored
    with pytest.raises(EngineDeadError):
        tp_engine.generate("after death")
