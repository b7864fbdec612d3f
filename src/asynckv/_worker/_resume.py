"""Resuming a request on a rebuilt engine, on the worker thread: what was sent, the readmission.

Runs on the worker thread only: ``Progress.see`` inside ``Registry.dispatch``
(under the registry's lock: bookkeeping only, no engine call), and
``Progress.readmissions`` during a restart, between the old engine and the
new one. A ``Progress`` exists only with a ``RestartPolicy``; without one
outputs reach the streams untouched.

A resumed completion is a new engine request whose prompt is the original
prompt's token ids followed by the tokens already generated, with
``max_tokens`` and ``min_tokens`` reduced by their number. Its outputs carry
only what comes after the join, so ``see`` splices them onto what the
stream was sent (``_splice.py``: the ids, the text, the stop strings across
the join); the prompt fields are the original request's. With ``n > 1``
each unfinished completion is one engine request of ``n=1`` (ids
``<id>#<restart>.<index>``), and the stream sees one request.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.sampling_params import RequestOutputKind

from .._errors import RequestNotResumedError
from .._vllm import Detokenizer, decoded_ids
from ._splice import Base, copied, joined, splice_decoded, splice_text

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingParams

    from .._bridge._channel import Add

__all__ = ("Decoded", "Progress", "Readmission")

Decoded = dict[str, list[tuple[int, Detokenizer]]]
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
        self.bases: dict[int, Base] = {}
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
                seq.logprobs = joined(seq.logprobs, c.logprobs)
        else:
            # vLLM's cumulative lists, held as they are: copied only at a resume.
            seq.tokens = c.token_ids
            seq.texts = [c.text]
            seq.logprobs = c.logprobs
        seq.cumulative_logprob = c.cumulative_logprob
        seq.done = c.finish_reason is not None

    def _splice(self, index: int, c: CompletionOutput, engine_id: str) -> CompletionOutput:
        base = self.bases[index]
        delta = self.kind is RequestOutputKind.DELTA
        if base.detokenizer is not None:
            spliced, stopped = splice_decoded(base, index, c, delta)
        else:
            spliced, stopped = splice_text(base, index, c, self.add.params, delta)
        if stopped:
            self.stopped.append(engine_id)
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
            logprobs = copied(seq.logprobs)
            base = Base(tokens, text, logprobs, seq.cumulative_logprob, len(sent))
            detokenizer = detokenizers.get(i)
            if detokenizer is not None and len(decoded_ids(detokenizer)) == len(tokens):
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

    def _detokenizers(self, decoded: Decoded) -> dict[int, Detokenizer]:
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
