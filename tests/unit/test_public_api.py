"""The public API against its record (tests/unit/public_api.txt): unchanged, or strictly extended.

The record lists every public name of ``asynckv``, ``asynckv.testing`` and
``asynckv.serve`` (their ``__all__``), with the signature of every public
callable and of every public method, property and protocol dunder of each
public class (the members its own classes define, whichever of them does:
moving a method between asynckv's classes changes nothing here), the fields of
the dataclasses (their constructor) and the members of the enums.

The rule: every recorded name is still there, of the same kind, with the same
return annotation and the same parameters in the same order (names, kinds,
annotations as written, defaults). A signature may gain only optional
parameters: keyword-only ones, ``*args``/``**kwargs``, or positional ones after
every recorded positional one, all with defaults. New names pass too. So
``AsyncEngine.from_vllm_config`` gaining ``restart`` and ``keep_off_model_cores``
(issue 28) passes against the record taken before it.

After a deliberate change that passes (an extension), re-record, so that the
next change is measured from it, with::

    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python tests/unit/test_public_api.py --record

A removal or an incompatible change is a breaking release: it needs the
record re-taken the same way, in a commit that says so.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RECORD = Path(__file__).with_name("public_api.txt")
MODULES = ("asynckv", "asynckv.testing", "asynckv.serve")
# The dunders that are API: the protocols a caller uses (async with, await, async for, ...).
DUNDERS = frozenset(
    {
        "__aenter__",
        "__aexit__",
        "__aiter__",
        "__anext__",
        "__await__",
        "__enter__",
        "__exit__",
        "__iter__",
        "__next__",
        "__len__",
        "__contains__",
        "__call__",
    }
)
HEADER = """\
# The public API of asynckv, as tests/unit/test_public_api.py reads it (the rules are in its
# docstring). Re-record after a deliberate, strictly-extending change with:
#   VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python tests/unit/test_public_api.py --record
# One entry per name: "name  kind [-> return annotation]", then its parameters indented,
# each as "kind  parameter".
"""

_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional-only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.KEYWORD_ONLY: "keyword-only",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One public name: its kind line and, for a callable, its parameters."""

    name: str
    kind: str
    params: tuple[inspect.Parameter, ...] | None = None

    def lines(self) -> list[str]:
        out = [f"{self.name}  {self.kind}"]
        out += [f"    {_param_line(p)}" for p in self.params or ()]
        return out


def _param_line(param: inspect.Parameter) -> str:
    return f"{_KINDS[param.kind]}  {param}"


def _annotation(value: Any) -> str:
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _callable(name: str, kind: str, obj: Any, *, returns: bool = True) -> Entry:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature
        return Entry(name, f"{kind} (no signature)")
    if inspect.iscoroutinefunction(obj):
        kind = f"async {kind}"
    elif inspect.isasyncgenfunction(obj):
        kind = f"async generator {kind}"
    if returns and signature.return_annotation is not inspect.Signature.empty:
        kind = f"{kind} -> {_annotation(signature.return_annotation)}"
    return Entry(name, kind, tuple(signature.parameters.values()))


