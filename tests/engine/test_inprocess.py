"""The facade over an in-process engine (``multiprocess_mode=False``), wrapped by hand."""

from __future__ import annotations

from vllm import SamplingParams

from asynckv import AsyncEngine
from support import unfinished

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def test_inprocess_generate_matches_multiprocess(
    engine: AsyncEngine, inproc_engine: AsyncEngine
) -> None:
    """Both modes give the same greedy tokens for the same prompt."""
    prompt = "It is a truth universally acknowledged"
    a = await engine.generate(prompt, GREEDY)
    b = await inproc_engine.generate(prompt, GREEDY)
    assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)


async def test_inprocess_abort_reset_and_n2(inproc_engine: AsyncEngine) -> None:
    """Abort, reset with running requests, and n=2 work in-process too."""
    long = inproc_engine.generate("long", SamplingParams(max_tokens=400, ignore_eos=True))
    await inproc_engine.run_on_engine(lambda e: None)
    assert await inproc_engine.reset_prefix_cache() is False
    assert await inproc_engine.reset_prefix_cache(reset_running_requests=True) is True
    await inproc_engine.abort(long.request_id)
    assert (await long).outputs[0].finish_reason == "abort"
    pair = await inproc_engine.generate("pair", SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    assert [c.index for c in pair.outputs] == [0, 1]
    assert await unfinished(inproc_engine) == 0
