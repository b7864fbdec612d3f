"""Keep the worker thread off the cores the engine's model workers are bound to.

Runs on the worker thread: ``Placement.attach`` right after an engine is
built, ``Placement.follow`` after each pass's commands and each step, ``Placement.release`` before
the next engine is built (a restart).

Why: vLLM's CPU backend binds each model worker process (its OpenMP
threads) to some of the process's cores and leaves the rest to the
frontend (``VLLM_CPU_NUM_OF_RESERVED_CPU``, one core by default), but it
does not hold the frontend there. The worker thread wakes at every step; when
the kernel places it on a model worker's core, it preempts the model for as
long as it runs. On the 2-core development machine, keeping the worker thread
and vLLM's output thread (which the worker built) on the frontend's core
while many requests run raised asynckv from 0.953 to 1.013 of the bare sync
loop's throughput at 256 streams, and from 0.938 to 0.984 at 1,024
(benchmarks/NOTES.md, change 11; ``Placement`` says why only then).
Nothing changes where the model workers are not bound to a subset of our
cores: a GPU, or the in-process mode, where the model runs on the worker
thread itself.

Only the worker's own threads are moved, never the caller's event loop. A
thread or process started later from the worker thread inherits the
placement, so ``release`` restores the thread's own CPUs before an engine
is rebuilt: its new processes must see every CPU, as the first ones did.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import psutil

from .._log import emit
from .._vllm import client_threads

if TYPE_CHECKING:
    from collections.abc import Iterable
    from multiprocessing.process import BaseProcess

    from .._vllm import EngineLike

__all__ = ("PIN_AT", "UNPIN_AT", "Placement", "frontend_cpus", "model_worker_cpus")

PIN_AT = 16
"""Requests in flight from which the worker is kept off the model cores."""
UNPIN_AT = 4
"""Requests in flight at or under which it may use every CPU again."""


def frontend_cpus(ours: frozenset[int], bound: frozenset[int]) -> frozenset[int] | None:
    """The CPUs to keep the worker on, or None to leave it where it is.

    ``ours``: the CPUs this thread may use; ``bound``: those the model workers
    are bound to (empty where they are not bound). None when nothing is bound
    within ours, or when the model workers take every one of them.
    """
    rest = ours - bound
    if not rest or rest == ours:
        return None
    return rest


def model_worker_cpus(cores: Iterable[int], ours: frozenset[int]) -> frozenset[int]:
    """The CPUs the engine's model workers are bound to: empty where none is bound.

    ``cores``: the pids of the engine-core processes. A model worker is any
    descendant of one (or the core itself, which is the model worker in
    vLLM's single-process executor) whose CPU affinity is a strict subset of
    ours: vLLM's CPU backend set it so.
    """
    bound: set[int] = set()
    for pid in cores:
        try:
            core = psutil.Process(pid)
            family = [core, *core.children(recursive=True)]
        except psutil.Error:  # ended meanwhile: the watchdog reports it
            continue
        for member in family:
            try:
                cpus = frozenset(member.cpu_affinity())
            except (psutil.Error, AttributeError):  # ended, or no affinity on this OS
                continue
            if cpus < ours:
                bound |= cpus
    return frozenset(bound)


class Placement:
    """The worker thread's CPUs: kept off the model workers' cores under load, and given back.

    Used by the worker thread only. After an engine is built, ``attach``
    finds the frontend's CPUs (none: nothing to do). Then, at every step,
    ``follow`` moves the worker thread and vLLM's output thread there once
    ``PIN_AT`` requests or more are in flight, and back to every CPU once
    ``UNPIN_AT`` or fewer are. Why only under load: a big batch keeps the
    model worker computing, and any thread placed on its core delays the
    step; with a few requests its steps are short and its core is mostly
    idle between them, while the frontend's core also runs the engine-core
    process, so the worker is faster left free (measured: 0.93-0.96 of the
    worker left free at one stream, and 1.04-1.05 at 16 streams, when always
    kept off; benchmarks/NOTES.md, changes 11 and 12). The gap
    between the bounds keeps a load near one of them from moving it every
    step. ``enabled=False`` (``keep_off_model_cores=False``) makes it all do
    nothing.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and hasattr(os, "sched_setaffinity")
        self.cpus: frozenset[int] | None = None
        """Where the worker thread is kept now, or None: on the CPUs it started with."""
        self.frontend: frozenset[int] | None = None
        """Where it goes under load: the CPUs no model worker is bound to (None: stays)."""
        self._own: frozenset[int] = frozenset()
        self._threads: tuple[int, ...] = ()

    def attach(self, engine: EngineLike, processes: list[BaseProcess]) -> None:
        """Find the frontend's CPUs of a newly built engine (before its first step)."""
        if not self.enabled or not processes:
            return
        own = frozenset(os.sched_getaffinity(0))  # 0: the calling thread, on Linux
        cores = [process.pid for process in processes if process.pid is not None]
        frontend = frontend_cpus(own, model_worker_cpus(cores, own))
        if frontend is None:
            return
        self._own, self.frontend = own, frontend
        self._threads = (0, *client_threads(engine))

    def follow(self, in_flight: int) -> None:
        """Move the threads as the load says (after each step: an int compare, mostly)."""
        if self.frontend is None:
            return
        if self.cpus is None:
            if in_flight >= PIN_AT:
                self._move(self.frontend)
        elif in_flight <= UNPIN_AT:
            self._move(self._own)

    def release(self) -> None:
        """Give the worker thread back the CPUs it started with (before a rebuild)."""
        if self.cpus is not None:
            self._move(self._own)
        self.frontend, self._threads = None, ()

    def _move(self, cpus: frozenset[int]) -> None:
        for thread in self._threads:
            try:
                os.sched_setaffinity(thread, cpus)
            except OSError as exc:  # a thread that ended; or a policy that forbids it
                emit(logging.DEBUG, "thread placement failed", thread=thread, error=str(exc))
        self.cpus = None if cpus == self._own else cpus
        emit(logging.DEBUG, "worker placed", cpus=sorted(cpus))