def _members(cls: type) -> dict[str, Any]:
    """The public members that asynckv's own classes in ``cls``'s MRO define, by name."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("asynckv"):
            continue
        for attr, value in vars(klass).items():
            if not attr.startswith("_") or attr in DUNDERS:
                found[attr] = value
    return found


def _class_entries(name: str, cls: type) -> Iterator[Entry]:
    if issubclass(cls, enum.Enum):
        yield Entry(name, "enum")
        for member in cls:
            yield Entry(f"{name}.{member.name}", f"member {member.value!r}")
        return
    kind = "exception" if issubclass(cls, BaseException) else "class"
    fields: tuple[str, ...] = getattr(cls, "_fields", ())
    if fields:
        kind = f"namedtuple {kind}"
    elif dataclasses.is_dataclass(cls):
        kind = f"dataclass {kind}"
        fields = tuple(f.name for f in dataclasses.fields(cls))
    # A class's constructor: its parameters, not its return (``__init__``'s None or none).
    yield _callable(name, kind, cls, returns=False)
    members = _members(cls) | dict.fromkeys(fields)
    for attr, static in sorted(members.items()):
        qual = f"{name}.{attr}"
        if attr in fields:
            yield Entry(qual, "field")  # its type and default: the constructor's parameter
        elif isinstance(static, property):
            yield Entry(qual, "property")
        elif isinstance(static, classmethod):
            entry = _callable(qual, "classmethod", getattr(cls, attr))
            # ``-> Self`` on a classmethod is ``-> TheClass``: written either way, the same API.
            same = entry.kind.replace("-> Self", f"-> {cls.__name__}")
            yield dataclasses.replace(entry, kind=same)
        elif isinstance(static, staticmethod):
            yield _callable(qual, "staticmethod", getattr(cls, attr))
        elif inspect.isfunction(static):
            yield _callable(qual, "method", static)
        elif inspect.ismemberdescriptor(static) or inspect.isgetsetdescriptor(static):
            yield Entry(qual, "attribute")  # a slot
        else:
            yield Entry(qual, f"attribute {type(static).__name__}")


def current() -> dict[str, Entry]:
    """Every public name of the modules and their members, read from the code."""
    entries: dict[str, Entry] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            name = f"{module_name}.{attr}"
            if inspect.isclass(obj):
                found = list(_class_entries(name, obj))
            elif callable(obj):
                found = [_callable(name, "function", obj)]
            else:
                found = [Entry(name, f"value {type(obj).__name__}")]
            entries |= {entry.name: entry for entry in found}
    return entries


def render(entries: dict[str, Entry]) -> str:
    return HEADER + "".join(f"{line}\n" for e in entries.values() for line in e.lines())


def recorded() -> dict[str, tuple[str, list[str]]]:
    """The record: name -> (kind, parameter lines)."""
    out: dict[str, tuple[str, list[str]]] = {}
    name = ""
    for line in RECORD.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("    "):
            out[name][1].append(line.strip())
        else:
            name, kind = line.split("  ", 1)
            out[name] = (kind, [])
    return out


def _extension_problems(old: list[str], new: tuple[inspect.Parameter, ...]) -> list[str]:
    """What keeps ``new`` from being ``old`` with only optional parameters added."""
    lines = [_param_line(p) for p in new]
    kept: list[int] = []
    start = 0
    for line in old:
        if line not in lines[start:]:
            return [f"parameter changed or removed: {line}"]
        start = lines.index(line, start) + 1
        kept.append(start - 1)
    last_positional = max(
        (i for i in kept if new[i].kind in (new[i].POSITIONAL_ONLY, new[i].POSITIONAL_OR_KEYWORD)),
        default=-1,
    )
    problems = []
    for i, param in enumerate(new):
        if i in kept or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is param.empty:
            problems.append(f"added parameter without a default: {param}")
        elif param.kind != param.KEYWORD_ONLY and i < last_positional:
            problems.append(f"added positional parameter before a recorded one: {param}")
    return problems


def test_public_api_is_the_record_or_strictly_extends_it() -> None:
    """No recorded public name is gone or changed; signatures only gained optional parameters."""
    now = current()
    problems: dict[str, list[str]] = {}
    for name, (kind, params) in recorded().items():
        entry = now.get(name)
        if entry is None:
            problems[name] = ["removed"]
        elif entry.kind != kind:
            problems[name] = [f"now {entry.kind!r}, recorded {kind!r}"]
        elif params and entry.params is None:
            problems[name] = ["no longer has a signature"]
        elif entry.params is not None and (found := _extension_problems(params, entry.params)):
            problems[name] = found
    assert not problems, problems


def test_record_is_in_the_recorded_format() -> None:
    """The record reads back to what rendering it would write (no hand edit broke its form)."""
    entries = recorded()
    assert entries, "an empty record pins nothing"
    lines = [
        f"{n}  {kind}\n" + "".join(f"    {p}\n" for p in ps) for n, (kind, ps) in entries.items()
    ]
    assert RECORD.read_text() == HEADER + "".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: {sys.argv[0]} --record  (writes {RECORD})")
    RECORD.write_text(render(current()))
    print(f"recorded {len(current())} names in {RECORD}")
