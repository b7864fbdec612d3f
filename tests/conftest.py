"""Shared engines for the suite: starting one costs 15-70 s, so each is started once.

The engines are started with a throwaway event loop and then used from each
test's own loop, which is itself what asynckv promises: one started engine
serves any loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import pytest

from asynckv import AsyncEngine
from asynckv.testing import tiny_model
from support import engine_args, start_engine


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The tiny Llama checkpoint, built once and cached on disk."""
    return tiny_model()


@pytest.fixture(scope="session")
def engine(model_path: Path) -> Iterator[AsyncEngine]:
    """A started engine in vLLM's default multiprocess mode, shared by the suite."""
    started = start_engine(engine_args(model_path))
    yield started
    started.shutdown()


@pytest.fixture(scope="session")
def inproc_engine(model_path: Path) -> Iterator[AsyncEngine]:
    """An in-process engine (no engine-core process), built by hand and wrapped."""
    from vllm import LLMEngine
    from vllm.v1.executor import Executor

    config = engine_args(model_path).create_engine_config()
    llm_engine = LLMEngine(
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=False,
        multiprocess_mode=False,
    )
    wrapped = AsyncEngine(llm_engine)
    yield wrapped
    wrapped.shutdown()


# -- the reliability suite: each test reports its figures at the end of the run --

_FIGURES: list[str] = []


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Record one line of figures for this test."""

    def record(line: str) -> None:
        _FIGURES.append(f"{request.node.name}: {line}")

    return record


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "reliability" in item.nodeid:
            item.add_marker(pytest.mark.reliability)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("reliability figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)
