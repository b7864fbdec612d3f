"""The step tap counts what vLLM's output processor hands on, and nothing it drops."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from asynckv._vllm import EngineLike, tap_steps


class _Processor:
    """vLLM's ``OutputProcessor`` as the tap reads it: its states and ``process_outputs``."""

    def __init__(self, states: dict[str, Any]) -> None:
        self.request_states = states
        self.handed: list[Any] = []

    def process_outputs(self, core_outputs: list[Any], *args: Any, **kwargs: Any) -> None:
        self.handed = core_outputs


def _out(request_id: str, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, new_token_ids=[7] * tokens, events=None)


def test_an_output_for_an_aborted_request_is_not_counted() -> None:
    """An abort that crossed a step in flight leaves an output vLLM drops: no token of ours."""
    processor = _Processor(
        {"live": SimpleNamespace(is_prefilling=False), "new": SimpleNamespace(is_prefilling=True)}
    )
    engine = cast(EngineLike, SimpleNamespace(output_processor=processor, log_stats=True))
    tap = tap_steps(engine, lambda: True)
    outputs = [_out("live", 1), _out("aborted", 1), _out("new", 1)]
    cast(Any, processor).process_outputs(outputs)
    assert processor.handed == outputs  # vLLM still gets every output, to drop its own
    assert tap.seen
    assert (tap.requests, tap.tokens, tap.prefill, tap.preemptions) == (2, 2, 1, 0)


def test_nothing_is_counted_while_nobody_listens() -> None:
    """With no reader the tap passes outputs through and records nothing."""
    processor = _Processor({"live": SimpleNamespace(is_prefilling=False)})
    engine = cast(EngineLike, SimpleNamespace(output_processor=processor, log_stats=False))
    tap = tap_steps(engine, lambda: False)
    cast(Any, processor).process_outputs([_out("live", 1)])
    assert not tap.seen and tap.tokens == 0
