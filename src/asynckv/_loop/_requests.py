"""``AsyncLLM``'s request arguments, said once, on the caller's loop; what ``add_request`` takes.

Runs on the caller's event loop and does no work on the engine: the checks are
made here, at once, and what ``LLMEngine.add_request`` has no parameter for
(the reasoning fields) is set on the engine request on the worker thread
(``_vllm.add_request``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import vllm.exceptions
from vllm.lora.request import LoRARequest

if TYPE_CHECKING:
    from vllm.v1.engine.output_processor import RequestOutputCollector

    from ._stream import RequestStream

__all__ = ("EngineCalls", "RequestArgs", "engine_options", "pump")

R = TypeVar("R")


@dataclasses.dataclass(frozen=True, slots=True)
class RequestArgs:
    """``AsyncLLM``'s request arguments beyond the id, the prompt and the params.

    ``AsyncEngine.add_request`` and ``AsyncEngineClient.generate`` build one
    from their own (public) parameters, which have ``AsyncLLM``'s names and
    defaults; ``AsyncEngine.generate`` from its keyword arguments
    (``from_options``). ``checked`` refuses, on the caller's thread, what
    would otherwise fail inside the worker or the engine core.
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

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RequestArgs:
        """The arguments of ``generate(**options)``, checked.

        Raises:
            TypeError: a name that ``AsyncLLM.add_request`` doesn't take, or a
                value of the wrong type (see ``checked``).
            VLLMValidationError: ``data_parallel_rank`` out of range.
        """
        unknown = sorted(set(options) - _NAMES)
        if unknown:
            raise TypeError(
                f"generate() got an unexpected keyword argument {unknown[0]!r} "
                f"(it takes {', '.join(sorted(_NAMES))})"
            )
        return cls(**options).checked()

    def checked(self) -> RequestArgs:
        """These arguments, or the error ``AsyncLLM`` would raise (at once, here).

        ``data_parallel_rank``: asynckv runs one engine core, so rank 0 (or
        None) is the only one there is, and it changes nothing; any other is
        refused with ``AsyncLLM``'s own ``VLLMValidationError`` ("out of range
        [0, 1)"), which vLLM's server answers with a 400. The other fields
        must have ``AsyncLLM``'s types: a wrong one raises ``TypeError`` here
        rather than inside the worker (or kills the engine core: a ``str``
        priority under the priority scheduler).
        """
        rank = self.data_parallel_rank
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise TypeError(f"data_parallel_rank must be an int, not {type(rank).__name__}")
            if rank != 0:
                raise _VALIDATION_ERROR(f"data_parallel_rank {rank} is out of range [0, 1).")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"priority must be an int, not {type(self.priority).__name__}")
        hints = self.kv_hints
        if hints is not None and _KV_HINTS is not None and not isinstance(hints, _KV_HINTS):
            kind = type(hints).__name__
            raise TypeError(f"kv_hints must be a KvHintsEnvelope or None, not {kind}")
        for name, types in _TYPES:
            value = getattr(self, name)
            if value is not None and not isinstance(value, types):
                kind = type(value).__name__
                raise TypeError(f"{name} must be {_NAMED[types]} or None, not {kind}")
        return self

    def add_request_options(self) -> dict[str, Any]:
        """The options the worker passes on (``_vllm.add_request``), those that are set.

        Only those that are set (older vLLMs lack some). The reasoning fields,
        which ``LLMEngine.add_request`` has no parameter for, are set on the
        engine-core request on the worker; ``data_parallel_rank`` (0, once
        checked) is left out: with one engine core it routes nothing.
        """
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
                ("reasoning_ended", self.reasoning_ended),
                ("reasoning_parser_kwargs", self.reasoning_parser_kwargs),
            )
            if value is not None
        }
        if self.priority:
            options["priority"] = self.priority
        return options


_NAMES = frozenset(field.name for field in dataclasses.fields(RequestArgs))

# The fields checked by isinstance alone (None is always allowed).
_TYPES: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("arrival_time", (int, float)),
    ("lora_request", LoRARequest),
    ("tokenization_kwargs", dict),
    ("trace_headers", Mapping),
    ("session_id", str),
    ("prompt_text", str),
    ("reasoning_ended", bool),
    ("reasoning_parser_kwargs", dict),
)
_NAMED: dict[type | tuple[type, ...], str] = {
    (int, float): "a number",
    dict: "a dict",
    Mapping: "a mapping",
    str: "a str",
    bool: "a bool",
    LoRARequest: "a LoRARequest",
}

# vLLM's KV hints (0.32; older vLLMs have none, and no kv_hints argument either).
try:
    from vllm.v1.kv_hints import KvHintsEnvelope as _KV_HINTS
except ImportError:  # pragma: no cover - vLLM before 0.32
    _KV_HINTS = None

# AsyncLLM's validation error (a 400 in vLLM's server); vLLMs without it raise ValueError.
_VALIDATION_ERROR: type[Exception] = getattr(vllm.exceptions, "VLLMValidationError", ValueError)


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


async def engine_options(engine: EngineCalls, args: RequestArgs) -> dict[str, Any]:
    """Turn ``AsyncLLM``'s request arguments into the options ``AsyncEngine.generate`` takes.

    Checks them first (``RequestArgs.checked``), on the caller's loop. Only
    the options that are set are passed (older vLLMs lack some); the
    reasoning fields are set on the engine request on the worker thread.

    Raises:
        TypeError, VLLMValidationError: see ``RequestArgs.checked``.
    """
    args = args.checked()
    if args.trace_headers and not await engine.is_tracing_enabled():
        from vllm.tracing import log_tracing_disabled_warning

        log_tracing_disabled_warning()  # and drops them, as AsyncLLM does
        args = dataclasses.replace(args, trace_headers=None)
    return args.add_request_options()
