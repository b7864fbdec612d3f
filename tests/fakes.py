"""The fake engine: stands in for vLLM's ``LLMEngine`` where a real one can't misbehave on demand.

Shared by the fake-engine tests (tests/fake/), the model-based machines
(tests/model/) and the reliability suite; mypy checks it against the Protocol
of what the worker calls (``asynckv._vllm.EngineLike``), below.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import TYPE_CHECKING

from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput

from asynckv._vllm import EngineLike

if TYPE_CHECKING:
    from asynckv import AsyncEngine


class FakeEngine:
    """Stands in for ``LLMEngine`` where a real engine can't misbehave on demand.

    Each request gets one token per step. A step waits for ``gate`` (set by
    default), so a test can hold the worker inside ``step()``; ``fail_with``
    makes the next step raise. ``step_entered`` is set whenever a step begins.
    A text prompt's outputs have ``prompt_token_ids == [1]`` and tokens 0, 1,
    2, ...; a token-ids prompt (a resumed request) of length ``k`` continues
    that count from ``k - 1``, so a resume that loses or repeats a token shows.
    """

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.step_entered = threading.Event()
        self.fail_with: BaseException | None = None
        self.tokens: dict[str, list[int]] = {}
        self.limits: dict[str, int] = {}
        self.prompts: dict[str, list[int]] = {}
        self.log: list[str] = []
        self.output_processor = SimpleNamespace(external_req_ids={}, request_states={})
        self.engine_core = SimpleNamespace(shutdown=self._shutdown)
        self.shut_down = threading.Event()
        self.shutdown_timeout: float | None = None
        """The grace the worker gave vLLM's process manager (``engine_core.shutdown``)."""
        self.metrics: object = None  # what outputs carry as vLLM's per-request stats

    def _shutdown(self, timeout: float | None = None) -> None:
        self.shutdown_timeout = timeout
        self.shut_down.set()

    def add_request(
        self, request_id: str, prompt: object, params: SamplingParams, /, **_: object
    ) -> None:
        self.log.append(f"add {request_id}")
        self.tokens[request_id] = []
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        self.prompts[request_id] = list(ids) if ids else [1]
        self.limits[request_id] = params.max_tokens or 16

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.log.append(f"abort {rid}")
            self.tokens.pop(rid, None)

    def reset_prefix_cache(self, reset_running_requests: bool = False, *_: object) -> bool:
        self.log.append("reset")
        return reset_running_requests or not self.tokens

    def has_unfinished_requests(self) -> bool:
        return bool(self.tokens)

    def get_num_unfinished_requests(self) -> int:
        return len(self.tokens)

    def step(self) -> list[RequestOutput]:
        self.step_entered.set()
        self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with
        self.log.append("step")
        outputs = []
        for rid, tokens in list(self.tokens.items()):
            prompt = self.prompts[rid]
            tokens.append(len(prompt) - 1 + len(tokens))
            done = len(tokens) >= self.limits[rid]
            completion = CompletionOutput(
                index=0,
                text="",
                token_ids=list(tokens),
                cumulative_logprob=None,
                logprobs=None,
                finish_reason="length" if done else None,
            )
            outputs.append(
                RequestOutput(
                    request_id=rid,
                    prompt=None,
                    prompt_token_ids=prompt,
                    prompt_logprobs=None,
                    outputs=[completion],
                    finished=done,
                    metrics=self.metrics,
                )
            )
            if done:
                del self.tokens[rid]
        return outputs


if TYPE_CHECKING:
    # mypy checks the fake against the Protocol of what the worker calls.
    _FAKE_IS_AN_ENGINE: EngineLike = FakeEngine()


async def hold_in_next_step(engine: AsyncEngine, fake: FakeEngine) -> None:
    """Hold ``engine``'s worker inside its next ``step()`` of ``fake`` (requests in flight).

    The gate is closed and ``step_entered`` cleared on the worker, between two steps, so
    the step that sets ``step_entered`` again is one that waits at the closed gate.
    Closed from the test's thread instead, a step that had set ``step_entered`` but not
    yet reached the gate would stop there unseen once ``step_entered`` was cleared, and
    the wait for the next one would time out (it did, once, on a loaded machine).
    """

    def close(_: object) -> None:
        fake.step_entered.clear()
        fake.gate.clear()

    await engine.run_on_engine(close)
    assert await asyncio.to_thread(fake.step_entered.wait, 10)
