"""What the model-based machines stand on: a fake engine, loop threads, stream consumers.

tests/model/test_model_fake.py and test_model_pool.py drive ``CreditEngine``
below; test_model_engine.py drives the real tiny engine. All consume streams
with ``Consumer`` and ``consume``.

``CreditEngine`` is the suite's ``FakeEngine`` made exact enough to model: it
emulates vLLM's multiprocess mode, where ``step()`` returns the engine core's
next output, which arrives on ``engine_core.outputs_queue``. The test puts one
credit there per step it allows, from its own thread, as vLLM's output thread
would; the worker sees it through its output hook. So steps happen exactly when
the test says, and the worker, with no credit, sleeps on its inbox and serves
commands. It honours ``output_kind`` and ``n`` as vLLM's output processor
does, records how every request ended, and flags a step that the model says
cannot happen (while a hold or a "keep" pause stops the stepping). Its tokens
are 0, 1, 2, ...; a token-ids prompt (a request resumed after a restart) of
length ``k`` continues that count from ``k - 1``, as a greedy engine would.
A rebuilt one (``primed=False``) starts as vLLM does before its output hook
has fired once: the worker may step it without a credit, and that step
blocks until one comes (``outputs_queue.watched`` says when the hook is in).

``LoopThread`` is an event loop running forever on a thread of its own;
``call`` runs a coroutine there and waits for it, bounded. ``Consumer`` is a
task on such a loop that awaits, iterates or ``anext``s a stream, recording
what it gave. ``Req`` is a request as a fake-engine model sees it; ``feed``
says when its consumer must take what the stream holds, and ``absorb`` checks
what the consumer took against the model (test_model_fake.py and
test_model_pool.py share them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import subprocess
import threading
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal, TypeVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from asynckv import AsyncEngine, EngineClosedError, EngineDeadError, RequestStream
from fakes import FakeEngine

T = TypeVar("T")

# How long any call may take before it counts as a hang.
BOUND = float(os.environ.get("ASYNCKV_MODEL_BOUND", "10"))

KINDS = {
    "delta": RequestOutputKind.DELTA,
    "cumulative": RequestOutputKind.CUMULATIVE,
    "final": RequestOutputKind.FINAL_ONLY,
}
LOOP = st.integers(0, 1)
PICK = st.integers(0, 7)

CREDIT = "credit"
"""What the test puts on the fake core's output queue to allow one step."""


class Hang(AssertionError):
    """Raised when a call the model says must complete did not within ``BOUND``."""


class FakeCoreProcess:
    """A stand-in for vLLM's engine-core process that the worker's watchdog can watch.

    A real child (``sleep``), wrapped in the part of ``multiprocessing.Process``
    the watchdog and ``close`` use; ``sentinel`` is a pidfd, readable once the
    child has exited. ``kill()`` is an engine-process death.
    """

    def __init__(self) -> None:
        self._popen = subprocess.Popen(["sleep", "3600"])
        self.pid = self._popen.pid
        self.name = "FakeEngineCore"
        self.sentinel = os.pidfd_open(self.pid)

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def dispose(self) -> None:
        """Kill the child if it still runs, reap it, close the pidfd."""
        self.kill()
        self.join(BOUND)
        with contextlib.suppress(OSError):
            os.close(self.sentinel)


@dataclass(eq=False)
class _Request:
    kind: RequestOutputKind
    n: int
    limit: int
    offset: int  # tokens generated before this engine had the request (a resumed one)


class WatchedQueue(queue.Queue[object]):
    """The core's output queue; ``watched`` is set once the worker hooks its ``put``."""

    def __init__(self) -> None:
        self.watched = threading.Event()
        super().__init__()

    def __setattr__(self, name: str, value: object) -> None:
        super().__setattr__(name, value)
        if name == "put":
            self.watched.set()


