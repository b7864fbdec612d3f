"""Streaming input, on the caller's (asyncio) loop: a request whose prompt comes in pieces.

Runs on the caller's asyncio event loop, in a task per request; its work on the
engine (building each input's engine request, handing it to the core) goes
through ``run_on_engine``, so the worker thread does it between two steps, in
FIFO order with everything else.

``AsyncLLM.generate`` takes an ``AsyncGenerator[StreamingInput, None]`` as the
prompt (vLLM's multi-turn streaming sessions): each input continues the same
request, whose generation for one input ends (its ``max_tokens``, a stop) with
an output that is not ``finished``; the request finishes once the generator is
exhausted and the last input's generation is over. asynckv does the same on
``LLMEngine``: the first input is added as any request (``Add``: routed,
parked while paused, aborted with the stream), each later one is handed to the
engine's output processor and core as ``AsyncLLM`` hands it, and the end is
``AsyncLLM``'s closing request (``_vllm.py``'s streaming-input section).

What ``LLMEngine`` can't do, and what happens instead:

* a session that has nothing left to generate when its input ends gets no
  final output from ``LLMEngine`` (``AsyncLLM``'s collector gets a sentinel that
  ``LLMEngine.step()`` has no place for): the stream is ended by an abort, whose
  final output carries no new token and the last input's finish reason. The
  client (``AsyncEngineClient.generate``) drops it, so its outputs are
  ``AsyncLLM``'s;
* a later input while the first waits for ``resume_generation()`` (parked, not
  yet in the engine) can't be handed to the engine: the stream fails with
  ``RuntimeError``;
* a restart (``RestartPolicy``) can't resume a session (its first request is
  spent): the stream fails with the restart's error;
* asyncio only: the inputs are read in an asyncio task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from vllm.sampling_params import RequestOutputKind, SamplingParams

from .. import _vllm

if TYPE_CHECKING:
    from ._stream import _Sink

__all__ = ("StreamingInputs", "checked_streaming_params", "is_streaming_input")

R = TypeVar("R")

# The feeding tasks, held so that none is collected while it runs.
_FEEDERS: set[asyncio.Task[None]] = set()


def is_streaming_input(prompt: object) -> bool:
    """Whether ``prompt`` is a streaming input (an async generator of ``StreamingInput``)."""
    return isinstance(prompt, AsyncGenerator)


def checked_streaming_params(params: object) -> SamplingParams:
    """``params`` if a streaming input can take them, else vLLM's own refusal (at once).

    As ``AsyncLLM``: not for ``n > 1``, ``FINAL_ONLY`` outputs or stop strings.
    """
    if (
        not isinstance(params, SamplingParams)
        or params.n > 1
        or params.output_kind == RequestOutputKind.FINAL_ONLY
        or params.stop
    ):
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(
            "Input streaming not currently supported for pooling models, n > 1, "
            "request_kind = FINAL_ONLY or with stop strings."
        )
    return params


class Host(Protocol):
    """What the feeder needs of ``AsyncEngine``."""

    async def run_on_engine(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R: ...


class StreamingInputs:
    """The task that feeds one request's inputs to the engine, in order (caller's loop).

    ``submit(prompt, params, options)`` puts the first input's ``Add`` in the
    inbox; ``abort(why)`` aborts the request (the stream's own path).
    ``ended_quietly`` is set before the abort that ends a session with nothing
    left to generate, so that a reader may tell that final output apart.
    """

    def __init__(
        self,
        host: Host,
        request_id: str,
        inputs: AsyncGenerator[Any, None],
        params: SamplingParams,
        options: dict[str, Any],
        sink: _Sink,
        submit: Callable[[Any, SamplingParams, dict[str, Any]], None],
        abort: Callable[[str], None],
    ) -> None:
        self.ended_quietly = False
        self.error: BaseException | None = None
        """The input stream's own error (or its refusal), which the stream raises."""
        self._host, self._rid, self._inputs = host, request_id, inputs
        self._params, self._options, self._sink = params, options, sink
        self._submit, self._abort = submit, abort
        self._task = asyncio.get_running_loop().create_task(
            self._feed(), name=f"asynckv-inputs-{request_id}"
        )
        _FEEDERS.add(self._task)
        self._task.add_done_callback(_FEEDERS.discard)

    def cancel(self) -> None:
        """Stop reading the inputs (the stream was left); idempotent, never raises."""
        self._task.cancel()

    async def _feed(self) -> None:
        first = True
        try:
            async for item in self._inputs:
                if self._sink.finished:
                    return  # aborted, failed or closed: read no more
                params = (
                    self._params
                    if item.sampling_params is None
                    else checked_streaming_params(item.sampling_params)
                )
                options = self._options | _prompt_text(item.prompt)
                if first:
                    request = await self._host.run_on_engine(
                        _vllm.stream_input_request, self._rid, item.prompt, params, options
                    )
                    self._submit(request, params, _prompt_text(item.prompt))
                    first = False
                    continue
                added = await self._host.run_on_engine(
                    _vllm.add_stream_input, self._rid, item.prompt, params, options
                )
                if not added and not self._sink.finished:
                    raise RuntimeError(
                        "a streaming input's first input is not in the engine yet "
                        "(generation is paused): asynckv can't queue the next one"
                    )
            if first:
                self._sink.abort()  # no input at all: the stream ends with nothing
                return
            ended = await self._host.run_on_engine(
                _vllm.end_stream_input, self._rid, self._params, self._options
            )
            if ended:
                self.ended_quietly = True
                self._abort("input ended")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # As AsyncLLM: the input's error is the request's, and the request is aborted.
            self.error = exc
            self._sink.fail(exc)
            if not first:
                self._abort("input failed")
        finally:
            await self._inputs.aclose()


def _prompt_text(prompt: Any) -> dict[str, Any]:
    # The text of an input, for the outputs' ``prompt`` (as the add_request option).
    text = prompt if isinstance(prompt, str) else None
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        text = prompt["prompt"]
    return {} if text is None else {"prompt_text": text}
