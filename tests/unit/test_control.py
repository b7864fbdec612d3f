"""The admission / hold / pause state machine, tested as data: no threads, no engine."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, get_args

import pytest

from asynckv import EngineHeldError
from asynckv._types import PauseMode
from asynckv._worker._control import (
    Abort,
    AbortAll,
    Admit,
    Answer,
    Control,
    Drain,
    Effect,
    Fail,
    PauseCore,
    Phase,
    ResetCache,
    ResumeCore,
)

State = Control[str, str]
Step = tuple[State, list[Effect[str, str]]]


def answered(effects: list[Effect[str, str]]) -> set[str]:
    """The replies that the effects answer, by success or failure."""
    return {e.reply for e in effects if isinstance(e, Answer | Fail)}


def test_requests_are_admitted_or_parked_and_admitted_in_order_on_resume() -> None:
    """Running, a request is admitted; paused, it is parked until resume admits all, in order."""
    state: State = Control()
    state, effects = state.add("a")
    assert effects == [Admit("a")]
    state, _ = state.pause("abort", False, "p", in_flight=False, caller_holds=frozenset())
    state, effects = state.add("b")
    state, more = state.add("c")
    assert effects == more == [] and state.parked == ("b", "c")
    state, effects = state.resume("r")
    assert effects == [Admit("b"), Admit("c"), Answer("r")]
    assert state == Control()


def test_aborting_a_parked_request_admits_and_aborts_it() -> None:
    """A parked request that is aborted leaves the park as an Abort effect; others stay."""
    state: State = Control(phase=Phase.PAUSED, parked=("a", "b"))
    state, effects = state.abort_parked(lambda a: a == "a")
    assert effects == [Abort("a")] and state.parked == ("b",)
    same, none = state.abort_parked(lambda a: a == "unknown")
    assert none == [] and same is state


def test_holds_now_later_passed_and_stacked() -> None:
    """A hold applies now or after its step, refuses a passed step, and holds stack."""
    state: State = Control()
    state, effects = state.hold("h1", None, 3, "r1", frozenset())
    assert effects == [Answer("r1", 3)] and not state.stepping
    state, effects = state.hold("h2", 2, 3, "r2", frozenset())
    assert isinstance(effects[0], Fail) and isinstance(effects[0].error, ValueError)
    state, effects = state.hold("h3", 5, 3, "r3", frozenset())
    assert effects == [] and len(state.pending) == 1
    state = state.release("h1")
    assert state.stepping
    state, effects = state.stepped(4)
    assert effects == []
    state, effects = state.stepped(5)
    assert effects == [Answer("r3", 5)] and state.holds == {"h3"} and not state.pending
    assert state.release("h3").stepping


def test_a_future_hold_inside_the_callers_own_hold_fails_at_once() -> None:
    """paused(at_step=k) for a future k from inside one's own hold could never be entered."""
    state: State = Control()
    state, _ = state.hold("mine", None, 0, "r1", frozenset())
    after, effects = state.hold("inner", 4, 0, "r2", frozenset({"mine"}))
    assert after is state
    assert isinstance(effects[0], Fail) and isinstance(effects[0].error, EngineHeldError)
    # Another task's hold waits instead: the first hold will be released.
    state, effects = state.hold("other", 4, 0, "r3", frozenset())
    assert effects == [] and len(state.pending) == 1


def test_wait_refused_when_it_could_never_return() -> None:
    """'wait' with requests in flight fails under a keep pause or the caller's own hold."""
    frozen: State = Control(phase=Phase.FROZEN)
    after, effects = frozen.pause("wait", True, "w", in_flight=True, caller_holds=frozenset())
    assert after is frozen
    assert isinstance(effects[0], Fail) and isinstance(effects[0].error, EngineHeldError)
    assert "keep" in str(effects[0].error)

    held: State = Control(holds=frozenset({"mine"}))
    after, effects = held.pause("wait", True, "w", in_flight=True, caller_holds=frozenset({"mine"}))
    assert after is held
    assert isinstance(effects[0], Fail) and "paused() block" in str(effects[0].error)

    # Someone else's hold: the wait is pending until the drain.
    state, effects = held.pause("wait", True, "w", in_flight=True, caller_holds=frozenset())
    assert effects == [] and state.drains == (Drain("w", True),)
    state, effects = state.drained()
    assert effects == [ResetCache(running=False), Answer("w")] and not state.drains

    # Nothing in flight: a wait never needs a step, whatever holds.
    state, effects = held.pause(
        "wait", False, "w", in_flight=False, caller_holds=frozenset({"mine"})
    )
    assert state.phase is Phase.PAUSED and state.drains == (Drain("w", False),)