class CreditEngine(FakeEngine):
    """A fake ``LLMEngine`` that steps once per credit; see the module docstring.

    Written by the worker thread (inside its calls) and the test thread
    (``forbidden``, ``ceiling``, credits); ``cond`` guards what both read.
    """

    def __init__(self, process: FakeCoreProcess | None = None, primed: bool = True) -> None:
        super().__init__()
        self.cond = threading.Condition()
        self.outputs_queue = WatchedQueue()
        self.primed = primed
        """False: until a credit has come, a step waits for one (see the module docstring)."""
        manager = SimpleNamespace(processes=[] if process is None else [process])
        self.engine_core = SimpleNamespace(
            shutdown=self._shutdown,
            outputs_queue=self.outputs_queue,
            resources=SimpleNamespace(engine_manager=manager),
        )
        self.requests: dict[str, _Request] = {}
        self.ended: dict[str, tuple[str, int]] = {}
        """How each request left: ("length" | "abort", tokens it had)."""
        self.steps = 0
        """Calls of step() that returned."""
        self.productive = 0
        """Steps that took a credit and made a token for each request."""
        self.idle = 0
        """Steps called with no credit waiting (they return no output)."""
        self.resets = 0
        self.applied: list[tuple[int, int]] = []
        """(loop, seq) of the test's run_on_engine calls, in the order the worker ran them."""
        self.violations: list[str] = []
        self.forbidden: str | None = None
        """Why, as the model says, no step may start now (None: steps may start)."""
        self.ceiling: int | None = None
        """The highest step number that may run (a hold at that step is due)."""

    # -- what the worker calls ----------------------------------------------------

    def add_request(
        self, request_id: str, prompt: object, params: SamplingParams, /, **_: object
    ) -> None:
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        with self.cond:
            self.log.append(f"add {request_id}")
            self.tokens[request_id] = []
            self.limits[request_id] = params.max_tokens or 16
            self.requests[request_id] = _Request(
                params.output_kind, params.n, self.limits[request_id], len(ids) - 1 if ids else 0
            )

    def abort_request(self, request_ids: list[str]) -> None:
        with self.cond:
            for rid in request_ids:
                self.log.append(f"abort {rid}")
                tokens = self.tokens.pop(rid, None)
                if tokens is not None:
                    self.ended[rid] = ("abort", self.requests[rid].offset + len(tokens))

    def reset_prefix_cache(self, reset_running_requests: bool = False, *_: object) -> bool:
        with self.cond:
            self.resets += 1
            self.log.append("reset")
            return reset_running_requests or not self.tokens

    def step(self) -> list[RequestOutput]:
        self.step_entered.set()
        try:
            if self.primed:
                item = self.outputs_queue.get_nowait()
            else:
                item = self.outputs_queue.get(timeout=BOUND)
        except queue.Empty:
            item = None
        self.primed = True
        if isinstance(item, BaseException):
            raise item  # what vLLM's get_output does with the dead core's error
        with self.cond:
            number = self.steps + 1
            if self.forbidden is not None:
                self.violations.append(f"step {number} ran while {self.forbidden}")
            if self.ceiling is not None and number > self.ceiling:
                self.violations.append(f"step {number} ran past a hold due at {self.ceiling}")
            if self.fail_with is not None:
                raise self.fail_with
            try:
                if item is None:
                    self.idle += 1
                    return []
                self.productive += 1
                return self._outputs()
            finally:
                self.steps += 1
                self.cond.notify_all()

    def _outputs(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for rid, tokens in list(self.tokens.items()):
            request = self.requests[rid]
            tokens.append(request.offset + len(tokens))
            done = len(tokens) >= request.limit
            if done:
                del self.tokens[rid]
                self.ended[rid] = ("length", request.offset + len(tokens))
            outputs += _request_outputs(rid, request, tokens, done)
        return outputs

    # -- what the test calls -------------------------------------------------------

    def credit(self) -> None:
        """Allow one step (any thread): the core's next output has arrived."""
        self.outputs_queue.put_nowait(CREDIT)

    def drain(self) -> int:
        """Take back the credits not used (call between two steps); return how many."""
        count = 0
        while True:
            try:
                self.outputs_queue.get_nowait()
            except queue.Empty:
                return count
            count += 1

    def unfinished(self) -> dict[str, int]:
        """The requests the engine holds, with their token counts."""
        with self.cond:
            return {rid: self.requests[rid].offset + len(t) for rid, t in self.tokens.items()}


def _request_outputs(
    rid: str, request: _Request, tokens: list[int], done: bool
) -> list[RequestOutput]:
    """The outputs vLLM's output processor makes for one request after one step.

    Streaming kinds with ``n > 1`` give one output per child (finished only on
    the last); FINAL_ONLY gives one output with all ``n`` completions, at the end.
    """
    if request.kind is RequestOutputKind.FINAL_ONLY and not done:
        return []
    reason = "length" if done else None

    def completion(index: int) -> CompletionOutput:
        ids = tokens[-1:] if request.kind is RequestOutputKind.DELTA else list(tokens)
        return CompletionOutput(index, "", ids, None, None, finish_reason=reason)

    def output(completions: list[CompletionOutput], finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=rid,
            prompt=None,
            prompt_token_ids=[1],
            prompt_logprobs=None,
            outputs=completions,
            finished=finished,
        )

    if request.kind is RequestOutputKind.FINAL_ONLY or request.n == 1:
        return [output([completion(i) for i in range(request.n)], done)]
    return [output([completion(i)], done and i == request.n - 1) for i in range(request.n)]


class LoopThread:
    """An event loop running forever on a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` as a task on the loop (any thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], what: str, bound: float = BOUND) -> T:
        """Run ``fn()`` on the loop and return its result; ``Hang`` past ``bound`` seconds."""
        return wait(self.submit(fn()), what, bound)

    def stop(self) -> bool:
        """Cancel what still runs there, stop the loop, close it; False if it would not stop."""

        async def cancel_rest() -> int:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=BOUND)
            await self.loop.shutdown_default_executor()
            return len(tasks)

        try:
            self.call(cancel_rest, f"stopping {self.name}")
        except Hang:
            return False
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(BOUND)
        if self._thread.is_alive():
            return False
        self.loop.close()
        return True


def wait(future: concurrent.futures.Future[T], what: str, bound: float = BOUND) -> T:
    """The result of ``future``; ``Hang`` if it takes longer than ``bound`` seconds."""
    try:
        return future.result(bound)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise Hang(f"hang: {what} did not complete within {bound} s") from None


def wait_event(event: threading.Event, what: str, bound: float = BOUND) -> None:
    """Wait for ``event``; ``Hang`` if it is not set within ``bound`` seconds."""
    if not event.wait(bound):
        raise Hang(f"hang: {what} did not happen within {bound} s")


# -- consuming a stream --------------------------------------------------------------

ConsumerKind = Literal["await", "iterate", "anext", "anext_aiter", "break_keep", "inline_break"]


@dataclass(eq=False)
class Consumer:
    """A task on a stream's loop that awaits, iterates or ``anext``s it.

    Written by its task on the loop; read by the test thread once ``done`` is set.
    """

    kind: ConsumerKind
    done: threading.Event = field(default_factory=threading.Event)
    outputs: list[RequestOutput] = field(default_factory=list)
    result: RequestOutput | None = None  # what an await gave
    error: BaseException | None = None
    trace: str = ""
    cancelled: bool = False
    stopped: bool = False  # StopAsyncIteration
    after_end: str = ""  # what a further anext gave after the end of an iteration
    due: bool = False  # the model says it has ended (or will before the next rule)
    task: asyncio.Task[None] | None = None


def keep_error(consumer: Consumer, exc: BaseException) -> None:
    """Record ``exc`` with its traceback, then let the traceback's frames go."""
    consumer.error = exc
    consumer.trace = "".join(traceback.format_exception(exc))
    # The traceback's frames hold the stream: let it go, as a user's handler would.
    exc.__traceback__ = None


async def consume(consumer: Consumer, stream: RequestStream) -> None:
    """Consume ``stream`` as ``consumer.kind`` says, recording what it gave."""
    # RequestStream is its own async iterator (issue 13); typed loosely for the old code.
    it: Any = stream
    try:
        if consumer.kind == "await":
            consumer.result = await stream
        elif consumer.kind == "iterate":
            async for out in stream:
                consumer.outputs.append(out)
            try:
                extra = await anext(aiter(stream))
            except StopAsyncIteration:
                consumer.after_end = "stop"
            except Exception as exc:
                consumer.after_end = repr(exc)
            else:
                consumer.after_end = f"another output: {extra}"
        elif consumer.kind == "anext":
            consumer.outputs.append(await anext(it))
        elif consumer.kind == "anext_aiter":
            consumer.outputs.append(await anext(aiter(stream)))
        elif consumer.kind == "break_keep":
            async for out in stream:
                consumer.outputs.append(out)
                break
    except StopAsyncIteration:
        consumer.stopped = True
    except asyncio.CancelledError:
        consumer.cancelled = True
    except Exception as exc:
        keep_error(consumer, exc)
    finally:
        del stream, it
        consumer.done.set()


def start_inline_break(
    loop: LoopThread, engine: AsyncEngine, prompt: str, params: SamplingParams, rid: str
) -> Consumer:
    """``async for out in engine.generate(...): break`` in a task on ``loop``.

    The stream is dropped at its first output: the request is aborted at once.
    """
    consumer = Consumer("inline_break")

    async def body() -> None:
        try:
            async for out in engine.generate(prompt, params, request_id=rid):
                consumer.outputs.append(out)
                break
        except asyncio.CancelledError:
            consumer.cancelled = True
        except Exception as exc:
            keep_error(consumer, exc)
        finally:
            consumer.done.set()

    async def start() -> None:
        consumer.task = asyncio.create_task(body())

    loop.call(start, "starting a consumer")
    return consumer


def start_consumer(loop: LoopThread, consumer: Consumer, stream: RequestStream) -> None:
    """Start ``consumer`` on ``stream`` in a task on ``loop``."""

    async def start() -> None:
        consumer.task = asyncio.create_task(consume(consumer, stream))

    loop.call(start, "starting a consumer")


# -- the model of a request, and what its stream gave ---------------------------------


@dataclass(eq=False)
class Result:
    """What a call returned or raised."""

    value: Any = None
    error: BaseException | None = None


@dataclass(eq=False)
class Req:
    """A request as the model sees it."""

    rid: str
    loop: int
    n: int
    kind: RequestOutputKind
    max_tokens: int
    state: Literal["parked", "running", "ended"]
    tokens: int = 0
    outcome: str = ""  # once ended: length, abort, dead or closed
    end_tokens: int = 0
    cause: str = ""  # for dead: lines of text the error's message must contain
    stream: RequestStream | None = None  # the model's reference, if it holds one
    consumer: Consumer | None = None
    unread: bool = False  # the stream holds output (or its end) nobody has taken
    consumed_end: bool = False  # a consumer took the final output or the error
    closed: bool = False  # aclose()d or dropped: no more consuming
    lossy: bool = False  # a cancelled await took DELTA pieces that are lost
    delta: dict[int, list[int]] = field(default_factory=dict)
    cumulative: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)
    final: RequestOutput | None = None

    @property
    def streaming(self) -> bool:
        return self.kind is not RequestOutputKind.FINAL_ONLY


