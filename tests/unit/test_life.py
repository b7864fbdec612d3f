"""The worker's lifecycle as data: its states and pure transitions, without an engine or threads."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from asynckv import EngineClosedError, EngineDeadError, RestartPolicy
from asynckv._worker._life import (
    Closed,
    Dead,
    Deaths,
    GiveUp,
    New,
    Rebuild,
    Rebuilding,
    Restarting,
    Running,
    Starting,
    State,
    close,
    dead_error_of,
    die,
    died,
    error_of,
    planned,
    restarting,
    running,
    start,
)

POLICY = RestartPolicy(max_restarts=2, window=10.0)


def test_start_then_running() -> None:
    """New -> Starting -> Running; start and running change nothing else."""
    state: State = New()
    state = start(state)
    assert state == Starting()
    state = running(state)
    assert state == Running()
    assert start(state) == Running()
    assert running(New()) == New()


def test_a_death_within_the_policy_restarts_with_its_cause() -> None:
    """A death the policy allows gives Restarting(cause) and Rebuild; running() ends it."""
    cause = OSError("killed")
    state, action = died(Running(), Deaths(POLICY), cause, 0.0)
    assert state == Restarting(cause)
    assert isinstance(action, Rebuild)
    assert action.deaths.causes == (cause,) and action.deaths.restarts == 1
    assert running(state) == Running()


def test_a_death_beyond_the_policy_gives_up_with_every_cause() -> None:
    """The third death within the window gives GiveUp carrying all three causes."""
    deaths, state = Deaths(POLICY), running(Starting())
    causes = [OSError(str(i)) for i in range(3)]
    actions = []
    for i, cause in enumerate(causes):
        state, action = died(state, deaths, cause, float(i))
        deaths = action.deaths
        actions.append(action)
        state = running(state)
    assert [type(a) for a in actions] == [Rebuild, Rebuild, GiveUp]
    assert actions[-1].deaths.causes == tuple(causes)
    assert state == Running()  # the worker then dies with them


def test_a_death_once_ended_is_not_counted() -> None:
    """Dead or closed meanwhile: nothing to restart, and the death isn't recorded."""
    deaths = Deaths(POLICY)
    for ended in (Dead(EngineDeadError(OSError())), Closed(EngineClosedError())):
        state, action = died(ended, deaths, OSError(), 0.0)
        assert state is ended
        assert action == GiveUp(deaths)


def test_die_then_close() -> None:
    """A death ends it first; a close after it records the close and keeps the death's error."""
    dead_error, closed_error = EngineDeadError(OSError("x")), EngineClosedError()
    state, first = die(Running(), dead_error)
    assert (state, first) == (Dead(dead_error), True)
    assert die(state, EngineDeadError(OSError("y"))) == (state, False)
    closed, first = close(state, closed_error)
    assert (closed, first) == (Closed(dead_error, dead_error), False)
    assert error_of(closed) is dead_error and dead_error_of(closed) is dead_error


def test_close_first() -> None:
    """A close ends it first; a death or another close after it changes nothing."""
    error = EngineClosedError()
    state, first = close(Restarting(OSError()), error)
    assert (state, first) == (Closed(error), True)
    assert close(state, EngineClosedError()) == (state, False)
    assert die(state, EngineDeadError(OSError())) == (state, False)
    assert error_of(state) is error and dead_error_of(state) is None
    assert error_of(Running()) is None and dead_error_of(Restarting(OSError())) is None


_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["start", "running", "died", "die", "close"]),
        st.floats(min_value=0.0, max_value=5.0),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(events=_EVENTS, max_restarts=st.integers(0, 3), window=st.floats(0.5, 20.0))
def test_transitions_keep_their_invariants(
    events: list[tuple[str, float]], max_restarts: int, window: float
) -> None:
    """Once Closed never leaves Closed; Dead goes only to Closed; every death beyond the
    policy gives up; only the first end says so; the death's error outlives a close."""
    policy = RestartPolicy(max_restarts=max_restarts, window=window)
    state: State = New()
    deaths = Deaths(policy)
    now, ends = 0.0, 0
    for event, dt in events:
        now += dt
        before = state
        match event:
            case "start":
                state = start(state)
            case "running":
                state = running(state)
            case "died":
                cause = OSError("died")
                state, action = died(state, deaths, cause, now)
                if isinstance(before, Dead | Closed):
                    assert action == GiveUp(deaths)
                else:
                    recent = [t for t in (*deaths.times, now) if now - t < window]
                    beyond = len(recent) > max_restarts
                    assert isinstance(action, GiveUp) == beyond
                    assert state == (before if beyond else Restarting(cause))
                    assert action.deaths.causes[:-1] == deaths.causes
                    deaths = action.deaths
            case "die":
                state, first = die(state, EngineDeadError(OSError("dead")))
                ends += first
            case _:
                state, first = close(state, EngineClosedError())
                ends += first
        if isinstance(before, Closed):
            assert state is before
        if isinstance(before, Dead):
            assert state is before or state == Closed(before.error, before.error)
        if isinstance(state, Dead | Closed):
            assert error_of(state) is not None
        if isinstance(before, Dead) or dead_error_of(before) is not None:
            assert dead_error_of(state) is dead_error_of(before)
        assert ends <= 1
        assert deaths.restarts <= len(deaths.causes)


def test_a_planned_restart_is_rebuilding_not_a_death() -> None:
    """Running -> Rebuilding -> Running; refused in any other state; no death is recorded."""
    state, allowed = planned(Running())
    assert (state, allowed) == (Rebuilding(), True)
    assert restarting(state) and error_of(state) is None and dead_error_of(state) is None
    assert running(state) == Running()
    for other in (New(), Starting(), Restarting(OSError()), Rebuilding(), Dead(OSError())):
        assert planned(other) == (other, False)
    # A death while rebuilding is a death like any other (the policy counts it).
    after, action = died(Rebuilding(), Deaths(POLICY), OSError("x"), 0.0)
    assert isinstance(after, Restarting) and isinstance(action, Rebuild)
    assert close(Rebuilding(), EngineClosedError())[1]
