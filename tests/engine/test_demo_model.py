"""The demo model: built deterministically, and it has learned its training text."""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm import SamplingParams

from asynckv import AsyncEngine
from asynckv.testing import _training, demo_model
from support import engine_args, start_engine

CORPUS = (importlib.resources.files("asynckv") / "_data" / "corpus.txt").read_text("utf-8")


@pytest.fixture(scope="module")
def demo_engine() -> Iterator[AsyncEngine]:
    """An engine on the demo model (built here first if it isn't cached)."""
    started = start_engine(engine_args(demo_model()))
    yield started
    started.shutdown()


def test_build_is_deterministic_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two builds in clean cache folders write identical files; a third call reuses the first.

    On a recipe of 3 training steps, not 300: the same code, seeds and kernels
    (a nondeterministic one shows in any step), where two full trainings cost
    minutes of CI. The step count is part of the recipe, so these builds get a
    folder name of their own.
    """
    monkeypatch.setitem(_training._TRAINING, "steps", 3)
    first = demo_model(tmp_path / "a")
    second = demo_model(tmp_path / "b")
    assert first.name == second.name
    names = sorted(p.name for p in first.iterdir())
    assert "model.safetensors" in names
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name

    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert demo_model(tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.engine
@pytest.mark.parametrize(
    "line",
    [
        "To be, or not to be, that is the question:",
        "It was the best of times,",
        "It is a truth universally acknowledged,",
        "Four score and seven years ago",
        "Call me Ishmael.",
    ],
)
async def test_greedy_continues_training_text(demo_engine: AsyncEngine, line: str) -> None:
    """Greedy decoding of a line from the training text reproduces the text's next words."""
    following = CORPUS[CORPUS.index(line) + len(line) :]
    expected = following[:32]
    out = await demo_engine.generate(line, SamplingParams(temperature=0.0, max_tokens=16))
    assert out.outputs[0].text[: len(expected)] == expected
