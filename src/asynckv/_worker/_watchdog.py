"""The watchdog thread: turns the death of an engine process into the worker's ``die``.

Runs on a thread of its own, started once a multiprocess-mode engine is
built. In that mode vLLM's ``step()`` can block forever once the
engine-core process is gone, so the worker thread can't be the one to
notice. The watchdog touches the engine only through the two thread-safe
calls in ``_vllm`` (``unblock_step``, ``fail_utility_calls``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from multiprocessing import connection
from typing import TYPE_CHECKING

from .._vllm import exit_status, fail_utility_calls, unblock_step

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from .._vllm import EngineLike

__all__ = ("watch",)


def watch(
    processes: Sequence[BaseProcess],
    engine: EngineLike,
    die: Callable[[BaseException], None],
    closing: threading.Event,
    worker: threading.Thread,
) -> None:
    """Wait for any of ``processes`` to end; then ``die`` with a cause naming it.

    Returns once ``closing`` is set, or once the worker thread has stopped
    after a death.
    """
    by_sentinel = {p.sentinel: p for p in processes}
    while not closing.is_set():
        ready = connection.wait(list(by_sentinel), timeout=1.0)
        if not ready or closing.is_set():
            continue
        process = by_sentinel[ready[0]]  # type: ignore[index]
        process.join(1.0)  # the sentinel fires before the exit code is reaped
        # vLLM's own shutdown may be reaping it on another thread at this moment:
        # then the code appears on the shared process object a moment later.
        for _ in range(20):
            if process.exitcode is not None or closing.wait(0.05):
                break
        status = exit_status(process.exitcode)
        cause = ChildProcessError(f"engine process {process.name} (pid {process.pid}) {status}")
        die(cause)
        unblock_step(engine, cause)
        # A command the worker was already applying may still call into the
        # dead core after that: keep failing such calls until the worker stops.
        while not closing.is_set():
            worker.join(0.1)
            if not worker.is_alive():
                break
            fail_utility_calls(engine, cause)
        return


def start(
    processes: Sequence[BaseProcess],
    engine: EngineLike,
    die: Callable[[BaseException], None],
    closing: threading.Event,
    worker: threading.Thread,
) -> None:
    """Start ``watch`` on a daemon thread of its own (no-op without processes)."""
    if processes:
        args = (processes, engine, die, closing, worker)
        threading.Thread(target=watch, args=args, name="asynckv-watchdog", daemon=True).start()
