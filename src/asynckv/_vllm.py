"""Everything read of vLLM beyond ``LLMEngine``'s methods; each runs on its caller's thread.

Everything here depends on how vLLM (0.32; 0.26 on the GPU) lays out its
``LLMEngine`` and its outputs beyond the public API, so each function
degrades to a safe answer when an attribute is missing. ``EngineLike`` is
the Protocol of the ``LLMEngine`` methods the worker calls; the tests'
fake engine is checked against it.

Threads: ``abort_outputs``, ``pause_core_scheduler``, ``resume_core_scheduler``
and ``shutdown_core`` run on the worker thread; ``engine_processes``,
``client_threads``, ``has_core_process`` and ``watch_outputs`` right after
the engine is built (also on the worker); ``unblock_step`` and ``fail_utility_calls`` on the
watchdog thread; the output helpers (``final_abort_output``, ``copy_delta``,
``merge_delta``, ``request_stat``) on the stream's event loop; ``tap_steps``
and its ``StepTap`` on the worker (inside ``step()``). The request and
build-time section says its own.
"""

from __future__ import annotations

import contextlib
import copy
import queue
import signal
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine import EngineCoreEventType, FinishReason
from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from vllm import LLMEngine
    from vllm.config import VllmConfig
    from vllm.renderers import BaseRenderer
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.input_processor import InputProcessor

__all__ = (
    "BuildTime",
    "Detokenizer",
    "EngineLike",
    "Prepared",
    "StepTap",
    "VllmEngineDeadError",
    "abort_outputs",
    "add_core_request",
    "add_prepared",
    "add_request",
    "add_stream_input",
    "client_threads",
    "copy_delta",
    "decode_more",
    "decoded_ids",
    "decoded_text",
    "detokenizers",
    "end_stream_input",
    "engine_processes",
    "exit_status",
    "fail_utility_calls",
    "final_abort_output",
    "has_core_process",
    "input_executor",
    "is_core_request",
    "is_engine_dead",
    "made_for",
    "merge_delta",
    "pause_core_scheduler",
    "prepare_request",
    "process_inputs",
    "read_build_time",
    "rejected_kv_request",
    "request_stat",
    "resume_core_scheduler",
    "set_reasoning",
    "shutdown_core",
    "stream_input_request",
    "tap_steps",
    "unblock_step",
    "watch_outputs",
    "with_completions",
)


