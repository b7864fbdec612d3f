"""Streams on the real engine: awaiting, iterating, output kinds, n > 1, slow consumers.

Every test runs on asyncio and on trio (anyio's plugin, ``anyio_backend``).
"""

from __future__ import annotations

import anyio
import pytest
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine, RequestStream
from support import unfinished

pytestmark = pytest.mark.anyio

GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def test_await_returns_final_output(engine: AsyncEngine) -> None:
    """Awaiting a stream returns the finished output with max_tokens tokens."""
    stream = engine.generate("To be or not to be,", SamplingParams(max_tokens=12, **GREEDY))
    out = await stream
    assert out.finished
    assert out.request_id == stream.request_id
    assert len(out.outputs) == 1
    assert len(out.outputs[0].token_ids) == 12
    assert out.outputs[0].finish_reason == "length"
    assert await unfinished(engine) == 0


async def test_iterate_cumulative_grows_by_one_token(engine: AsyncEngine) -> None:
    """CUMULATIVE iteration yields growing outputs, the last one finished."""
    params = SamplingParams(max_tokens=10, **GREEDY)
    lengths = []
    finished = []
    async for out in engine.generate("It was the best of times", params):
        lengths.append(len(out.outputs[0].token_ids))
        finished.append(out.finished)
    assert lengths == sorted(lengths)
    assert lengths[-1] == 10
    assert finished[-1] and not any(finished[:-1])


async def test_streamed_tokens_equal_awaited_tokens(engine: AsyncEngine) -> None:
    """DELTA iteration concatenates to exactly the tokens of an awaited greedy run."""
    prompt = "Call me Ishmael."
    awaited = await engine.generate(prompt, SamplingParams(max_tokens=16, **GREEDY))
    delta = SamplingParams(max_tokens=16, output_kind=RequestOutputKind.DELTA, **GREEDY)
    tokens: list[int] = []
    text = ""
    async for out in engine.generate(prompt, delta):
        tokens.extend(out.outputs[0].token_ids)
        text += out.outputs[0].text
    assert tokens == list(awaited.outputs[0].token_ids)
    assert text == awaited.outputs[0].text


async def test_final_only_yields_one_output(engine: AsyncEngine) -> None:
    """FINAL_ONLY yields exactly one, finished, output."""
    params = SamplingParams(max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY, **GREEDY)
    outs = [out async for out in engine.generate("Hello", params)]
    assert len(outs) == 1
    assert outs[0].finished and len(outs[0].outputs[0].token_ids) == 8


async def test_token_prompt_and_given_request_id(engine: AsyncEngine) -> None:
    """A TokensPrompt is accepted and a given request_id is kept."""
    prompt = TokensPrompt(prompt_token_ids=[5, 17, 42, 99, 7])
    stream = engine.generate(prompt, SamplingParams(max_tokens=4, **GREEDY), request_id="tok-1")
    assert stream.request_id == "tok-1"
    out = await stream
    assert out.request_id == "tok-1"
    assert list(out.prompt_token_ids or []) == [5, 17, 42, 99, 7]


async def test_default_sampling_params(engine: AsyncEngine) -> None:
    """Without sampling_params the engine uses vLLM's defaults and still finishes."""
    out = await engine.generate("The sea")
    assert out.finished and out.outputs[0].finish_reason in ("length", "stop")


async def test_n2_merged_in_every_output_kind(engine: AsyncEngine) -> None:
    """n=2 gives both completions, ordered by index, whatever the output kind."""
    for kind in RequestOutputKind:
        params = SamplingParams(
            n=2,
            max_tokens=6,
            temperature=0.8,
            seed=1,
            ignore_eos=True,
            output_kind=kind,
        )
        out = await engine.generate("Once upon a time", params)
        assert out.finished
        assert [c.index for c in out.outputs] == [0, 1], kind
        assert all(len(c.token_ids) == 6 for c in out.outputs), kind
        assert all(c.finish_reason == "length" for c in out.outputs), kind


async def test_n2_cumulative_iteration_shows_both_children(engine: AsyncEngine) -> None:
    """While iterating n=2 CUMULATIVE, each output carries every child seen so far."""
    params = SamplingParams(n=2, max_tokens=5, temperature=0.8, seed=3, ignore_eos=True)
    outs = [out async for out in engine.generate("Once upon a time", params)]
    assert [c.index for c in outs[-1].outputs] == [0, 1]
    assert all(len(c.token_ids) == 5 for c in outs[-1].outputs)


async def _finish_behind(engine: AsyncEngine, kind: RequestOutputKind) -> list[object]:
    """Let a 20-token stream finish unread (a 40-token one started after it finishes later)."""
    slow = engine.generate(
        "A slow reader", SamplingParams(max_tokens=20, output_kind=kind, **GREEDY)
    )
    await engine.generate("A longer one", SamplingParams(max_tokens=40, **GREEDY))
    assert slow.finished
    return [out async for out in slow]


async def test_slow_consumer_delta_outputs_are_merged(engine: AsyncEngine) -> None:
    """A DELTA consumer that falls behind gets one merged output holding every token."""
    outs = await _finish_behind(engine, RequestOutputKind.DELTA)
    assert len(outs) == 1
    (out,) = outs
    assert out.finished  # type: ignore[attr-defined]
    assert len(out.outputs[0].token_ids) == 20  # type: ignore[attr-defined]


async def test_slow_consumer_cumulative_output_is_replaced(engine: AsyncEngine) -> None:
    """A CUMULATIVE consumer that falls behind gets only the newest output."""
    outs = await _finish_behind(engine, RequestOutputKind.CUMULATIVE)
    assert len(outs) == 1
    assert len(outs[0].outputs[0].token_ids) == 20  # type: ignore[attr-defined]


async def test_many_concurrent_streams(engine: AsyncEngine) -> None:
    """Forty concurrent streams all finish with their own full output."""
    params = SamplingParams(max_tokens=8, **GREEDY)
    outs: list[RequestOutput] = []

    async def consume(stream: RequestStream) -> None:
        outs.append(await stream)

    async with anyio.create_task_group() as group:
        for i in range(40):
            group.start_soon(consume, engine.generate(f"Line {i}:", params))
    assert sorted(o.request_id for o in outs) == sorted({o.request_id for o in outs})
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert await unfinished(engine) == 0


async def test_input_is_processed_off_the_worker(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's input (tokenization, the engine-core request) is built on vLLM's
    renderer pool, as ``AsyncLLM`` builds it, never on the worker thread that steps;
    the output still reports the prompt's text and its tokens."""
    import threading

    processor = type(engine.input_processor)
    process = processor.process_inputs
    threads: list[str] = []

    def recording(self: object, *args: object, **kwargs: object) -> object:
        threads.append(threading.current_thread().name)
        return process(self, *args, **kwargs)

    monkeypatch.setattr(processor, "process_inputs", recording)
    out = await engine.generate("Off the worker", SamplingParams(max_tokens=4, **GREEDY))
    assert out.prompt == "Off the worker"
    assert out.prompt_token_ids
    assert len(out.outputs[0].token_ids) == 4
    assert threads
    assert "asynckv-engine" not in threads
