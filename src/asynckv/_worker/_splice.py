"""The splice, on the worker thread: a resumed completion's outputs joined onto what was sent.

Runs on the worker thread only, inside ``Progress.see`` (under the registry's
lock: bookkeeping only, no engine call). A resumed completion's engine
request carries only what comes after the join; these functions turn each of
its outputs into the one the stream gets: CUMULATIVE and FINAL_ONLY outputs
carry everything from the first token (ids, text, logprobs), DELTA outputs
only what is new.

Text and stop strings: the new engine decodes the new tokens with only a few
prompt tokens as context, holds back the tail of its text while a stop
string could be completing, and looks for stop strings only in what it
generated. So the text is not taken from it: the dead engine's own
detokenizer (client side, so it outlives the engine) is fed the new tokens,
and gives the text, the hold-back and the stop strings exactly as without
the death (``splice_decoded``). A stop string it finds ends the completion
and its engine request is aborted, as vLLM does. Where that detokenizer
can't be had (a fake engine, another vLLM layout), the text is spliced onto
what was sent, with the same hold-back and a search for stop strings across
the join (``splice_text``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._vllm import Detokenizer, decode_more, decoded_ids, decoded_text

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput
    from vllm.sampling_params import SamplingParams

__all__ = ("Base", "copied", "joined", "splice_decoded", "splice_text")


@dataclass(slots=True)
class Base:
    """A resumed completion: what came before the join, and how much text went out."""

    tokens: list[int]
    text: str
    logprobs: Any
    cumulative_logprob: float | None
    sent: int
    """Characters of text the stream has been sent (vLLM holds the tail back for stops)."""
    detokenizer: Detokenizer | None = None
    """The dead engine's detokenizer, continued (None: splice the text)."""
    new_text: list[str] = field(default_factory=list)
    checking: bool = True
    """Whether a stop string could still span the join."""


def splice_text(
    base: Base, index: int, c: CompletionOutput, params: SamplingParams, delta: bool
) -> tuple[CompletionOutput, bool]:
    """Join ``c`` onto ``base`` by its text, and note what was sent in ``base``.

    Returns the output the stream gets, and whether a stop string across the
    join ended a completion that its engine request goes on with (to abort).
    """
    if delta:
        base.new_text.append(c.text)
    else:
        base.new_text = [c.text]
    full = base.text + "".join(base.new_text)
    spliced = copy.copy(c)
    spliced.index = index
    stopped = False
    stops = params.stop or []
    if stops and base.checking:
        hit = _spanning(full, len(base.text), stops)
        if hit is not None:
            stop, start = hit
            full = full[: start + len(stop) if params.include_stop_str_in_output else start]
            spliced.finish_reason, spliced.stop_reason = "stop", stop
            stopped = c.finish_reason is None
        elif len(full) - len(base.text) >= max(len(s) for s in stops):
            base.checking = False
    if spliced.finish_reason is None and stops:
        hold = max(len(s) for s in stops) - 1
        shown = max(base.sent, len(full) - hold)
    else:
        shown = len(full)
    text = full[:shown]
    if delta:
        spliced.text = text[base.sent :]
    else:
        spliced.text = text
        spliced.token_ids = [*base.tokens, *c.token_ids]
        if c.logprobs is not None:
            spliced.logprobs = joined(copied(base.logprobs), c.logprobs)
    base.sent = shown
    if base.cumulative_logprob is not None and c.cumulative_logprob is not None:
        spliced.cumulative_logprob = base.cumulative_logprob + c.cumulative_logprob
    return spliced, stopped


def splice_decoded(
    base: Base, index: int, c: CompletionOutput, delta: bool
) -> tuple[CompletionOutput, bool]:
    """Join ``c`` onto ``base`` through the dead engine's detokenizer (``base.detokenizer``).

    Returns what ``splice_text`` returns.
    """
    # The dead engine's detokenizer takes the new tokens, as its output processor would.
    detokenizer = base.detokenizer
    assert detokenizer is not None
    spliced = copy.copy(c)
    spliced.index = index
    stopped = False
    by_token = c.finish_reason == "stop" and not isinstance(c.stop_reason, str)
    fed = len(decoded_ids(detokenizer))
    # A cumulative output repeats the tokens since the join: feed only the new ones.
    new = list(c.token_ids if delta else c.token_ids[fed - len(base.tokens) :])
    stop = decode_more(detokenizer, new, by_token)
    if stop is not None:
        spliced.finish_reason, spliced.stop_reason = "stop", stop
        stopped = c.finish_reason is None
    spliced.text = decoded_text(detokenizer, spliced.finish_reason is not None, delta)
    if delta:
        # What the detokenizer kept (it drops the tokens after a stop string).
        spliced.token_ids = decoded_ids(detokenizer)[fed:]
    else:
        spliced.token_ids = decoded_ids(detokenizer)
        if c.logprobs is not None:
            spliced.logprobs = joined(copied(base.logprobs), c.logprobs)
    if base.cumulative_logprob is not None and c.cumulative_logprob is not None:
        spliced.cumulative_logprob = base.cumulative_logprob + c.cumulative_logprob
    return spliced, stopped


def _spanning(text: str, join: int, stops: list[str]) -> tuple[str, int] | None:
    """The stop string that starts before ``join`` and ends after it, earliest end first."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = text.find(stop, max(0, join - len(stop) + 1))
        if 0 <= start < join and (best is None or start + len(stop) < best[1] + len(best[0])):
            best = (stop, start)
    return best


def copied(logprobs: Any) -> Any:
    """A copy of ``logprobs``: a list, or vLLM's FlatLogprobs (a slice is a copy of either)."""
    return None if logprobs is None else logprobs[:]


def joined(into: Any, more: Any) -> Any:
    """``into`` extended with ``more`` (a copy of ``more`` when ``into`` is None)."""
    if into is None:
        return copied(more)
    into.extend(more)
    return into
