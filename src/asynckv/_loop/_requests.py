"""Turning ``AsyncLLM``'s request arguments into what ``LLMEngine.add_request`` takes.

Runs on the caller's event loop; the one piece of work on the engine (building
an engine request with vLLM's input processor) goes through ``run_on_engine``,
so the worker thread does it between two steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLMEngine
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.output_processor import RequestOutputCollector

    from ._asyncllm import AsyncLLMMethods
    from ._stream import RequestStream

__all__ = ("engine_options", "pump")

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
    engine: AsyncLLMMethods,
    request_id: str,
    prompt: Any,
    params: SamplingParams,
    *,
    arrival_time: float | None = None,
    lora_request: LoRARequest | None = None,
    tokenization_kwargs: dict[str, Any] | None = None,
    trace_headers: Mapping[str, str] | None = None,
    priority: int = 0,
    data_parallel_rank: int | None = None,
    session_id: str | None = None,
    prompt_text: str | None = None,
    reasoning_ended: bool | None = None,
    reasoning_parser_kwargs: dict[str, Any] | None = None,
    kv_hints: Any = None,
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
    if trace_headers and not await engine.is_tracing_enabled():
        from vllm.tracing import log_tracing_disabled_warning

        log_tracing_disabled_warning()  # and drops them, as AsyncLLM does
        trace_headers = None
    options: dict[str, Any] = {
        key: value
        for key, value in (
            ("arrival_time", arrival_time),
            ("lora_request", lora_request),
            ("tokenization_kwargs", tokenization_kwargs),
            ("trace_headers", trace_headers),
            ("session_id", session_id),
            ("prompt_text", prompt_text),
            ("kv_hints", kv_hints),
        )
        if value is not None
    }
    if priority:
        options["priority"] = priority
    if data_parallel_rank is None and reasoning_ended is None and reasoning_parser_kwargs is None:
        return prompt, options
    from vllm.v1.engine import EngineCoreRequest

    request: EngineCoreRequest
    if isinstance(prompt, EngineCoreRequest):
        request = prompt
    else:
        process = {k: v for k, v in options.items() if k != "prompt_text"}
        if data_parallel_rank is not None:
            process["data_parallel_rank"] = data_parallel_rank

        def build(e: LLMEngine) -> EngineCoreRequest:
            # On the worker thread: the input processor is the worker's to use.
            return e.input_processor.process_inputs(
                request_id, prompt, params, supported_tasks=e.get_supported_tasks(), **process
            )

        request = await engine.run_on_engine(build)
    if reasoning_ended is not None:
        request.reasoning_ended = reasoning_ended
    if reasoning_parser_kwargs is not None:
        request.reasoning_parser_kwargs = reasoning_parser_kwargs
    text = prompt_text
    if text is None:
        text = prompt if isinstance(prompt, str) else _text_of(prompt)
    return request, {} if text is None else {"prompt_text": text}


def _text_of(prompt: Any) -> str | None:
    # The text of a rendered or typed prompt (a dict), for the outputs' ``prompt``.
    text = prompt.get("prompt") if isinstance(prompt, dict) else None
    return text if isinstance(text, str) else None
