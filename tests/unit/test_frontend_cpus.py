"""The CPUs left to the worker thread beside the model workers' (``_placement.frontend_cpus``)."""

from __future__ import annotations

from asynckv._worker._placement import frontend_cpus


def test_frontend_cpus() -> None:
    """The CPUs left to the worker: ours less the bound ones, unless that is none or all."""
    assert frontend_cpus(frozenset({0, 1}), frozenset({0})) == frozenset({1})
    assert frontend_cpus(frozenset({0, 1, 2, 3}), frozenset({0, 1, 7})) == frozenset({2, 3})
    assert frontend_cpus(frozenset({0, 1}), frozenset()) is None  # nothing bound: a GPU
    assert frontend_cpus(frozenset({0, 1}), frozenset({0, 1})) is None  # nothing left
    assert frontend_cpus(frozenset({1}), frozenset({0})) is None  # bound elsewhere
