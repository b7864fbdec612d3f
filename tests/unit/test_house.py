"""The package's shape: rooms named by thread, imports only downward, one object one class.

Reads ``src/asynckv`` as text (``ast``), runs nothing of it. It pins what
docs/architecture.md states: each folder is a room named for the thread that
runs its code, and a room imports only the rooms below it (so the worker
never reaches the caller's loop except through ``_bridge``); no import cycle,
type-only imports included, except the lazy trio import; no ``if
TYPE_CHECKING:`` block inside a class body (the glue of a class split across
files); no class more than one level below another class of the package;
every module's docstring opens by saying which thread runs it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "asynckv"

# The rooms, lowest first: a module may import its own room's and lower rooms' modules.
RANKS = {
    "leaf": 0,  # _errors _log _stats _types _vllm, testing: import no other room
    "_bridge": 1,
    "_worker": 2,
    "_loop": 3,
    "_pool": 4,
    "_serve": 5,
    "top": 6,  # __init__, serve, _api: the public face
}
TOP = {"asynckv", "asynckv.serve", "asynckv._api"}

# The one import allowed to close a circle: trio is imported only when a trio run calls in.
LAZY = {("asynckv._bridge._loops", "asynckv._bridge._trio")}

# Words of which each module's docstring must use one in its first line, to say which
# thread runs it: a thread (worker, caller's, any, both, main, calling), a loop, or none.
THREAD_WORDS = ("thread", "loop", "runs nowhere", "pure code")


def _modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = ["asynckv", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _room(module: str) -> str:
    if module in TOP:
        return "top"
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in RANKS:
        return parts[1]
    if len(parts) == 2 and parts[1] in RANKS:
        return parts[1]  # a room's own __init__
    return "leaf"


def _package_of(module: str) -> str:
    path = MODULES[module]
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def _imports(module: str) -> Iterator[str]:
    """Every asynckv module that ``module`` imports, anywhere in its text."""
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module).split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if not target.startswith("asynckv"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield sub if sub in MODULES else target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("asynckv"):
                    yield alias.name


GRAPH = {m: {t for t in _imports(m) if t in MODULES and t != m} for m in MODULES}


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if (v, w) in LAZY:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle() -> None:
    """No two modules import each other, even through others or for types only."""
    assert not _cycles(), "\n".join(map(str, _cycles()))


def test_rooms_import_only_downward() -> None:
    """A module imports only its own room and the rooms below it (the thread rule's fence)."""
    upward = [
        f"{m} ({_room(m)}) -> {t} ({_room(t)})"
        for m, targets in GRAPH.items()
        for t in targets
        # A module's own package (its __init__, imported for nothing but the path) is no room above.
        if RANKS[_room(t)] > RANKS[_room(m)] and m.rsplit(".", 1)[0] != t
    ]
    assert not upward, "\n".join(map(str, upward))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def test_no_type_checking_block_in_a_class() -> None:
    """No class re-declares another's attributes for the type checker (a class split in two)."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.If) and _is_type_checking(item.test):
                        found.append(f"{module}.{node.name}")
    assert not found, "\n".join(map(str, found))


def test_at_most_one_level_of_the_packages_own_classes() -> None:
    """No class inherits from a package class that itself inherits from a package class."""
    bases: dict[str, set[str]] = {}
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {b.id for b in node.bases if isinstance(b, ast.Name)}
                names |= {b.attr for b in node.bases if isinstance(b, ast.Attribute)}
                bases.setdefault(node.name, set()).update(names)
    ours = set(bases)
    deep = [
        f"{cls} -> {base} -> {grand}"
        for cls, names in bases.items()
        for base in names & ours
        for grand in bases[base] & ours
        if grand != base
    ]
    assert not deep, "\n".join(map(str, deep))


def test_every_module_says_which_thread_runs_it() -> None:
    """Each module's docstring opens by naming the thread (or saying it runs on none)."""
    silent = []
    for module, path in MODULES.items():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.split("\n", 1)[0].lower()
        if not any(word in first for word in THREAD_WORDS):
            silent.append(module)
    assert not silent, "\n".join(map(str, silent))
