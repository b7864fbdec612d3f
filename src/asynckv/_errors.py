"""The exceptions asynckv raises, one class per condition (any thread).

Runs on any thread: these are plain exception classes.
"""

from __future__ import annotations

from vllm.v1.engine.exceptions import EngineDeadError as _VllmEngineDeadError

__all__ = (
    "AsyncKVError",
    "EngineClosedError",
    "EngineDeadError",
    "EngineHeldError",
    "EngineNotStartedError",
    "EngineRestartingError",
    "EngineStalledError",
    "RequestNotResumedError",
)


class AsyncKVError(Exception):
    """Base class of every exception that asynckv raises itself.

    vLLM's own validation errors (a prompt that is too long, an unknown LoRA, ...)
    are not wrapped: they reach the caller unchanged.
    """


class EngineClosedError(AsyncKVError):
    """Raised when the engine was closed by ``aclose()`` or ``shutdown()``.

    Streams still in flight at the close end with it, and so does every call
    made after it. During a close's ``drain``, a new request ends with it at
    once (``draining`` is True, and the message says the engine is shutting
    down) while the admitted ones go on.
    """

    def __init__(self, *, draining: bool = False) -> None:
        self.draining = draining
        """Whether a drain refused it: the engine was finishing its admitted requests."""
        super().__init__(
            "the engine is shutting down: it finishes the requests it has and takes no new ones"
            if draining
            else "the engine was closed"
        )


class EngineNotStartedError(AsyncKVError):
    """Raised when an engine made by ``from_engine_args`` is used before ``start()``."""

    def __init__(self) -> None:
        super().__init__(
            "the engine is not started: await engine.start() or use 'async with engine'"
        )


class EngineDeadError(AsyncKVError, _VllmEngineDeadError):  # type: ignore[misc]  # vLLM: Any to mypy
    """Raised when the engine broke: ``step()`` raised or an engine process died.

    Every stream and command in flight at the death ends with it, and so does
    every later call. ``__cause__`` is the original exception, and the message
    names it, so the root cause is in the message itself.

    It is also a ``vllm.v1.engine.exceptions.EngineDeadError``, so code that
    catches vLLM's error (vLLM's own OpenAI server among it: a 500, then the
    server stops) catches this one.

    With a ``RestartPolicy`` it is raised only once the policy is spent (or
    a rebuild failed): ``deaths`` holds each death's cause, in order, and the
    message names every one. Without a policy ``deaths`` is ``(cause,)``.
    """

    def __init__(self, cause: BaseException, deaths: tuple[BaseException, ...] = ()) -> None:
        self.deaths: tuple[BaseException, ...] = deaths or (cause,)
        """Each death's cause, in order; the last is ``__cause__``."""
        if len(self.deaths) == 1:
            message = f"the engine died: {_name(cause)}"
        else:
            each = "; ".join(f"{i}) {_name(c)}" for i, c in enumerate(self.deaths, 1))
            message = f"the engine died {len(self.deaths)} times, beyond its restart policy: {each}"
        # Not vLLM's __init__: it would put its fixed message before ours in args.
        Exception.__init__(self, message)
        self.__cause__ = cause


def _name(cause: BaseException) -> str:
    detail = str(cause)
    name = type(cause).__name__
    return f"{name}: {detail}" if detail else name


class EngineRestartingError(AsyncKVError):
    """Raised by ``check_health`` while a dead engine is being rebuilt (its ``RestartPolicy``).

    The engine is degraded, not dead: requests and commands wait, and the
    unfinished requests resume once it is back. ``__cause__`` is the death.
    """

    def __init__(self, cause: BaseException | None) -> None:
        why = f" after {_name(cause)}" if cause is not None else ""
        super().__init__(f"the engine is restarting{why}")
        self.__cause__ = cause


class RequestNotResumedError(AsyncKVError):
    """Raised by a stream whose request could not be resumed exactly after a restart.

    The engine restarted (``RestartPolicy``) with tokens of this request
    already sent, and its parameters need state that a new engine can't
    rebuild from the tokens alone (docs/reliability.md lists them: structured
    outputs, presence and frequency penalties, multimodal and pre-built
    prompts). The other requests resumed; ``__cause__`` is the death.
    """

    def __init__(self, request_id: str, reason: str, cause: BaseException | None = None) -> None:
        super().__init__(f"request {request_id!r} could not be resumed after a restart: {reason}")
        self.__cause__ = cause


class EngineStalledError(AsyncKVError):
    """Raised by ``check_health(stall_timeout=...)`` when the engine stopped making progress.

    That is: requests are unfinished, nothing holds the engine on purpose, and
    no step has completed for longer than the timeout.
    """

    def __init__(self, seconds: float, in_flight: int) -> None:
        super().__init__(
            f"the engine is stalled: no step completed for {seconds:.1f} s "
            f"with {in_flight} requests unfinished"
        )


class EngineHeldError(AsyncKVError):
    """Raised at once by a call that needs engine steps which cannot come.

    That is a ``pause_generation(mode="wait")`` with requests in flight while
    the caller's own ``paused()`` block (or a ``"keep"`` pause) stops the
    stepping, or a ``paused(at_step=k)`` for a future step from inside the
    caller's own ``paused()`` block. The call changes nothing; without this
    error it would never return.
    """

    def __init__(self, call: str, reason: str) -> None:
        super().__init__(f"{call} can never complete: {reason}")
