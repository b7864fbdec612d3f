"""Bad input matrix: each kind fails its caller alone while 32 good streams finish in full."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.lora.request import LoRARequest

from asynckv import AsyncEngine, EngineClosedError, EngineDeadError

OK = SamplingParams(max_tokens=4, ignore_eos=True)


def cases(engine: AsyncEngine) -> dict[str, Callable[[], Any]]:
    """Each bad call, as a thunk that submits it and awaits its stream."""

    async def run(*args: Any, **kwargs: Any) -> Any:
        return await engine.generate(*args, **kwargs)

    async def duplicate() -> Any:
        first = engine.generate("x", SamplingParams(max_tokens=400, ignore_eos=True), "dup")
        try:
            return await run("x", OK, request_id="dup")
        finally:
            await engine.abort("dup")
            await first

    return {
        "empty prompt": lambda: run("", OK),
        "empty token-id list": lambda: run({"prompt_token_ids": []}, OK),
        "prompt over max_model_len": lambda: run({"prompt_token_ids": [7] * 600}, OK),
        "token ids outside the vocabulary": lambda: run({"prompt_token_ids": [1, 10**7]}, OK),
        "negative token id": lambda: run({"prompt_token_ids": [-5, 7]}, OK),
        "logprobs above the maximum": lambda: run("x", SamplingParams(max_tokens=2, logprobs=999)),
        "prompt_logprobs above the maximum": lambda: run(
            "x", SamplingParams(max_tokens=2, prompt_logprobs=999)
        ),
        "n larger than max_num_seqs": lambda: run("x", SamplingParams(n=40, max_tokens=2)),
        "unknown LoRA": lambda: run("x", OK, lora_request=LoRARequest("nope", 9, "/no/lora")),
        "request id already in flight": duplicate,
        "non-string request id": lambda: run("x", OK, request_id=123),
        "prompt is an int": lambda: run(12345, OK),
        "prompt is bytes": lambda: run(b"bytes", OK),
        "prompt is None": lambda: run(None, OK),
        "sampling_params of the wrong type": lambda: run("x", {"max_tokens": 3}),
        "unknown add_request keyword": lambda: run("x", OK, no_such_option=1),
    }


async def test_bad_input_matrix(engine: AsyncEngine, figures: Callable[[str], None]) -> None:
    """Each bad call works correctly or raises for its caller alone, never EngineDeadError."""
    began = time.monotonic()
    outcomes: dict[str, str] = {}
    for name, call in cases(engine).items():
        good = [
            engine.generate(f"good {i}", SamplingParams(max_tokens=16, ignore_eos=True))
            for i in range(32)
        ]
        try:
            result = await asyncio.wait_for(call(), timeout=60)
        except (EngineDeadError, TimeoutError):
            raise
        except Exception as exc:
            outcomes[name] = type(exc).__name__
        else:
            assert result.finished
            outcomes[name] = "worked"
        outs = await asyncio.gather(*good)
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs), name
    assert not engine.errored
    figures(
        f"{len(outcomes)} kinds x 32 good streams, {time.monotonic() - began:.1f} s: {outcomes}"
    )


async def test_generate_after_close(model_path: object) -> None:
    """generate() after close raises EngineClosedError at once."""
    from fakes import FakeEngine

    engine = AsyncEngine(FakeEngine())
    await engine.aclose()
    with pytest.raises(EngineClosedError):
        engine.generate("x", OK)
