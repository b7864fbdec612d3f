"""One built engine and all that belongs to it, on the worker thread; a rebuild replaces it whole.

Made and used on the worker thread, except ``output_arrived`` (vLLM's output
thread: a plain store and the inbox's own lock) and ``died`` (the watchdog
thread: one store, then a nudge). A restart makes a new ``EngineRun`` for the
new engine, taking over only the commands to apply again (``carry``): a
late report from the old engine's watchdog or output thread lands on the old
run, which nobody reads any more.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._vllm import EngineLike, engine_processes, has_core_process, watch_outputs

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from ._handoff import Order

__all__ = ("EngineRun",)


class EngineRun:
    """One engine the worker serves: its processes, its faults, its output hook."""

    def __init__(
        self,
        engine: EngineLike,
        generation: int,
        nudge: Callable[[], None],
        carry: deque[Order] | None = None,
    ) -> None:
        self.engine = engine
        self.generation = generation
        """0 for the first engine, one more for each rebuild."""
        self._nudge = nudge
        self.carry: deque[Order] = deque() if carry is None else carry
        """Commands to apply first (on this engine, then on the next if it dies mid-batch)."""
        self.fault: BaseException | None = None
        """A death the watchdog saw (written there, read by the worker: one word)."""
        self.left = threading.Event()
        """Set once the worker leaves this engine (or closes): stops its watchdog."""
        self.processes: list[BaseProcess] = engine_processes(engine)
        self.hook_fired = False
        """Whether vLLM's output thread ever told us of an output (multiprocess mode)."""
        self.output_ready: Callable[[], bool] | None = watch_outputs(engine, self.output_arrived)
        """Whether the core's next output is waiting (None: no hook, step blindly)."""
        self._core_stats = has_core_process(engine)
        """Whether an output with nothing in flight is the core's scheduler stats (vLLM's
        engine-core client); anything else is stepped only for its requests."""

    def output_arrived(self) -> None:
        """The core's next output arrived (vLLM's output thread)."""
        self.hook_fired = True
        self._nudge()

    def died(self, cause: BaseException) -> None:
        """The watchdog saw this engine die (restart policy); the worker notices next pass."""
        self.fault = cause
        self._nudge()

    def output_waiting(self) -> bool:
        """Whether a ``step()`` would find an output (or can't tell)."""
        ready = self.output_ready
        return ready is None or ready()

    def output_known_waiting(self) -> bool:
        """Whether the hook says the core's next output is waiting (False if it can't tell).

        With nothing unfinished such an output carries only the core's
        scheduler stats (the step after an abort, say): stepping reads it,
        so vLLM's gauges follow the core at once.
        """
        ready = self.output_ready
        return self._core_stats and ready is not None and ready()
