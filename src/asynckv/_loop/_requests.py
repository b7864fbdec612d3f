"""``AsyncLLM``'s request arguments, said once, on the caller's loop; what ``add_request`` takes.

Runs on the caller's event loop; the one piece of work on the engine (building
an engine request with vLLM's input processor, ``_vllm.process_inputs``) goes
through ``run_on_engine``, so the worker thread does it between two steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .. import _vllm

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import RequestOutputCollector

    from ._stream import RequestStream

__all__ = ("EngineCalls", "RequestArgs", "engine_options", "pump")

R = TypeVar("R")


@dataclasses.dataclass(frozen=True, slots=True)
class RequestArgs:
    """``AsyncLLM``'s request arguments beyond the id, the prompt and the params.

    ``AsyncEngine.add_request`` and ``AsyncEngineClient.generate`` build one
    from their own (public) parameters, which have ``AsyncLLM``'s names and
    defaults, and pass it on to ``engine_options``.
    """

    arrival_time: float | None = None
    lora_request: LoRARequest | None = None
    tokenization_kwargs: dict[str, Any] | None = None
    trace_headers: Mapping[str, str] | None = None
    priority: int = 0
    data_parallel_rank: int | None = None
    session_id: str | None = None
    prompt_text: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: dict[str, Any] | None = None
    kv_hints: Any = None

    def add_request_options(self) -> dict[str, Any]:
        """The ``LLMEngine.add_request`` options that are set (older vLLMs lack some)."""
        options: dict[str, Any] = {
            key: value
            for key, value in (
                ("arrival_time", self.arrival_time),
                ("lora_request", self.lora_request),
                ("tokenization_kwargs", self.tokenization_kwargs),
                ("trace_headers", self.trace_headers),
                ("session_id", self.session_id),
                ("prompt_text", self.prompt_text),
                ("kv_hints", self.kv_hints),
            )
            if value is not None
        }
        if self.priority:
            options["priority"] = self.priority
        return options

    @property
    def needs_core_request(self) -> bool:
        """Whether a field that ``add_request`` has no parameter for is set."""
        return (
            self.data_parallel_rank is not None
            or self.reasoning_ended is not None
            or self.reasoning_parser_kwargs is not None
        )


class EngineCalls(Protocol):
    """What ``engine_options`` needs of the engine (``AsyncEngine`` has both)."""

    async def run_on_engine(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R: ...

    async def is_tracing_enabled(self) -> bool: ...


# The tasks that feed collectors, held so that none is collected while it runs.
_PUMPS: set[asyncio.Task[None]] = set()


def pump(stream: RequestStream, collector: RequestOutputCollector) -> None:
    """Move a stream's outputs into a vLLM collector, in a task on this loop, until it ends.

    The stream's error, if any, goes into the collector too (``get()`` raises it).
    """
    task = asyncio.create_task(_pump(stream, collector), name=f"asynckv-pump-{stream.request_id}")
    _PUMPS.add(task)
    task.add_done_callback(_PUMPS.discard)


async def _pump(stream: RequestStream, collector: RequestOutputCollector) -> None:
    try:
        async for out in stream:
            collector.put(out)
    except Exception as exc:  # the request's own error: the reader gets it from get()
        collector.put(exc)


async def engine_options(
    engine: EngineCalls,
    request_id: str,
    prompt: Any,
    params: SamplingParams,
    args: RequestArgs,
) -> tuple[Any, dict[str, Any]]:
    """Turn ``AsyncLLM``'s request arguments into a prompt and ``LLMEngine.add_request`` options.

    Only the options that are set are passed (older vLLMs lack some). Three
    have no ``add_request`` parameter: with ``data_parallel_rank`` or a
    reasoning field set, vLLM's input processor builds the engine request on
    the worker thread, here, the fields are set on it, and that request is the
    prompt (which ``add_request`` takes as it is).

    Raises:
        NotImplementedError: ``prompt`` is an async generator (streaming input).
    """
    if isinstance(prompt, AsyncGenerator):
        raise NotImplementedError(
            "asynckv does not take streaming inputs (an async generator of prompts)"
        )
    if args.trace_headers and not await engine.is_tracing_enabled():
        from vllm.tracing import log_tracing_disabled_warning

        log_tracing_disabled_warning()  # and drops them, as AsyncLLM does
        args = dataclasses.replace(args, trace_headers=None)
    options = args.add_request_options()
    if not args.needs_core_request:
        return prompt, options
    request: EngineCoreRequest
    if _vllm.is_core_request(prompt):
        request = prompt
    else:
        process = {k: v for k, v in options.items() if k != "prompt_text"}
        if args.data_parallel_rank is not None:
            process["data_parallel_rank"] = args.data_parallel_rank
        request = await engine.run_on_engine(
            _vllm.process_inputs, request_id, prompt, params, process
        )
    _vllm.set_reasoning(request, args.reasoning_ended, args.reasoning_parser_kwargs)
    text = args.prompt_text
    if text is None:
        text = prompt if isinstance(prompt, str) else _text_of(prompt)
    return request, {} if text is None else {"prompt_text": text}


def _text_of(prompt: Any) -> str | None:
    # The text of a rendered or typed prompt (a dict), for the outputs' ``prompt``.
    text = prompt.get("prompt") if isinstance(prompt, dict) else None
    return text if isinstance(text, str) else None