def feed(req: Req) -> None:
    """The stream has new output, or its end: a consumer waiting on it takes it now.

    (It does so before the next step or command: rules wait for both loops.)
    """
    consumer = req.consumer
    if consumer is None or consumer.due:
        return
    if consumer.kind in ("await", "iterate"):
        req.unread = False
        consumer.due = req.state == "ended"
    elif req.unread or req.state == "ended":
        consumer.due, req.unread = True, False


def absorb(req: Req, consumer: Consumer) -> None:
    """Check what a consumer that ended took from its stream (its outputs, result or error)."""
    req.consumer, consumer.task = None, None
    what = f"{req.rid} ({consumer.kind})"
    assert not consumer.cancelled, f"{what}: the task was cancelled"
    for out in consumer.outputs:
        piece(req, out, awaited=False)
    if consumer.result is not None:
        piece(req, consumer.result, awaited=True)
    if consumer.error is not None:
        ended_with(req, consumer.error, consumer.trace)
    elif consumer.stopped:
        raise AssertionError(f"{what}: StopAsyncIteration before the end")
    elif consumer.kind in ("await", "iterate"):
        assert req.consumed_end, f"{what}: ended without a final output"
    else:
        assert len(consumer.outputs) == 1, (what, consumer.outputs)
    if consumer.kind == "iterate" and consumer.error is None:
        assert consumer.after_end == "stop", (
            f"{what}: after the end, anext gave {consumer.after_end}"
        )


