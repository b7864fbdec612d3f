"""asynckv on an 8B-shaped CUDA engine: the load a user's GPU gives it.

The checkpoint is scripts/gpu/llama8b: a Llama-3-8B config.json and no
weights (``load_format="dummy"``: random weights), no tokenizer, so prompts
are token ids and outputs are not detokenized. Random weights make the tokens
meaningless, so these tests check what asynckv promises (every stream ends,
counts, abort and cancel free the engine, a reset under load), not what the
model says. They run only with ``ASYNCKV_TEST_DEVICE=cuda`` (scripts/gpu).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm import EngineArgs, SamplingParams
from vllm.inputs import TokensPrompt

from asynckv import AsyncEngine
from support import cancel_while_iterating, result, start_engine, unfinished

pytestmark = pytest.mark.gpu

CHECKPOINT = Path(__file__).resolve().parents[2] / "scripts" / "gpu" / "llama8b"
VOCAB = 128256


def greedy(tokens: int, **extra: object) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=tokens, detokenize=False, **extra
    )


def prompt(seed: int, length: int = 64) -> TokensPrompt:
    ids = [(seed * 7919 + i * 104729) % VOCAB for i in range(length)]
    return TokensPrompt(prompt_token_ids=ids)


@pytest.fixture(scope="module")
def gpu_engine() -> Iterator[AsyncEngine]:
    """One 8B-shaped engine (16 GB of bf16 weights) for the module; eager, to start fast."""
    started = start_engine(
        EngineArgs(
            model=str(CHECKPOINT),
            load_format="dummy",
            skip_tokenizer_init=True,
            gpu_memory_utilization=0.3,
            max_model_len=1024,
            max_num_seqs=256,
            enforce_eager=True,
            seed=0,
        )
    )
    yield started
    started.shutdown()


async def test_generate_token_prompt(gpu_engine: AsyncEngine) -> None:
    """A token-id prompt streams growing outputs and ends with max_tokens.

    (A consumer that falls behind gets the latest cumulative output, so a
    length may be skipped, never repeated.)
    """
    lengths: list[int] = []  # read as they come: vLLM extends one token list in place
    final = None
    async for out in gpu_engine.generate(prompt(1), greedy(16)):
        lengths.append(len(out.outputs[0].token_ids))
        final = out
    assert final is not None and final.finished
    assert final.outputs[0].finish_reason == "length"
    tokens = list(final.outputs[0].token_ids)
    assert len(tokens) == 16 and all(0 <= t < VOCAB for t in tokens)
    assert lengths == sorted(set(lengths)) and lengths[0] >= 1 and lengths[-1] == 16


async def test_many_streams_all_finish(gpu_engine: AsyncEngine) -> None:
    """300 concurrent streams (more than max_num_seqs) all end with their full length."""
    finals = await asyncio.gather(
        *(result(gpu_engine.generate(prompt(i, 32 + i % 64), greedy(24))) for i in range(300))
    )
    assert [len(f.outputs[0].token_ids) for f in finals] == [24] * 300
    assert await unfinished(gpu_engine) == 0


async def test_repeat_is_identical(gpu_engine: AsyncEngine) -> None:
    """Greedy on the same prompt alone twice gives the same tokens (same batch shape)."""
    first = await gpu_engine.generate(prompt(3), greedy(32))
    second = await gpu_engine.generate(prompt(3), greedy(32))
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


async def test_abort_and_cancel_free_the_engine(gpu_engine: AsyncEngine) -> None:
    """abort() ends a stream with an "abort" output; a cancelled consumer's request leaves."""
    outputs = aiter(gpu_engine.generate(prompt(4), greedy(800), "gpu-abort"))
    await anext(outputs)
    await gpu_engine.abort("gpu-abort")
    last = None
    async for out in outputs:
        last = out
    assert last is not None and last.finished and last.outputs[0].finish_reason == "abort"

    await cancel_while_iterating(gpu_engine.generate(prompt(5), greedy(800)))
    assert await unfinished(gpu_engine) == 0


async def test_reset_prefix_cache_under_load(gpu_engine: AsyncEngine) -> None:
    """A reset with running requests preempts them; they still finish in full."""
    streams = [gpu_engine.generate(prompt(10 + i), greedy(200)) for i in range(32)]
    first = aiter(streams[0])  # kept: dropping an unfinished iterator aborts its request
    await anext(first)
    assert await gpu_engine.reset_prefix_cache(reset_running_requests=True)
    finals = await asyncio.gather(*(result(s) for s in streams))
    assert [len(f.outputs[0].token_ids) for f in finals] == [200] * 32


async def test_n2_gives_both_completions(gpu_engine: AsyncEngine) -> None:
    """n=2 with sampling returns both completions, ordered by index."""
    params = SamplingParams(
        n=2, temperature=1.0, seed=7, ignore_eos=True, max_tokens=16, detokenize=False
    )
    final = await gpu_engine.generate(prompt(6), params)
    assert [c.index for c in final.outputs] == [0, 1]
    assert all(len(c.token_ids) == 16 for c in final.outputs)