class EngineLike(Protocol):
    """The ``LLMEngine`` methods and attributes the worker uses (only on its thread).

    ``engine_core`` and ``output_processor`` are read only through the
    functions below, each of which tolerates their absence.
    """

    engine_core: Any
    output_processor: Any

    def add_request(
        self, request_id: str, prompt: Any, params: SamplingParams, /, **kwargs: Any
    ) -> Any: ...

    def abort_request(self, request_ids: list[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_num_unfinished_requests(self) -> int: ...

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False, /
    ) -> bool: ...


def is_engine_dead(error: BaseException) -> bool:
    """Whether ``error`` is vLLM's own "the engine core died" error."""
    return isinstance(error, VllmEngineDeadError)


def has_core_process(engine: EngineLike) -> bool:
    """Whether the engine core runs in a process of its own (it then steps by itself)."""
    return hasattr(engine.engine_core, "call_utility")


def shutdown_core(engine: EngineLike, timeout: float | None = 0.0) -> None:
    """Shut the engine core down (its processes too); never raises.

    ``timeout`` is what vLLM's process manager waits for the engine-core
    process to exit after its SIGTERM before it kills what is left: 0 (what
    ``vllm serve`` passes with its default ``--shutdown-timeout``) kills at
    once, None waits vLLM's default 5 s. The core needs no more: it has
    finished with its requests before this is called (asynckv drains on its
    side of the process, in ``Worker.close``), and a full exit of its
    processes takes 10-15 s on two cores, nearly all of it the garbage
    collections of their interpreters' teardown, which frees nothing the OS
    would not.
    """
    with contextlib.suppress(BaseException):
        engine.engine_core.shutdown(timeout=timeout)


def abort_outputs(engine: EngineLike, request_id: str) -> list[RequestOutput]:
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


def detokenizers(engine: EngineLike, request_id: str) -> list[tuple[int, Any]]:
    """The detokenizer of each of a request's completions: (index, detokenizer).

    Read on the worker thread from a dead engine's output processor (it lives
    on the client side, so it outlives the engine-core process). Continued
    with the tokens of a resumed request, a detokenizer gives the text, and
    finds the stop strings, exactly as it would have without the death: it
    holds the text decoded so far, what was streamed of it, and the decoding
    state at the join. Empty where this vLLM lays its states out differently.
    """
    processor = getattr(engine, "output_processor", None)
    mapping = getattr(processor, "external_req_ids", None)
    states = getattr(processor, "request_states", None)
    if mapping is None or states is None:
        return []
    found = []
    for internal_id in list(mapping.get(request_id, ())):
        state = states.get(internal_id)
        detokenizer = getattr(state, "detokenizer", None)
        if all(
            hasattr(detokenizer, name)
            for name in ("update", "get_next_output_text", "output_token_ids", "output_text")
        ):
            found.append((int(getattr(state, "request_index", 0)), detokenizer))
    return found


def client_threads(engine: EngineLike) -> list[int]:
    """The native ids of the threads vLLM's client runs beside the worker (its output thread)."""
    thread = getattr(engine.engine_core, "output_queue_thread", None)
    native_id = getattr(thread, "native_id", None)
    return [native_id] if isinstance(native_id, int) else []


def engine_processes(engine: EngineLike) -> list[BaseProcess]:
    """The engine-core processes of a multiprocess-mode engine (none in-process)."""
    resources = getattr(engine.engine_core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    return list(getattr(manager, "processes", ()))


def pause_core_scheduler(engine: EngineLike, clear_cache: bool) -> bool:
    """Freeze the scheduler of a separate engine-core process ("keep"); False in-process."""
    if not has_core_process(engine):
        return False
    engine.engine_core.call_utility("pause_scheduler", "keep", clear_cache)
    return True


def resume_core_scheduler(engine: EngineLike) -> None:
    """Undo ``pause_core_scheduler``."""
    engine.engine_core.call_utility("resume_scheduler")


def unblock_step(engine: EngineLike, cause: BaseException) -> None:
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


def fail_utility_calls(engine: EngineLike, cause: BaseException) -> None:
    """Fail the futures of utility calls (a reset, a pause of the core, ...) now waiting.

    A dead core never answers them. Thread-safe futures, so any thread may.
    """
    core = getattr(engine, "engine_core", None)
    with contextlib.suppress(Exception):
        for future in list(getattr(core, "utility_results", {}).values()):
            if not future.done():
                future.set_exception(cause)


def watch_outputs(engine: EngineLike, arrived: Callable[[], None]) -> Callable[[], bool] | None:
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


class StepTap:
    """What one step's output processing saw (written and read on the worker thread)."""

    __slots__ = ("preemptions", "prefill", "requests", "running", "seen", "tokens", "waiting")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the last step."""
        self.seen = False
        self.requests = self.tokens = self.prefill = 0
        self.preemptions: int | None = None
        self.running: int | None = None
        self.waiting: int | None = None


def tap_steps(engine: EngineLike, listening: Callable[[], bool]) -> StepTap:
    """Count what each ``step()`` hands to vLLM's output processor, while ``listening()``.

    Wraps the instance's ``process_outputs`` (called once per step with the
    core's ``EngineCoreOutput`` list, in-process and multiprocess alike) and
    ``update_scheduler_stats`` (the scheduler's counts, when stats are on).
    Installed on the worker thread when the first reader appears, and left
    in place: with no reader it costs one call of ``listening`` per step.
    Where this vLLM lacks them, the tap stays unseen and the record falls
    back to what ``step()`` returned.
    """
    tap = StepTap()
    processor = getattr(engine, "output_processor", None)
    process = getattr(processor, "process_outputs", None)
    if process is None:
        return tap
    states = getattr(processor, "request_states", {})
    preempted = EngineCoreEventType.PREEMPTED
    stats_on = bool(getattr(engine, "log_stats", False))

    def counting(core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        if listening():
            requests = tokens = prefill = preemptions = 0
            for out in core_outputs:
                state = states.get(out.request_id)
                if state is None:
                    # An output for a request aborted after the core stepped it (the
                    # abort crossed the step in flight, multiprocess): vLLM drops it,
                    # so it reached nobody and is no token of this step's record.
                    continue
                requests += 1
                tokens += len(out.new_token_ids)
                if getattr(state, "is_prefilling", False):
                    prefill += 1
                if out.events:
                    preemptions += sum(1 for event in out.events if event.type == preempted)
            tap.seen = True
            tap.requests, tap.tokens, tap.prefill = requests, tokens, prefill
            # vLLM records request events (preemptions among them) only with stats on.
            tap.preemptions = preemptions if stats_on else None
        return process(core_outputs, *args, **kwargs)

    setattr(processor, "process_outputs", counting)  # noqa: B010 (an instance's method)
    update = getattr(processor, "update_scheduler_stats", None)
    if update is not None:

        def scheduler(stats: Any) -> Any:
            if stats is not None and listening():
                tap.running = getattr(stats, "num_running_reqs", None)
                tap.waiting = getattr(stats, "num_waiting_reqs", None)
            return update(stats)

        setattr(processor, "update_scheduler_stats", scheduler)  # noqa: B010
    return tap


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


# -- requests and build-time reads, for the loop side (_loop) ------------------------
#
# The input processor, the engine-core request and what the engine set when it
# was built. ``read_build_time`` runs on the thread that built the engine;
# ``process_inputs`` and ``add_core_request`` on the worker thread (through
# ``run_on_engine``); the rest on the caller's loop.


@dataclass(frozen=True, slots=True)
class BuildTime:
    """What the ``LLMEngine`` set when it was built: it never changes after."""

    vllm_config: VllmConfig
    renderer: BaseRenderer
    input_processor: InputProcessor
    supported_tasks: tuple[Any, ...]


def read_build_time(engine: Any) -> BuildTime | None:
    """Read what ``engine`` set when it was built; None for a stand-in that has none.

    On the thread that built it, before anyone else uses it: the supported
    tasks are asked of the engine core once here (``LLMEngine`` caches them),
    so that input processing off the worker never calls the engine.
    """
    try:
        built = (engine.vllm_config, engine.renderer, engine.input_processor)
        tasks = tuple(engine.get_supported_tasks())
    except AttributeError:
        return None  # a stand-in for LLMEngine (a test's fake engine)
    return BuildTime(*built, tasks)


def is_core_request(prompt: Any) -> bool:
    """Whether ``prompt`` is already an engine-core request (which ``add_request`` takes as is)."""
    from vllm.v1.engine import EngineCoreRequest

    return isinstance(prompt, EngineCoreRequest)


def process_inputs(
    engine: LLMEngine | EngineLike,
    request_id: str,
    prompt: Any,
    params: SamplingParams,
    options: dict[str, Any],
) -> EngineCoreRequest:
    """Build the engine-core request of ``prompt`` with the engine's input processor.

    On the worker thread: the input processor is the worker's to use.
    ``options`` are ``process_inputs``' keyword arguments (``lora_request``,
    ``data_parallel_rank``, ...).
    """
    llm_engine: Any = engine  # an LLMEngine: the fakes never get here
    request: EngineCoreRequest = llm_engine.input_processor.process_inputs(
        request_id, prompt, params, supported_tasks=llm_engine.get_supported_tasks(), **options
    )
    return request


def set_reasoning(
    request: EngineCoreRequest,
    reasoning_ended: bool | None,
    reasoning_parser_kwargs: dict[str, Any] | None,
) -> None:
    """Set the reasoning fields that ``add_request`` has no parameter for on ``request``."""
    if reasoning_ended is not None:
        request.reasoning_ended = reasoning_ended
    if reasoning_parser_kwargs is not None:
        request.reasoning_parser_kwargs = reasoning_parser_kwargs


# The request fields that ``LLMEngine.add_request`` has no parameter for: set on the
# engine-core request that vLLM's input processor builds (as ``AsyncLLM`` sets them).
_CORE_FIELDS = ("reasoning_ended", "reasoning_parser_kwargs")


def add_request(
    engine: EngineLike,
    request_id: str,
    prompt: Any,
    params: SamplingParams,
    options: dict[str, Any],
) -> None:
    """``engine.add_request(request_id, prompt, params, **options)``, on the worker thread.

    ``options`` may also hold the reasoning fields, which ``add_request`` has no
    parameter for: then the input processor builds the engine-core request
    here (or ``prompt`` is one), the fields are set on it, and that request is
    added, as ``AsyncLLM.add_request`` does.
    """
    fields = {key: options[key] for key in _CORE_FIELDS if key in options}
    if not fields:
        engine.add_request(request_id, prompt, params, **options)
        return
    rest = {key: value for key, value in options.items() if key not in fields}
    text = rest.pop("prompt_text", None)
    if is_core_request(prompt):
        request = prompt
    else:
        request = process_inputs(engine, request_id, prompt, params, rest)
        if text is None:
            text = prompt if isinstance(prompt, str) else _text_of(prompt)
    set_reasoning(request, fields.get("reasoning_ended"), fields.get("reasoning_parser_kwargs"))
    engine.add_request(request_id, request, params, **_prompt_text(text))


def _prompt_text(text: str | None) -> dict[str, Any]:
    return {} if text is None else {"prompt_text": text}


def _text_of(prompt: Any) -> str | None:
    # The text of a rendered or typed prompt (a dict), for the outputs' ``prompt``.
    text = prompt.get("prompt") if isinstance(prompt, dict) else None
    return text if isinstance(text, str) else None


# -- input processing off the worker: built on the renderer's pool, added on the worker --
#
# ``AsyncLLM`` (0.32) runs ``InputProcessor.process_inputs`` on the renderer's
# thread pool (``process_inputs_async``), beside its loop; asynckv does the same,
# so tokenization never holds up the worker's steps. The tokenizer that pool uses
# is vLLM's thread-safe one (``maybe_make_thread_pool``: a deep copy per thread
# at once), so it never shares a Rust tokenizer with the worker's detokenizers.


@dataclass(frozen=True, slots=True)
class Prepared:
    """An engine-core request built off the worker, for the engine ``built`` describes."""

    request: EngineCoreRequest
    prompt_text: str | None
    built: BuildTime


def input_executor(built: BuildTime) -> Executor | None:
    """The thread pool that processes inputs for the engine ``built`` describes, if any.

    The renderer's own pool (``renderer_num_workers`` threads, 1 by default), as
    ``AsyncLLM.add_request`` uses it. None where the renderer has none (a
    vLLM before the pool) or the model takes multimodal inputs: their
    processor cache is filled in the order requests are processed and must
    match the engine core's, so those stay on the worker, in submission order.
    """
    if built.vllm_config.model_config.is_multimodal_model:
        return None
    executor = getattr(built.renderer, "_executor", None)
    return executor if isinstance(executor, Executor) else None


def prepare_request(
    built: BuildTime,
    request_id: str,
    prompt: Any,
    params: SamplingParams,
    options: dict[str, Any],
) -> Prepared:
    """Build the engine-core request of ``prompt`` as ``LLMEngine.add_request`` would.

    On the renderer's pool (``input_executor``), never on the worker. ``options``
    are ``add_request``'s (``_vllm.add_request``): the reasoning fields are set
    on the request, and ``prompt_text`` is what the outputs report as the prompt
    (else the prompt's own text, as ``LLMEngine.add_request`` takes it).

    Raises:
        What ``InputProcessor.process_inputs`` raises for a bad request.
    """
    from vllm.renderers.inputs.preprocess import extract_prompt_components

    process = {key: value for key, value in options.items() if key not in _NOT_PROCESSED}
    text = options.get("prompt_text")
    if is_core_request(prompt):
        request: EngineCoreRequest = prompt
    else:
        request = built.input_processor.process_inputs(
            request_id, prompt, params, supported_tasks=built.supported_tasks, **process
        )
        if text is None:
            text, _, _ = extract_prompt_components(built.vllm_config.model_config, prompt)
    set_reasoning(request, options.get("reasoning_ended"), options.get("reasoning_parser_kwargs"))
    return Prepared(request, text, built)


# What ``prepare_request`` takes out of the options before ``process_inputs``.
_NOT_PROCESSED = frozenset(("prompt_text", "reasoning_ended", "reasoning_parser_kwargs"))


def made_for(engine: EngineLike, prepared: Prepared) -> bool:
    """Whether ``prepared`` was built for ``engine`` (not for one a restart replaced)."""
    return getattr(engine, "vllm_config", None) is prepared.built.vllm_config


def add_prepared(engine: EngineLike, prepared: Prepared) -> None:
    """Add a request built off the worker, as ``LLMEngine.add_request`` adds one (worker thread).

    The part of ``add_request`` after input processing: the internal id, the
    output processor's state, the engine core; ``n > 1`` fans out into child
    requests. ``LLMEngine.add_request`` would take the request as its prompt
    too, but logs it as deprecated.
    """
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.parallel_sampling import ParentRequest

    llm_engine: Any = engine  # an LLMEngine: prepared requests are only made for one
    request = prepared.request
    llm_engine.input_processor.assign_request_id(request)
    params = request.params
    n = params.n if isinstance(params, SamplingParams) else 1
    if n == 1:
        llm_engine.output_processor.add_request(request, prepared.prompt_text, None, 0)
        llm_engine.engine_core.add_request(request)
        return
    parent = ParentRequest(request)
    for index in range(n):
        child_id, child_params = parent.get_child_info(index)
        child = request if index == n - 1 else copy.copy(request)
        child.request_id = child_id
        child.sampling_params = child_params
        llm_engine.output_processor.add_request(child, prepared.prompt_text, parent, index)
        llm_engine.engine_core.add_request(child)


# -- streaming input (AsyncLLM's generate with an async generator of StreamingInput) --
#
# On the worker thread. vLLM's engine core continues a "resumable" request with each
# new input of the same internal id; LLMEngine.add_request takes only the first (it
# assigns the internal id), so the later ones go to the output processor and the core
# as AsyncLLM._add_request sends them.


def stream_input_request(
    engine: EngineLike,
    request_id: str,
    prompt: Any,
    params: SamplingParams,
    options: dict[str, Any],
) -> EngineCoreRequest:
    """The engine-core request of a streaming session's first input (resumable).

    ``add_request`` then takes it as the prompt, and gives it its internal id.
    """
    process = {key: value for key, value in options.items() if key != "prompt_text"}
    return process_inputs(engine, request_id, prompt, params, process | {"resumable": True})


def _internal_id(engine: EngineLike, request_id: str) -> str | None:
    # The internal id vLLM gave the session's request (None once it has ended).
    ids = getattr(engine.output_processor, "external_req_ids", {}).get(request_id)
    return ids[0] if ids else None


def add_stream_input(
    engine: EngineLike,
    request_id: str,
    prompt: Any,
    params: SamplingParams,
    options: dict[str, Any],
) -> bool:
    """Add a streaming session's next input; False if the session is not in the engine."""
    internal = _internal_id(engine, request_id)
    if internal is None:
        return False
    process = {key: value for key, value in options.items() if key != "prompt_text"}
    request = process_inputs(engine, internal, prompt, params, process | {"resumable": True})
    request.external_req_id = request_id
    engine.output_processor.add_request(request, options.get("prompt_text"), None, 0)
    engine.engine_core.add_request(request)
    return True


def end_stream_input(
    engine: EngineLike, request_id: str, params: SamplingParams, options: dict[str, Any]
) -> bool:
    """Tell the engine a streaming session has no more input; whether it ended right here.

    As ``AsyncLLM`` does, with a non-resumable request of the same id. If the
    last input's completion is still running, it is the session's last and its
    final output says so. If it had already finished, vLLM's output processor
    ends the session at once and gives no output for it (``AsyncLLM``'s
    collector gets a sentinel that ``LLMEngine`` has no place for): then this
    returns True, and the caller ends the stream.
    """
    internal = _internal_id(engine, request_id)
    if internal is None:
        return False
    state = engine.output_processor.request_states.get(internal)
    process = {key: value for key, value in options.items() if key != "prompt_text"}
    request = process_inputs(engine, internal, {"prompt_token_ids": [0]}, params, process)
    request.external_req_id = request_id
    engine.output_processor.add_request(request, None, None, 0)
    engine.engine_core.add_request(request)
    return state is not None and getattr(state, "input_chunk_queue", None) is None


def rejected_kv_request(
    request_id: str, kv_transfer_params: dict[str, Any], data_parallel_rank: int | None
) -> EngineCoreRequest:
    """A pre-aborted engine-core request that makes a KV connector free what it pinned.

    As ``AsyncLLM.notify_kv_transfer_request_rejected`` builds it; where
    ``SamplingParams`` has a ``watermarking`` field (some vLLM versions), it is off.
    """
    import time

    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    fields = getattr(SamplingParams, "__struct_fields__", ())
    extra = {"watermarking": False} if "watermarking" in fields else {}
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[0],
        mm_features=None,
        sampling_params=SamplingParams(
            max_tokens=1, extra_args={"kv_transfer_params": dict(kv_transfer_params)}, **extra
        ),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=data_parallel_rank,
        abort_immediately=True,
    )


def add_core_request(engine: EngineLike, request: EngineCoreRequest) -> None:
    """Submit ``request`` straight to the engine core, past the input processor (worker thread)."""
    engine.engine_core.add_request(request)


# -- outputs, on the stream's loop ------------------------------------------------


def final_abort_output(
    request_id: str, last: RequestOutput | None, n: int, delta: bool
) -> RequestOutput:
    """A final "abort" output made from the last one seen, for when vLLM gave none.

    It carries all ``n`` completions (one not in ``last`` is an empty one), as
    vLLM's abort of an ``n > 1`` request ends every unfinished child; DELTA
    ones add nothing.
    """
    if last is None:
        final = RequestOutput(
            request_id=request_id,
            prompt=None,
            prompt_token_ids=None,
            prompt_logprobs=None,
            outputs=[],
            finished=True,
        )
    else:
        final = copy.copy(last)
        final.finished = True
        final.outputs = [copy.copy(c) for c in last.outputs]
    seen = {c.index for c in final.outputs}
    final.outputs += [CompletionOutput(i, "", [], None, None) for i in range(n) if i not in seen]
    final.outputs.sort(key=lambda c: c.index)
    for completion in final.outputs:
        if completion.finish_reason is None:
            completion.finish_reason = "abort"
        if delta:
            completion.text, completion.token_ids = "", []
            if completion.logprobs is not None:
                completion.logprobs = completion.logprobs[:0]
    return final


def merge_delta(into: RequestOutput, out: RequestOutput) -> None:
    """Append DELTA output ``out`` to ``into`` (vLLM's own aggregation)."""
    into.add(out, aggregate=True)


def copy_delta(out: RequestOutput) -> RequestOutput:
    """Copy a DELTA output deeply enough that merging into it changes nothing shared."""
    merged = copy.copy(out)
    merged.outputs = [copy.copy(c) for c in out.outputs]
    for c in merged.outputs:
        c.token_ids = list(c.token_ids)
        if c.logprobs is not None:
            c.logprobs = copy.copy(c.logprobs)
    return merged


def with_completions(out: RequestOutput, completions: list[CompletionOutput]) -> RequestOutput:
    """A shallow copy of ``out`` carrying ``completions`` instead of its own."""
    merged = copy.copy(out)
    merged.outputs = completions
    return merged


def request_stat(stats: Any, name: str) -> float | None:
    """One of vLLM's per-request stats (``RequestOutput.metrics``), if it has it.

    Timestamps: 0.0 means vLLM didn't record it (None here). Counters: None
    where this version doesn't keep it (0.26 has no ``num_preemptions``).
    """
    value = getattr(stats, name, None) if stats is not None else None
    if value is None:
        return None
    if name.endswith("_ts"):
        return float(value) if value else None
    return float(value)


# -- a dead engine's detokenizer, continued on the worker thread -----------------------
#
# A resumed completion's new tokens go through the dead engine's own detokenizer
# (``detokenizers`` above), so that its text and stop strings come out as without
# the death (``_worker/_splice.py``). These are the calls made of it, vLLM's
# ``IncrementalDetokenizer`` (vllm/v1/engine/detokenizer.py); all on the worker thread.


class Detokenizer(Protocol):
    """The calls made of vLLM's ``IncrementalDetokenizer``."""

    @property
    def output_token_ids(self) -> list[int]: ...

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None: ...

    def get_next_output_text(self, finished: bool, delta: bool) -> str: ...


def decoded_ids(detokenizer: Detokenizer) -> list[int]:
    """A copy of the token ids ``detokenizer`` has taken (none after a stop string)."""
    return list(detokenizer.output_token_ids)


def decode_more(detokenizer: Detokenizer, new_token_ids: list[int], by_token: bool) -> str | None:
    """Feed ``detokenizer`` new tokens; return the stop string they completed, if any.

    ``by_token``: the completion ended on a stop token (then no stop string is sought).
    """
    return detokenizer.update(new_token_ids, by_token)


def decoded_text(detokenizer: Detokenizer, finished: bool, delta: bool) -> str:
    """The text to send now: what is new (``delta``) or all of it, less the held-back tail."""
    return detokenizer.get_next_output_text(finished, delta)
