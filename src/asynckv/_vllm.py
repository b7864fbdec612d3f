"""What asynckv reads and calls of vLLM's internals, kept in one place.

Everything here depends on how vLLM (0.32; 0.26 on the GPU) lays out its
``LLMEngine`` beyond the public API, so each function degrades to a safe
answer when an attribute is missing. ``abort_outputs``, ``pause_core_scheduler``
and ``resume_core_scheduler`` run on the worker thread; ``engine_processes``
and ``watch_outputs`` right after the engine is built; ``unblock_step`` on the
watchdog thread.
"""

from __future__ import annotations

import contextlib
import queue
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.v1.engine import FinishReason

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from vllm import LLMEngine
    from vllm.outputs import RequestOutput

__all__ = (
    "abort_outputs",
    "engine_processes",
    "exit_status",
    "fail_utility_calls",
    "pause_core_scheduler",
    "resume_core_scheduler",
    "unblock_step",
    "watch_outputs",
)


def abort_outputs(engine: LLMEngine, request_id: str) -> list[RequestOutput]:
    """Make the final "abort" outputs that vLLM makes for AsyncLLM but not for LLMEngine.

    They come from vLLM's own ``RequestState.make_request_output``, so they
    follow the request's output kind and ``n`` exactly as a finished output would.
    """
    processor = engine.output_processor
    outputs: list[RequestOutput] = []
    # Internals of vLLM's output processor: if another version lays them out
    # differently, the stream makes its own final "abort" output instead.
    mapping = getattr(processor, "external_req_ids", None)
    if mapping is None:
        return outputs
    for internal_id in list(mapping.get(request_id, ())):
        state = processor.request_states.get(internal_id)
        if state is None:
            continue
        out = state.make_request_output(
            new_token_ids=[],
            pooling_output=None,
            finish_reason=FinishReason.ABORT,
            stop_reason=None,
        )
        if out is not None:
            outputs.append(out)
    return outputs


def engine_processes(engine: LLMEngine) -> list[BaseProcess]:
    """The engine-core processes of a multiprocess-mode engine (none in-process)."""
    resources = getattr(engine.engine_core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", ()))


def pause_core_scheduler(engine: LLMEngine, clear_cache: bool) -> bool:
    """Freeze the scheduler of a separate engine-core process ("keep"); False in-process."""
    core = engine.engine_core
    if not hasattr(core, "call_utility"):
        return False
    core.call_utility("pause_scheduler", "keep", clear_cache)
    return True


def resume_core_scheduler(engine: LLMEngine) -> None:
    """Undo ``pause_core_scheduler``."""
    engine.engine_core.call_utility("resume_scheduler")


def unblock_step(engine: LLMEngine, cause: BaseException) -> None:
    """Make a ``step()`` blocked on a dead engine-core process raise ``cause``.

    The one exception to "only the worker touches the engine": a put on the
    thread-safe queue that a blocked ``get_output()`` waits on, and the
    thread-safe futures that blocked utility calls wait on.
    """
    core = getattr(engine, "engine_core", None)
    queue = getattr(core, "outputs_queue", None)
    if queue is not None:
        queue.put_nowait(cause)
    fail_utility_calls(engine, cause)


def fail_utility_calls(engine: LLMEngine, cause: BaseException) -> None:
    """Fail the futures of utility calls (a reset, a pause of the core, ...) now waiting.

    A dead core never answers them. Thread-safe futures, so any thread may.
    """
    core = getattr(engine, "engine_core", None)
    with contextlib.suppress(Exception):
        for future in list(getattr(core, "utility_results", {}).values()):
            if not future.done():
                future.set_exception(cause)


def watch_outputs(engine: LLMEngine, arrived: Callable[[], None]) -> Callable[[], bool] | None:
    """Call ``arrived()`` whenever the engine-core process's next output arrives.

    Returns a check for "an output is waiting, so ``step()`` won't block", or
    None where there is no engine-core process (in-process mode: ``step()``
    computes) or this vLLM keeps its outputs elsewhere; then ``step()`` is
    simply called and may block. ``arrived`` runs on vLLM's output thread
    (``EngineCoreOutputQueueThread``) right after the output is queued.
    """
    core = getattr(engine, "engine_core", None)
    outputs = getattr(core, "outputs_queue", None)
    if not isinstance(outputs, queue.Queue):
        return None
    put = outputs.put

    def put_and_tell(item: Any, block: bool = True, timeout: float | None = None) -> None:
        put(item, block, timeout)
        arrived()

    # vLLM's thread calls put_nowait, which calls self.put: this instance's attribute.
    setattr(outputs, "put", put_and_tell)  # noqa: B010 (mypy forbids assigning a method)
    return lambda: outputs.qsize() > 0


def exit_status(code: int | None) -> str:
    """Say how a process ended, from its exit code."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            pass
    return f"exited with code {code}"
