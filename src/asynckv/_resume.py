"""Resuming a request on a rebuilt engine: what its stream was sent, and the splice.

Runs on the worker thread only: ``Progress.see`` inside ``Registry.dispatch``
(under the registry's lock: bookkeeping only, no engine call), and
``Progress.readmissions`` during a restart, between the old engine and the
new one. A ``Progress`` exists only with a ``RestartPolicy``; without one
outputs reach the streams untouched.

A resumed completion is a new engine request whose prompt is the original
prompt's token ids followed by the tokens already generated, with
``max_tokens`` and ``min_tokens`` reduced by their number. Its outputs carry
only what comes after the join, so ``see`` splices them onto what the
stream was sent: CUMULATIVE and FINAL_ONLY outputs carry everything from the
first token (ids, text, logprobs), DELTA outputs only what is new; the
prompt fields are the original request's. With ``n > 1`` each unfinished
completion is one engine request of ``n=1`` (ids ``<id>#<restart>.<index>``),
and the stream sees one request.

Text and stop strings: the new engine decodes the new tokens with only a few
prompt tokens as context, holds back the tail of its text while a stop
string could be completing, and looks for stop strings only in what it
generated. So the text is not taken from it: the dead engine's own
detokenizer (client side, so it outlives the engine) is fed the new tokens,
and gives the text, the hold-back and the stop strings exactly as without
the death. A stop string it finds ends the completion and its engine
request is aborted, as vLLM does. Where that detokenizer can't be had (a
fake engine, another vLLM layout), the text is spliced onto what was sent,
with the same hold-back and a search for stop strings across the join.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.sampling_params import RequestOutputKind

from ._errors import RequestNotResumedError

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingParams

    from ._commands import Add

__all__ = ("Decoded", "Progress", "Readmission")

Decoded = dict[str, list[tuple[int, Any]]]
"""Engine request id -> the dead engine's detokenizer of each completion: (index, detokenizer)."""

# The add_request options a resumed request keeps (the prompt is token ids now).
_KEPT_OPTIONS = ("lora_request", "priority", "trace_headers")


@dataclass(slots=True)
class _Seq:
    """What one completion's stream has been sent, as a whole (cumulative)."""

    tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: Any = None
    cumulative_logprob: float | None = None
    done: bool = False


@dataclass(slots=True)
class _Base:
    """A resumed completion: what came before the join, and how much text went out."""

    tokens: list[int]
    text: str
    logprobs: Any
    cumulative_logprob: float | None
    sent: int
    """Characters of text the stream has been sent (vLLM holds the tail back for stops)."""
    detokenizer: Any = None
    """The dead engine's detokenizer, continued (None: splice the text)."""
    new_text: list[str] = field(default_factory=list)
    checking: bool = True
    """Whether a stop string could still span the join."""


@dataclass(frozen=True, slots=True)
class Readmission:
    """One engine request to add to the new engine."""

    engine_id: str
    prompt: Any
    params: SamplingParams
    kwargs: dict[str, Any]


