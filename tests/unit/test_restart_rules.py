"""Restart's pure rules, without an engine: the deaths a policy allows, and a resume's splice."""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput

from asynckv import (
    RestartPolicy,
)
from asynckv._bridge._channel import Add
from asynckv._worker._life import Deaths
from asynckv._worker._resume import Progress


def test_deaths_within_the_window() -> None:
    """The policy allows max_restarts deaths within any window seconds, and no more."""
    deaths = Deaths(RestartPolicy(max_restarts=2, window=10.0))
    allowed = []
    for cause, now in ((OSError("1"), 0.0), (OSError("2"), 5.0), (OSError("3"), 9.0)):
        deaths, ok = deaths.record(cause, now)
        allowed.append(ok)
    assert allowed == [True, True, False]  # three within 10 s
    spaced = Deaths(RestartPolicy(max_restarts=2, window=10.0))
    for t in (0.0, 5.0, 10.0, 15.0):
        spaced, ok = spaced.record(OSError(str(t)), t)
        assert ok
    assert spaced.restarts == 4
    assert not Deaths(RestartPolicy(max_restarts=0)).record(OSError(), 0.0)[1]


# -- the splice ------------------------------------------------------------------------


def _out(rid: str, text: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    reason = "length" if finished else None
    completion = CompletionOutput(0, text, tokens, None, None, finish_reason=reason)
    return RequestOutput(rid, "p", [7], None, [completion], finished)


def _progress(params: SamplingParams) -> Progress:
    sink: Any = None
    return Progress(Add("r", "p", params, {}, sink))


def test_stop_string_across_the_join_stops() -> None:
    """Without vLLM's detokenizer: a stop string begun before the join and ended after stops."""
    progress = _progress(SamplingParams(max_tokens=50, stop=["STOP"]))
    progress.see(_out("r", "hello ST", [1, 2]))
    (again,) = progress.readmissions({})
    assert again.prompt == {"prompt_token_ids": [7, 1, 2]}
    assert again.params.max_tokens == 48
    spliced = progress.see(_out("r", "OP and on", [3, 4]))
    assert spliced is not None
    (completion,) = spliced.outputs
    assert (completion.text, completion.finish_reason, completion.stop_reason) == (
        "hello ",
        "stop",
        "STOP",
    )
    assert completion.token_ids == [1, 2, 3, 4]
    assert spliced.finished
    assert spliced.prompt_token_ids == [7]
    assert progress.stopped == ["r"]  # the engine request is to be aborted


def test_cumulative_splice_keeps_everything() -> None:
    """CUMULATIVE after a resume: ids, text and logprobs from the first token; min_tokens cut."""
    progress = _progress(SamplingParams(max_tokens=10, min_tokens=4, seed=3))
    progress.see(_out("r", "ab", [1, 2]))
    (again,) = progress.readmissions({})
    assert (again.params.max_tokens, again.params.min_tokens) == (8, 2)
    assert again.params.seed != 3  # documented: a new random stream, derived
    spliced = progress.see(_out("r", "c", [3], finished=True))
    assert spliced is not None
    assert (spliced.outputs[0].text, spliced.outputs[0].token_ids) == ("abc", [1, 2, 3])
    assert spliced.finished


def test_n2_resumes_each_unfinished_completion() -> None:
    """n=2: each unfinished completion is its own engine request, mapped back to its index."""
    progress = _progress(SamplingParams(n=2, max_tokens=5))
    out = _out("r", "a", [1])
    out.outputs.append(CompletionOutput(1, "b", [2], None, None, None))
    progress.see(out)
    readmissions = progress.readmissions({})
    assert [r.engine_id for r in readmissions] == ["r#1.0", "r#1.1"]
    assert [r.prompt["prompt_token_ids"] for r in readmissions] == [[7, 1], [7, 2]]
    assert all(r.params.n == 1 for r in readmissions)
    one = progress.see(_out("r#1.1", "c", [3], finished=True))
    assert one is not None and not one.finished
    assert (one.outputs[0].index, one.outputs[0].token_ids) == (1, [2, 3])
    both = progress.see(_out("r#1.0", "d", [4], finished=True))
    assert both is not None and both.finished and both.request_id == "r"
