"""Zero-loss operations on real engines: a rolling restart of a pool, a planned restart.

One pool of two float32 engines with a restart policy serves the whole module
(float32, so that a request continued on a rebuilt or another member computes
the tokens it would have had), and one reference run of the 32 greedy
prompts without any restart. Each test restarts members mid-stream and checks
every stream against that run: the same token ids, the exact length.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput

from asynckv import AsyncEngine, AsyncEnginePool, RequestStream, RestartPolicy
from support import engine_args, first_outputs, random_prompts

# Two engine starts and five rebuilds, on 2 busy cores.
pytestmark = pytest.mark.timeout(1500)

TOKENS = 256
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = random_prompts(32, seed=32)


@pytest.fixture(scope="module")
def pool(model_path: Path) -> Iterator[AsyncEnginePool]:
    """Two float32 members with a restart policy, started once for the module."""
    args = engine_args(model_path, dtype="float32")
    made = AsyncEnginePool.from_engine_args(
        [args, args], restart=RestartPolicy(max_restarts=0)
    )  # every death final: the restarts here are all planned
    asyncio.run(made.start())
    yield made
    for engine in made.engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(pool: AsyncEnginePool) -> list[list[int]]:
    """Each prompt's greedy token ids, from a run without any restart."""

    async def run() -> list[list[int]]:
        finals = await asyncio.gather(*(pool.generate(p, GREEDY) for p in PROMPTS))
        return [list(final.outputs[0].token_ids) for final in finals]

    ids = asyncio.run(run())
    assert all(len(tokens) == TOKENS for tokens in ids)
    return ids


async def mid_stream(streams: list[RequestStream], tokens: int = 16) -> None:
    """Return once every stream has had an output and the first has ``tokens`` tokens."""
    await first_outputs(streams)
    async for out in streams[0]:
        if len(out.outputs[0].token_ids) >= tokens:
            return


def assert_exact(
    finals: list[RequestOutput], reference: list[list[int]], max_tokens: int = TOKENS
) -> None:
    """Each final has its reference's first ``max_tokens`` ids, and exactly that many."""
    assert len(finals) == len(reference)
    for i, (final, ref) in enumerate(zip(finals, reference, strict=True)):
        completion = final.outputs[0]
        assert list(completion.token_ids) == ref[:max_tokens], i
        assert len(completion.token_ids) == max_tokens
        assert completion.finish_reason == "length"


async def rolled(
    pool: AsyncEnginePool, reference: list[list[int]], handoff: bool
) -> tuple[list[RequestStream], list[int]]:
    """Run the 32 streams through ``rolling(restart)``; check them; return them and the moves."""
    streams = [pool.generate(p, GREEDY) for p in PROMPTS]
    before = [engine.stats().restarts for engine in pool.engines]
    await mid_stream(streams)
    records = await asyncio.wait_for(
        pool.rolling(lambda engine: engine.restart(), handoff=handoff), 600
    )
    finals = await asyncio.wait_for(asyncio.gather(*streams), 600)
    assert_exact(finals, reference)
    assert [e.stats().restarts - b for e, b in zip(pool.engines, before, strict=True)] == [1, 1]
    assert [r.index for r in records] == [0, 1]
    await pool.check_health()
    moves = [s.metrics.restarts for s in streams if s.metrics is not None]
    assert len(moves) == len(streams)
    if handoff:
        assert records[0].moved and not records[0].stayed
    else:
        assert records[0].stayed and not records[0].moved and not any(moves)
    return streams, moves


async def test_rolling_restart_hands_every_stream_over_exactly(
    pool: AsyncEnginePool, reference: list[list[int]], figures: Callable[[str], None]
) -> None:
    """rolling(restart) mid-stream, handoff: 32 greedy streams end exact; streams moved."""
    _, moves = await rolled(pool, reference, handoff=True)
    assert any(moves)
    figures(f"{sum(1 for m in moves if m)} of 32 streams handed over ({sum(moves)} moves)")


async def test_rolling_restart_without_handoff_finishes_in_place(
    pool: AsyncEnginePool, reference: list[list[int]]
) -> None:
    """rolling(restart, handoff=False): each member finishes its streams, then restarts."""
    await rolled(pool, reference, handoff=False)


async def test_planned_restart_resumes_16_streams_exactly(
    pool: AsyncEnginePool, reference: list[list[int]]
) -> None:
    """engine.restart() with 16 greedy streams in flight: the same ids, the exact length."""
    engine: AsyncEngine = pool.engines[0]
    short = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompts: list[TokensPrompt] = PROMPTS[:16]
    streams = [engine.generate(p, short) for p in prompts]
    await mid_stream(streams, tokens=8)
    await asyncio.wait_for(engine.restart(), 600)
    finals = await asyncio.wait_for(asyncio.gather(*streams), 600)
    assert_exact(finals, reference[:16], max_tokens=64)
    assert any(s.metrics is not None and s.metrics.restarts == 1 for s in streams)
    assert not engine.restarting and engine.stats().requests_in_flight == 0
