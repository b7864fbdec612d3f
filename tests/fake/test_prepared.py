"""Input processing off the worker, on a fake engine whose processing can be held.

A request's engine-core request is built on the renderer's pool, as
``AsyncLLM`` builds it; the worker only adds it. These tests hold that
processing at a gate, which a real tokenizer can't be made to do, and check
what the worker does meanwhile: it keeps stepping the other requests, and it
applies the commands issued after the held request only after it, in order.
The real engine's side (the processing runs on vLLM's pool thread, and the
tokens are the same) is in tests/engine/test_streams.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine, EngineClosedError
from fakes import FakeEngine
from model_support import BOUND


class PreparingEngine(FakeEngine):
    """A fake engine with what vLLM's ``LLMEngine`` has for input processing off the worker.

    Its input processor builds a request on the renderer's pool only once
    ``built`` is set, and records the thread that built it in ``built_on``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.built = threading.Event()
        self.built.set()
        self.processing = threading.Event()
        self.built_on: list[str] = []
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="renderer")
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(is_multimodal_model=False))
        self.renderer = SimpleNamespace(_executor=self.pool)
        self.input_processor = SimpleNamespace(
            process_inputs=self._process, assign_request_id=lambda request: None
        )
        self.output_processor.add_request = lambda *args: None
        self.engine_core.add_request = self._add_core

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def _process(
        self, request_id: str, prompt: object, params: SamplingParams, **_: Any
    ) -> SimpleNamespace:
        self.processing.set()
        assert self.built.wait(BOUND)
        self.built_on.append(threading.current_thread().name)
        return SimpleNamespace(request_id=request_id, prompt=prompt, params=params)

    def _add_core(self, request: SimpleNamespace) -> None:
        self.add_request(request.request_id, request.prompt, request.params)


@pytest.fixture
async def preparing() -> AsyncIterator[tuple[PreparingEngine, AsyncEngine]]:
    fake = PreparingEngine()
    engine = AsyncEngine(fake, freeze_gc=False)
    yield fake, engine
    fake.built.set()
    await asyncio.wait_for(engine.aclose(), BOUND)
    fake.pool.shutdown()


async def test_requests_are_built_off_the_worker(
    preparing: tuple[PreparingEngine, AsyncEngine],
) -> None:
    """Each request is built on the renderer's pool and runs to its end."""
    fake, engine = preparing
    params = SamplingParams(max_tokens=3)
    outs = await asyncio.wait_for(
        asyncio.gather(*(engine.generate(f"p{i}", params, prompt_text="p") for i in range(4))),
        BOUND,
    )
    assert [len(out.outputs[0].token_ids) for out in outs] == [3, 3, 3, 3]
    assert len(fake.built_on) == 4
    assert all(name.startswith("renderer") for name in fake.built_on)


async def test_worker_steps_while_a_request_is_being_built(
    preparing: tuple[PreparingEngine, AsyncEngine],
) -> None:
    """A request still being built holds up neither the running ones nor, after it, the
    commands issued later: those wait for it, in order."""
    fake, engine = preparing
    running = engine.generate("running", SamplingParams(max_tokens=10**6), prompt_text="r")
    outputs = aiter(running)
    await asyncio.wait_for(anext(outputs), BOUND)

    fake.built.clear()
    fake.processing.clear()
    held = engine.generate("held", SamplingParams(max_tokens=10**6), "held", prompt_text="h")
    assert await asyncio.to_thread(fake.processing.wait, BOUND)
    abort = asyncio.create_task(engine.abort("held"))
    # The running request keeps getting tokens while "held" is being built.
    before = len((await asyncio.wait_for(anext(outputs), BOUND)).outputs[0].token_ids)
    for _ in range(3):
        out = await asyncio.wait_for(anext(outputs), BOUND)
    assert len(out.outputs[0].token_ids) > before
    assert not abort.done()  # issued after "held": it waits for it
    assert "add held" not in fake.log

    fake.built.set()
    await asyncio.wait_for(abort, BOUND)
    final = await asyncio.wait_for(held, BOUND)
    assert final.outputs[0].finish_reason == "abort"
    assert fake.log.index("add held") < fake.log.index("abort held")
    await running.aclose()


async def test_close_ends_a_request_still_being_built(
    preparing: tuple[PreparingEngine, AsyncEngine],
) -> None:
    """A close while a request's input is still being built (the worker stepping others
    meanwhile) ends that request's stream with the close's error; it never hangs."""
    fake, engine = preparing
    running = engine.generate("running", SamplingParams(max_tokens=10**6), prompt_text="r")
    outputs = aiter(running)
    await asyncio.wait_for(anext(outputs), BOUND)
    fake.built.clear()
    fake.processing.clear()
    held = engine.generate("held", SamplingParams(max_tokens=10**6), "held", prompt_text="h")
    assert await asyncio.to_thread(fake.processing.wait, BOUND)
    await asyncio.wait_for(anext(outputs), BOUND)  # a step read while "held" waits
    await asyncio.wait_for(engine.aclose(), BOUND)
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(held, BOUND)
    assert "add held" not in fake.log
