"""The reliability suite: each test states its invariant and reports its figures.

Figures (requests, kinds, seconds) are collected with the ``figures`` fixture
and printed at the end of the run, so CI's log shows them.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

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