def ended_with(req: Req, error: BaseException, trace: str) -> None:
    """Check the error a stream ended with against the outcome the model gave its request."""
    expected = {"dead": EngineDeadError, "closed": EngineClosedError}.get(req.outcome)
    assert expected is not None and isinstance(error, expected), (
        f"{req.rid} ({req.state}, {req.outcome}): raised {error!r}\n{trace}"
    )
    if isinstance(error, EngineDeadError):
        names(error, req.cause)
    req.consumed_end = True


def piece(req: Req, out: RequestOutput, awaited: bool) -> None:
    """Check one output a consumer took against the model, and the end if it is final."""
    what = f"{req.rid}: output {out}"
    assert not req.consumed_end, f"{what} after the stream's end"
    assert out.request_id == req.rid, what
    indices = [c.index for c in out.outputs]
    assert set(indices) <= set(range(req.n)), what
    if awaited:
        assert indices == list(range(req.n)), f"{what}: awaited, not all n completions in order"
    limit = req.end_tokens if req.state == "ended" else req.tokens
    for c in out.outputs:
        ids = list(c.token_ids)
        if req.kind is RequestOutputKind.DELTA:
            req.delta.setdefault(c.index, []).extend(ids)
        else:
            assert ids == list(range(len(ids))), what
            assert len(ids) >= req.cumulative.get(c.index, 0), f"{what}: fewer tokens than before"
            req.cumulative[c.index] = len(ids)
        assert len(req.delta.get(c.index, ids)) <= limit or req.lossy, f"{what}: beyond {limit}"
        req.reasons[c.index] = c.finish_reason
    if req.kind is RequestOutputKind.FINAL_ONLY:
        assert out.finished, f"{what}: FINAL_ONLY gave an unfinished output"
    if not out.finished:
        assert any(c.finish_reason is None for c in out.outputs) or req.n > 1, what
        return
    assert req.state == "ended" and req.outcome in ("length", "abort"), (
        f"{what}: final, but the model says {req.state} {req.outcome}"
    )
    req.consumed_end, req.final = True, out
    check_final(req, out)


