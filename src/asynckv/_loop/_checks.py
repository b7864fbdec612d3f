"""Checks of public arguments, shared by ``AsyncEngine`` and ``AsyncEnginePool``.

Run on the caller's thread, before anything reaches a worker, so that a
wrong argument fails its own call at once and nothing else.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable
from typing import get_args

from vllm.sampling_params import SamplingParams

from .._types import PauseMode, RestartPolicy

__all__ = (
    "pause_mode",
    "request_id",
    "request_ids",
    "restart",
    "sampling_params",
    "stream_interval",
)


def sampling_params(params: object) -> SamplingParams:
    """The request's parameters: the defaults for None; refuses what vLLM would hang on."""
    checked = SamplingParams() if params is None else params
    if not isinstance(checked, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, not {type(checked).__name__}")
    if checked.seed is not None and not -(2**63) <= checked.seed < 2**64:
        # vLLM 0.32 accepts it, then its engine core drops the request and
        # step() never returns: refuse it here.
        raise ValueError(f"seed must fit in 64 bits, got {checked.seed}")
    return checked


def request_id(rid: object) -> str:
    """The given request id, or a new unique one for None."""
    checked = uuid.uuid4().hex if rid is None else rid
    if not isinstance(checked, str):
        raise TypeError(f"request_id must be a str, not {type(checked).__name__}")
    return checked


def request_ids(ids: str | Iterable[str]) -> list[str]:
    """One id or many, as a list of ids."""
    checked = [ids] if isinstance(ids, str) else list(ids)
    if not all(isinstance(i, str) for i in checked):
        raise TypeError("request ids must be str")
    return checked


def pause_mode(mode: object) -> PauseMode:
    """A ``pause_generation`` mode."""
    for known in get_args(PauseMode):
        if mode == known:
            return known  # type: ignore[no-any-return]
    raise ValueError(f"mode must be one of {get_args(PauseMode)}, not {mode!r}")


def stream_interval(seconds: object) -> float:
    """A stream interval in seconds: a finite number >= 0 (0: every output at once)."""
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise TypeError(f"stream_interval must be a number of seconds, not {seconds!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"stream_interval must be finite and >= 0, got {seconds}")
    return float(seconds)


def restart(policy: object) -> RestartPolicy | None:
    """The restart policy: None (a death is final) or a ``RestartPolicy``."""
    if policy is not None and not isinstance(policy, RestartPolicy):
        raise TypeError(f"restart must be a RestartPolicy or None, not {type(policy).__name__}")
    return policy