class Progress:
    """One request's progress, kept so that it can be resumed on a new engine."""

    __slots__ = (
        "add",
        "bases",
        "engine_ids",
        "kind",
        "n",
        "prompt",
        "prompt_ids",
        "prompt_logprobs",
        "restarts",
        "seqs",
        "stopped",
    )

    def __init__(self, add: Add) -> None:
        self.add = add
        self.kind = add.params.output_kind
        self.n = add.params.n
        self.prompt: str | None = None
        self.prompt_ids: list[int] | None = None
        self.prompt_logprobs: Any = None
        self.seqs: dict[int, _Seq] = {}
        self.bases: dict[int, _Base] = {}
        self.engine_ids: dict[str, int] = {add.request_id: -1}
        """Engine request id -> the completion it continues (-1: the original request)."""
        self.restarts = 0
        self.stopped: list[str] = []
        """Engine requests that a stop string across the join ended (to abort)."""

    # -- worker thread, under the registry's lock --------------------------------

    def see(self, out: RequestOutput) -> RequestOutput | None:
        """Note one engine output and return what the stream gets (None: nothing yet)."""
        index = self.engine_ids.get(out.request_id, -1)
        if index < 0:
            if self.prompt_ids is None and out.prompt_token_ids is not None:
                self.prompt = out.prompt
                self.prompt_ids = list(out.prompt_token_ids)
                self.prompt_logprobs = out.prompt_logprobs
            for completion in out.outputs:
                self._track(completion)
            return out
        spliced = [self._splice(index, c, out.request_id) for c in out.outputs]
        for completion in spliced:
            self._track(completion)
        finished = all(self.seqs.get(i, _Seq()).done for i in range(self.n))
        result = copy.copy(out)
        result.request_id = self.add.request_id
        result.prompt = self.prompt
        result.prompt_token_ids = self.prompt_ids
        result.prompt_logprobs = self.prompt_logprobs
        result.outputs = spliced
        result.finished = finished
        return result

    def _track(self, c: CompletionOutput) -> None:
        seq = self.seqs.get(c.index)
        if seq is None:
            seq = self.seqs[c.index] = _Seq()
        if self.kind is RequestOutputKind.DELTA:
            seq.tokens.extend(c.token_ids)
            seq.texts.append(c.text)
            if c.logprobs is not None:
                seq.logprobs = _joined(seq.logprobs, c.logprobs)
        else:
            # vLLM's cumulative lists, held as they are: copied only at a resume.
            seq.tokens = c.token_ids
            seq.texts = [c.text]
            seq.logprobs = c.logprobs
        seq.cumulative_logprob = c.cumulative_logprob
        seq.done = c.finish_reason is not None

    def _splice(self, index: int, c: CompletionOutput, engine_id: str) -> CompletionOutput:
        base = self.bases[index]
        if base.detokenizer is not None:
            return self._continue(base, index, c, engine_id)
        params = self.add.params
        delta = self.kind is RequestOutputKind.DELTA
        if delta:
            base.new_text.append(c.text)
        else:
            base.new_text = [c.text]
        full = base.text + "".join(base.new_text)
        spliced = copy.copy(c)
        spliced.index = index
        stops = params.stop or []
        if stops and base.checking:
            hit = _spanning(full, len(base.text), stops)
            if hit is not None:
                stop, start = hit
                full = full[: start + len(stop) if params.include_stop_str_in_output else start]
                spliced.finish_reason, spliced.stop_reason = "stop", stop
                if c.finish_reason is None:
                    self.stopped.append(engine_id)
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
                spliced.logprobs = _joined(_copied(base.logprobs), c.logprobs)
        base.sent = shown
        if base.cumulative_logprob is not None and c.cumulative_logprob is not None:
            spliced.cumulative_logprob = base.cumulative_logprob + c.cumulative_logprob
        return spliced

    def _continue(
        self, base: _Base, index: int, c: CompletionOutput, engine_id: str
    ) -> CompletionOutput:
        # The dead engine's detokenizer takes the new tokens, as its output processor would.
        detokenizer = base.detokenizer
        delta = self.kind is RequestOutputKind.DELTA
        spliced = copy.copy(c)
        spliced.index = index
        by_token = c.finish_reason == "stop" and not isinstance(c.stop_reason, str)
        fed = len(detokenizer.output_token_ids)
        # A cumulative output repeats the tokens since the join: feed only the new ones.
        new = list(c.token_ids if delta else c.token_ids[fed - len(base.tokens) :])
        stop = detokenizer.update(new, by_token)
        if stop is not None:
            spliced.finish_reason, spliced.stop_reason = "stop", stop
            if c.finish_reason is None:
                self.stopped.append(engine_id)
        spliced.text = detokenizer.get_next_output_text(spliced.finish_reason is not None, delta)
        if delta:
            # What the detokenizer kept (it drops the tokens after a stop string).
            spliced.token_ids = list(detokenizer.output_token_ids[fed:])
        else:
            spliced.token_ids = list(detokenizer.output_token_ids)
            if c.logprobs is not None:
                spliced.logprobs = _joined(_copied(base.logprobs), c.logprobs)
        if base.cumulative_logprob is not None and c.cumulative_logprob is not None:
            spliced.cumulative_logprob = base.cumulative_logprob + c.cumulative_logprob
        return spliced

    # -- worker thread, during a restart ------------------------------------------

    def readmissions(self, decoded: Decoded) -> list[Readmission]:
        """The engine requests that continue this request on a new engine.

        ``decoded`` maps each of this request's engine ids to the dead engine's
        detokenizers of its completions, where vLLM still has them.

        Raises:
            RequestNotResumedError: tokens were sent and the parameters can't be resumed.
        """
        add, params = self.add, self.add.params
        generated = any(seq.tokens for seq in self.seqs.values())
        if not self.bases and not generated:
            # Nothing sent yet (or only prompt fields): the request simply starts again.
            self.engine_ids = {add.request_id: -1}
            self.seqs = {}
            return [Readmission(add.request_id, add.prompt, params, add.kwargs)]
        self._refuse_inexact()
        assert self.prompt_ids is not None  # outputs carry the prompt's ids
        detokenizers = self._detokenizers(decoded)
        previous, self.bases = self.bases, {}
        for i in range(self.n):
            seq = self.seqs.get(i) or _Seq()
            if seq.done:
                continue
            tokens = list(seq.tokens)
            sent = "".join(seq.texts)
            before = previous.get(i)
            # The text so far: the last base's and what its splice added, or what was sent.
            text = sent if before is None else before.text + "".join(before.new_text)
            logprobs = _copied(seq.logprobs)
            base = _Base(tokens, text, logprobs, seq.cumulative_logprob, len(sent))
            detokenizer = detokenizers.get(i)
            if detokenizer is not None and len(detokenizer.output_token_ids) == len(tokens):
                base.detokenizer = detokenizer
            self.bases[i] = base
        self.restarts += 1
        if self.n == 1:
            self.engine_ids = {add.request_id: 0}
        else:
            self.engine_ids = {f"{add.request_id}#{self.restarts}.{i}": i for i in self.bases}
        kwargs = {k: v for k, v in add.kwargs.items() if k in _KEPT_OPTIONS}
        return [
            Readmission(
                engine_id,
                {"prompt_token_ids": [*self.prompt_ids, *self.bases[i].tokens]},
                _continued(params, len(self.bases[i].tokens), i),
                kwargs,
            )
            for engine_id, i in self.engine_ids.items()
        ]

    def _detokenizers(self, decoded: Decoded) -> dict[int, Any]:
        # Each completion's detokenizer: carried from the last restart, or the dead engine's.
        found = {i: b.detokenizer for i, b in self.bases.items() if b.detokenizer is not None}
        for engine_id, index in self.engine_ids.items():
            if index < 0:
                for own_index, detokenizer in decoded.get(engine_id, ()):
                    found.setdefault(own_index, detokenizer)
        return found

    def _refuse_inexact(self) -> None:
        params, add = self.add.params, self.add
        reason = None
        if getattr(params, "structured_outputs", None) is not None:
            reason = "structured outputs (the grammar's state is not replayed)"
        elif params.presence_penalty or params.frequency_penalty:
            reason = "presence or frequency penalties (they count only generated tokens)"
        elif not isinstance(add.prompt, str | dict) or (
            isinstance(add.prompt, dict)
            and ({"multi_modal_data", "prompt_embeds", "encoder_prompt"} & set(add.prompt))
        ):
            reason = "its prompt is not plain text or token ids"
        if reason is not None:
            raise RequestNotResumedError(add.request_id, reason)

    @property
    def resumed(self) -> bool:
        """Whether this request runs on a new engine as continued completions."""
        return bool(self.bases)


