"""Bad input fails its own caller only; the engine then serves the next request normally."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest

from asynckv import AsyncEngine, RequestStream
from support import unfinished

OK = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


async def _serves_normally(engine: AsyncEngine) -> None:
    out = await engine.generate("and life goes on", OK)
    assert len(out.outputs[0].token_ids) == 4
    assert await unfinished(engine) == 0


# vLLM's error for a request it refuses: VLLMValidationError in 0.32; vLLM 0.26 (the
# GPU run's) raises a plain ValueError for some of these, with the same message.
INVALID = (VLLMValidationError, ValueError)
Raised = type[Exception] | tuple[type[Exception], ...]

BAD_REQUESTS: dict[str, tuple[Callable[[AsyncEngine], RequestStream], Raised, str]] = {
    "empty prompt": (
        lambda e: e.generate({"prompt_token_ids": []}, OK),
        INVALID,
        "prompt cannot be empty",
    ),
    "prompt longer than max_model_len": (
        lambda e: e.generate({"prompt_token_ids": [7] * 600}, OK),
        INVALID,
        "maximum context length is 512",
    ),
    "too many logprobs": (
        lambda e: e.generate("x", SamplingParams(max_tokens=2, logprobs=10_000)),
        INVALID,
        "greater than max allowed",
    ),
    "token id outside the vocabulary": (
        lambda e: e.generate({"prompt_token_ids": [10**6]}, OK),
        INVALID,
        "out of vocabulary",
    ),
    "unknown LoRA": (
        lambda e: e.generate("x", OK, lora_request=LoRARequest("nope", 1, "/no/such/lora")),
        INVALID,
        "LoRA is not enabled",
    ),
    "not a prompt": (lambda e: e.generate(12345, OK), Exception, ""),
    "seed beyond 64 bits": (
        lambda e: e.generate("x", SamplingParams(max_tokens=2, seed=2**70)),
        ValueError,
        "64 bits",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
async def test_bad_request_fails_only_its_caller(engine: AsyncEngine, case: str) -> None:
    """Each bad request raises to its own caller; a request beside it is unharmed."""
    make, error, match = BAD_REQUESTS[case]
    bystander = engine.generate("a bystander", SamplingParams(max_tokens=12, ignore_eos=True))
    with pytest.raises(error, match=match):
        await make(engine)
    assert len((await bystander).outputs[0].token_ids) == 12
    await _serves_normally(engine)


async def test_duplicate_request_id_in_flight(engine: AsyncEngine) -> None:
    """A request_id already in flight is refused; the first request is unharmed."""
    first = engine.generate("one", SamplingParams(max_tokens=30, ignore_eos=True), request_id="dup")
    second = engine.generate("two", OK, request_id="dup")
    with pytest.raises(ValueError, match="already in flight"):
        await second
    assert len((await first).outputs[0].token_ids) == 30
    # Once finished, the id may be used again.
    again = await engine.generate("three", OK, request_id="dup")
    assert again.finished
    await _serves_normally(engine)


async def test_run_on_engine_error_reaches_caller_only(engine: AsyncEngine) -> None:
    """An exception in ``run_on_engine`` is raised to its caller; the engine goes on."""

    def boom(_: Any) -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await engine.run_on_engine(boom)
    await _serves_normally(engine)


async def test_stream_on_another_loop_is_refused(engine: AsyncEngine) -> None:
    """A stream used from a loop other than its own raises RuntimeError there."""
    import asyncio
    import threading

    stream = engine.generate("mine", OK)
    errors: list[BaseException] = []

    def other_loop() -> None:
        async def use() -> None:
            await stream

        try:
            asyncio.run(use())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_loop)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "another event loop" in str(errors[0])
    assert (await stream).finished


async def test_asyncllm_pass_throughs(engine: AsyncEngine) -> None:
    """AsyncLLM's pass-throughs answer from the worker thread between steps."""
    tokenizer = engine.get_tokenizer()  # sync, as AsyncLLM.get_tokenizer
    assert tokenizer.encode("To be or not to be,")
    assert await engine.is_sleeping() is False
    await engine.check_health()
    assert not engine.errored
    with pytest.raises(Exception, match="LoRA is not enabled"):
        await engine.add_lora(LoRARequest("nope", 1, "/no/such/lora"))
    assert await engine.collective_rpc("check_health") == [None]
    await _serves_normally(engine)