def check_final(req: Req, out: RequestOutput) -> None:
    """Check a final output: every completion ends as the model says, with its tokens."""
    what = f"{req.rid} ({req.outcome} at {req.end_tokens}): final {out}"
    expected = list(range(req.end_tokens))
    for i in range(req.n):
        assert req.reasons.get(i) == req.outcome, f"{what}: completion {i} ends {req.reasons}"
        if req.kind is RequestOutputKind.DELTA:
            assert req.lossy or req.delta.get(i) == expected, f"{what}: deltas {req.delta}"
            continue
        completion = next((c for c in out.outputs if c.index == i), None)
        assert completion is not None, f"{what}: no completion {i}"
        ids = list(completion.token_ids)
        if req.kind is RequestOutputKind.FINAL_ONLY and req.outcome == "abort":
            # With no output from vLLM to copy, the stream's own abort output is empty.
            assert ids in ([], expected), what
        else:
            assert ids == expected, what


def names(error: BaseException, cause: str) -> None:
    """``error``'s message names each death in ``cause`` (one a line)."""
    for line in cause.split("\n"):
        assert line in str(error), (str(error), cause)


class StreamRules(RuleBasedStateMachine):
    """The rules both fake-engine machines share: a stream consumed, cancelled, closed.

    A machine that inherits them keeps its requests in ``reqs`` and its loops
    in ``loops``, and says what its model does where they differ: ``_abort``
    (the model's side of an abort), ``_aclose`` (``stream.aclose()`` run on a
    loop) and ``_settled`` (what it checks once a cancelled request has ended).
    Its own ``consume`` rule picks from ``_consumable`` with its own consumers.
    """

    reqs: dict[str, Req]
    loops: list[LoopThread]

    def _abort(self, req: Req) -> None:
        raise NotImplementedError

    def _aclose(self, loop: int, stream: RequestStream) -> Result:
        raise NotImplementedError

    def _settled(self) -> None:
        raise NotImplementedError

    def _pick(self, items: list[Any], pick: int) -> Any:
        return items[pick % len(items)]

    def _consumable(self) -> list[Req]:
        return [
            r
            for r in self.reqs.values()
            if r.stream is not None and r.consumer is None and not r.closed and not r.consumed_end
        ]

    def _start_consumer(self, req: Req, kind: ConsumerKind) -> None:
        assert req.stream is not None
        req.consumer = Consumer(kind)
        start_consumer(self.loops[req.loop], req.consumer, req.stream)
        feed(req)

    def _waiting_consumers(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.consumer is not None and not r.consumer.due]

    @precondition(lambda self: self._waiting_consumers())
    @rule(pick=PICK)
    def cancel(self, pick: int) -> None:
        """Cancel the task that awaits, iterates or ``anext``s a stream: its request is aborted."""
        req = self._pick(self._waiting_consumers(), pick)
        consumer = req.consumer
        assert consumer is not None and consumer.task is not None
        note(f"{req.rid}: cancel its {consumer.kind} task")
        task = consumer.task

        async def go() -> None:
            task.cancel()
            await asyncio.wait([task], timeout=BOUND)

        self.loops[req.loop].call(go, "cancelling a consumer")
        wait_event(consumer.done, f"{req.rid}: the cancelled {consumer.kind} task ending")
        assert consumer.cancelled, f"{req.rid}: cancelled, the task ended with {consumer.error!r}"
        req.consumer, consumer.task = None, None
        if consumer.kind == "await" and req.kind is RequestOutputKind.DELTA:
            req.lossy = True
        for out in consumer.outputs:
            piece(req, out, awaited=False)
        self._abort(req)
        self._settled()

    def _closable(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.stream is not None and r.consumer is None]

    @precondition(lambda self: self._closable())
    @rule(pick=PICK)
    def stream_aclose(self, pick: int) -> None:
        """``await stream.aclose()``: aborts an unfinished request, returns once it ended."""
        req = self._pick(self._closable(), pick)
        note(f"{req.rid}: aclose()")
        stream = req.stream
        assert stream is not None
        result = self._aclose(req.loop, stream)
        del stream
        assert result.error is None, f"stream.aclose() raised {result.error!r}"
        self._abort(req)
        req.closed, req.consumed_end, req.unread = True, True, False

    def _settle_consumers(self) -> None:
        """Every consumer due has ended, as predicted; every other one still waits."""
        for req in list(self.reqs.values()):
            consumer = req.consumer
            if consumer is None:
                continue
            if consumer.due:
                wait_event(consumer.done, f"{req.rid}: its {consumer.kind} task ending")
                absorb(req, consumer)
            elif consumer.done.is_set():
                absorb(req, consumer)
                raise AssertionError(
                    f"{req.rid}: its {consumer.kind} task ended, but the model says it must wait "
                    f"(state {req.state}): outputs {consumer.outputs}, result {consumer.result}, "
                    f"error {consumer.error!r} {consumer.trace}"
                )


def held_tokens(snapshot: dict[str, int]) -> dict[str, set[int]]:
    """Each request's token counts in an engine's snapshot (engine id -> tokens).

    A resumed n=2 request is one engine request per completion
    (``<id>#<restart>.<index>``), so a request may hold several counts.
    """
    held: dict[str, set[int]] = {}
    for engine_id, tokens in snapshot.items():
        held.setdefault(engine_id.split("#")[0], set()).add(tokens)
    return held