def _spanning(text: str, join: int, stops: list[str]) -> tuple[str, int] | None:
    """The stop string that starts before ``join`` and ends after it, earliest end first."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = text.find(stop, max(0, join - len(stop) + 1))
        if 0 <= start < join and (best is None or start + len(stop) < best[1] + len(best[0])):
            best = (stop, start)
    return best


def _copied(logprobs: Any) -> Any:
    # A list, or vLLM's FlatLogprobs (a slice is a copy of either).
    return None if logprobs is None else logprobs[:]


def _joined(into: Any, more: Any) -> Any:
    if into is None:
        return _copied(more)
    into.extend(more)
    return into


def _continued(params: SamplingParams, generated: int, index: int) -> SamplingParams:
    """The parameters of one completion continued after ``generated`` tokens."""
    continued = params.clone()
    continued.n = 1
    if continued.max_tokens is not None:
        continued.max_tokens = max(1, continued.max_tokens - generated)
    continued.min_tokens = max(0, continued.min_tokens - generated)
    # Computed over the original prompt, and sent already.
    continued.prompt_logprobs = None
    if continued.seed is not None:
        # The random stream can't be replayed: a new one, derived so that the
        # same restart point gives the same continuation.
        continued.seed = hash((continued.seed, generated, index)) % (1 << 63)
    return continued