def test_keep_freezes_and_abort_after_keep_aborts_before_thawing_the_core() -> None:
    """With an engine-core process, keep pauses its scheduler; abort then aborts, then thaws it."""
    state: State = Control(core=True)
    state, effects = state.pause("keep", True, "k", in_flight=True, caller_holds=frozenset())
    assert effects == [PauseCore(True), Answer("k")]
    assert state.phase is Phase.FROZEN and state.core_paused and not state.stepping
    state, effects = state.pause("abort", False, "a", in_flight=True, caller_holds=frozenset())
    assert effects == [AbortAll("paused"), ResumeCore(), Answer("a")]
    assert state.phase is Phase.PAUSED and not state.core_paused and state.stepping


def test_keep_in_process_clears_by_resetting_running_requests() -> None:
    """In-process, keep with clear_cache preempts the running requests through a reset."""
    state: State = Control(core=False)
    state, effects = state.pause("keep", True, "k", in_flight=True, caller_holds=frozenset())
    assert effects == [ResetCache(running=True), Answer("k")] and not state.core_paused
    state, effects = state.resume("r")
    assert effects == [Answer("r")] and state.phase is Phase.RUNNING


def test_resume_answers_pending_waits_and_is_a_no_op_when_running() -> None:
    """Resume ends a pending 'wait'; resuming a running engine only answers."""
    state: State = Control()
    state, _ = state.pause("wait", False, "w", in_flight=True, caller_holds=frozenset())
    state, effects = state.resume("r")
    assert effects == [Answer("w"), Answer("r")]
    again, effects = state.resume("r2")
    assert effects == [Answer("r2")] and again == state


def test_waiting_lists_everything_an_end_must_fail() -> None:
    """The end of the engine finds every parked request, pending hold and pending wait."""
    state: State = Control(phase=Phase.PAUSED, parked=("a",))
    state, _ = state.hold("h", 9, 0, "hold-reply", frozenset())
    state, _ = state.pause("wait", False, "wait-reply", in_flight=True, caller_holds=frozenset())
    assert state.waiting() == (["a"], ["hold-reply", "wait-reply"])


# -- every pair of operations has a defined outcome ----------------------------------

Op = Callable[[State, str], Step]
_OPS: dict[str, Op] = {
    "hold": lambda s, r: s.hold(f"hold-{r}", None, 0, r, frozenset()),
    "hold later": lambda s, r: s.hold(f"hold-{r}", 1, 0, r, frozenset()),
    "own hold later": lambda s, r: s.hold(f"hold-{r}", 1, 0, r, s.holds),
    "release": lambda s, r: (s.release(next(iter(s.holds), "none")), [Answer(r)]),
    "resume": lambda s, r: s.resume(r),
}


def _pause(mode: PauseMode, clear: bool, own: bool) -> Op:
    def op(state: State, reply: str) -> Step:
        holds = state.holds if own else frozenset()
        return state.pause(mode, clear, reply, in_flight=True, caller_holds=holds)

    return op


for _mode, _clear, _own in itertools.product(get_args(PauseMode), (False, True), (False, True)):
    _name = f"{'own-hold ' if _own else ''}{_mode}{' clear' if _clear else ''}"
    _OPS[_name] = _pause(_mode, _clear, _own)


def _pending(state: State) -> set[Any]:
    return {h.reply for h in state.pending} | {d.reply for d in state.drains}


@pytest.mark.parametrize(("core"), [False, True], ids=["in-process", "core-process"])
@pytest.mark.parametrize(("first", "second"), list(itertools.product(_OPS, repeat=2)))
def test_every_pair_of_operations_is_defined(first: str, second: str, core: bool) -> None:
    """Each reply is answered at once or stays pending for a stated reason; none is lost."""
    state: State = Control(core=core)
    for reply, name in (("first", first), ("second", second)):
        state, effects = _OPS[name](state, reply)
        done = answered(effects)
        assert (reply in done) != (reply in _pending(state)), (name, effects, state)
        if reply in _pending(state):
            # A pending call waits for a step or a drain that can still come.
            assert state.phase is not Phase.FROZEN or reply in {h.reply for h in state.pending}
        assert state.core_paused == (core and state.phase is Phase.FROZEN), (name, state)
        for effect in effects:
            if isinstance(effect, Fail):
                assert isinstance(effect.error, EngineHeldError | ValueError), effect
