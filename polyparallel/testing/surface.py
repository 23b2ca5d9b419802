"""A declared, tested surface per adapter: every everyday entry of a framework classified.

An adapter is not done when ``fit`` works: a framework's users also call its metrics, callbacks,
handlers and entry points (predict, lr_find, save/load, ...). A plugin declares each of them as
data, a :class:`Surface` of :class:`Entry` values:

- **works** (:func:`works`): tested under the adapter at data > 1 against a single process with the
  same global batch, on an evaluation set that does not divide evenly; ``test`` names the test
  that shows it, ``differs`` says what (if anything) differs from one process;
- **refused** (:func:`refused`): the adapter refuses it before anything runs (before any
  collective), with :meth:`Entry.message` — the entry, why, and what to do instead.

Three checks keep the declaration honest, all framework-free:

- :meth:`Surface.check_covers`: everything the installed framework lists (:func:`discover_classes`
  reads its source, so modules that cannot import here are listed too; :func:`discover_names`
  reads a module's ``__all__``) is classified, and nothing classified has gone: a framework
  upgrade cannot add a silent gap;
- :func:`check_exercised`: a test that runs a group of "works" entries says which it ran, and
  the check fails if one of the group was left out (or one ran that is not declared);
- :func:`check_table`: the published table (:meth:`Surface.markdown`, generated into ``docs/``)
  equals the one generated from the declaration.

``python -m polyparallel.testing.surface module:ATTRIBUTE [OUT.md]`` prints (or writes) the
table of the :class:`Surface` held at ``module.ATTRIBUTE``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["REFUSED", "WORKS", "Entry", "Surface", "SurfaceError", "check_exercised", "check_table",
           "discover_classes", "discover_methods", "discover_names", "refused", "works"]

WORKS = "works"
REFUSED = "refused"


class SurfaceError(TypeError):
    """An entry of a framework's surface the adapter refuses (raised before anything runs)."""


@dataclass(frozen=True)
class Entry:
    """One entry of a framework's surface (see the module docstring)."""

    #: Qualified name: ``"fastai.metrics.RocAuc"``, ``"ignite.handlers.EarlyStopping"``, or an
    #: entry point such as ``"Learner.get_preds"``.
    name: str
    #: What it is: ``"metric"``, ``"callback"``, ``"handler"``, ``"entry point"``, ...
    kind: str
    status: str
    #: works: the test that shows it (``"tests/x/test_y.py::test_z"``).
    test: str = ""
    #: works: what differs from a single process ("" when nothing does).
    differs: str = ""
    #: refused: why.
    reason: str = ""
    #: refused: what to do instead.
    instead: str = ""

    def __post_init__(self) -> None:
        if self.status not in (WORKS, REFUSED):
            raise ValueError(f"Entry {self.name!r}: status must be {WORKS!r} or {REFUSED!r}, not {self.status!r}.")
        if self.status == WORKS and not self.test:
            raise ValueError(f"Entry {self.name!r} works: name the test that shows it (test=).")
        if self.status == REFUSED and not (self.reason and self.instead):
            raise ValueError(f"Entry {self.name!r} is refused: say why (reason=) and what to do instead (instead=).")

    @property
    def short(self) -> str:
        """The last component of the name (``RocAuc``)."""
        return self.name.rsplit(".", 1)[-1]

    def message(self, adapter: str = "the adapter") -> str:
        """The refusal message: the entry, why, and what to do instead."""
        return f"{adapter} refuses {self.name} ({self.kind}): {self.reason}. Instead: {self.instead}."


def works(name: str, kind: str, test: str, differs: str = "") -> Entry:
    """A "works" entry, shown by ``test``; ``differs`` says what differs from one process."""
    return Entry(name, kind, WORKS, test=test, differs=differs)


def refused(name: str, kind: str, reason: str, instead: str) -> Entry:
    """A "refused" entry: the adapter refuses it before anything runs, saying ``reason`` and ``instead``."""
    return Entry(name, kind, REFUSED, reason=reason, instead=instead)


@dataclass
class Surface:
    """The classified surface of one framework under one adapter."""

    framework: str
    #: The installed version the classification was made for (shown in the table).
    version: str
    entries: Sequence[Entry]
    #: The adapter's name in messages and titles (``"polyparallel's fastai adapter"``).
    adapter: str = ""
    #: kind -> a sentence on what that kind covers and how it was discovered (table headings).
    kinds: Mapping[str, str] = field(default_factory=dict)
    #: Markdown put under the title (how to read the table, what applies to every entry).
    preamble: str = ""

    def __post_init__(self) -> None:
        seen: dict[str, Entry] = {}
        for entry in self.entries:
            if entry.name in seen:
                raise ValueError(f"Surface {self.framework!r}: {entry.name!r} is classified twice.")
            seen[entry.name] = entry
        self._by_name = seen

    # -- lookups -----------------------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Entry:
        return self._by_name[name]

    def get(self, name: str) -> Entry | None:
        return self._by_name.get(name)

    def of_kind(self, kind: str, status: str | None = None) -> list[Entry]:
        """The entries of ``kind`` (only those with ``status`` if given), in declaration order."""
        return [e for e in self.entries if e.kind == kind and (status is None or e.status == status)]

    def names(self, kind: str | None = None, status: str | None = None) -> set[str]:
        return {e.name for e in self.entries if (kind is None or e.kind == kind)
                and (status is None or e.status == status)}

    def refusal(self, name: str) -> Entry | None:
        """The refused entry called ``name`` (``None`` if it is not refused)."""
        entry = self._by_name.get(name)
        return entry if entry is not None and entry.status == REFUSED else None

    def refuse(self, name: str) -> None:
        """Raise :class:`SurfaceError` with the entry's message if ``name`` is refused."""
        entry = self.refusal(name)
        if entry is not None:
            raise SurfaceError(entry.message(self.adapter or f"the {self.framework} adapter"))

    def kind_names(self) -> list[str]:
        """The kinds, in the order of :attr:`kinds`, then as they first appear."""
        order = list(self.kinds)
        for entry in self.entries:
            if entry.kind not in order:
                order.append(entry.kind)
        return order

    def counts(self, kind: str | None = None) -> tuple[int, int, int]:
        """``(works, refused, total)`` of ``kind`` (all kinds when ``None``)."""
        chosen = [e for e in self.entries if kind is None or e.kind == kind]
        n_works = sum(e.status == WORKS for e in chosen)
        return n_works, len(chosen) - n_works, len(chosen)

    # -- coverage ----------------------------------------------------------------------------------
    def check_covers(self, discovered: Mapping[str, Iterable[str]]) -> None:
        """``discovered`` (kind -> the names the installed framework lists) is exactly what is
        classified under each of those kinds. Raises ``AssertionError`` naming every entry that
        is listed but not classified (a framework upgrade added it) and every classified entry
        the framework no longer lists."""
        problems = []
        for kind, names in discovered.items():
            listed, declared = set(names), self.names(kind)
            missing, gone = sorted(listed - declared), sorted(declared - listed)
            if missing:
                problems.append(f"{len(missing)} {kind}(s) of the installed {self.framework} are not classified: "
                                f"{missing}. Classify each as works (with the test that shows it) or refused "
                                "(with the reason and what to do instead)")
            if gone:
                problems.append(f"{len(gone)} classified {kind}(s) are not in the installed {self.framework}: "
                                f"{gone}. Remove them, or fix the discovery")
        assert not problems, f"{self.framework} surface: " + "; ".join(problems) + "."

    def check_tests_exist(self, root: str | os.PathLike[str]) -> None:
        """Every "works" entry names a test function that exists under ``root`` (the repository)."""
        found: dict[str, set[str]] = {}
        bad = []
        for entry in self.entries:
            if entry.status != WORKS:
                continue
            path, _, test = entry.test.partition("::")
            if path not in found:
                file = Path(root) / path
                found[path] = _test_names(file) if file.is_file() else set()
            if test.split("[")[0] not in found[path]:
                bad.append(f"{entry.name} -> {entry.test}")
        assert not bad, f"{self.framework} surface: these entries name a test that does not exist: {bad}"

    # -- the published table -------------------------------------------------------------------------
    def markdown(self) -> str:
        """The classification as markdown: counts per kind, then one table per kind."""
        works_all, refused_all, total_all = self.counts()
        lines = [f"# {self.framework} under {self.adapter or 'polyparallel'}", "",
                 "<!-- Generated from the adapter's declared surface; do not edit by hand. -->", "",
                 f"Classified for {self.framework} {self.version}: **{works_all} work, {refused_all} are refused, "
                 f"{total_all} in all.**", ""]
        if self.preamble:
            lines += [self.preamble.strip(), ""]
        lines += ["| kind | works | refused | total |", "|---|---:|---:|---:|"]
        for kind in self.kind_names():
            w, r, t = self.counts(kind)
            if t:
                lines.append(f"| {kind} | {w} | {r} | {t} |")
        lines += [f"| **all** | **{works_all}** | **{refused_all}** | **{total_all}** |", ""]
        for kind in self.kind_names():
            chosen = self.of_kind(kind)
            if not chosen:
                continue
            w, r, t = self.counts(kind)
            lines += [f"## {kind.capitalize()}s: {w} work, {r} refused, {t} in all", ""]
            if self.kinds.get(kind):
                lines += [self.kinds[kind].strip(), ""]
            lines += ["| entry | status | what differs from one process, or why it is refused | instead | test |",
                      "|---|---|---|---|---|"]
            for e in sorted(chosen, key=lambda e: (e.status != WORKS, e.name.lower())):
                note = e.differs if e.status == WORKS else e.reason
                test = f"`{e.test}`" if e.test else ""
                lines.append(f"| `{e.name}` | {e.status} | {_cell(note) or '—'} | {_cell(e.instead)} | {test} |")
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _test_names(file: Path) -> set[str]:
    tree = ast.parse(file.read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test")}


# -- discovery ---------------------------------------------------------------------------------------
def _package_files(package: str) -> list[tuple[str, Path]]:
    """``(module name, file)`` of every Python source file of ``package``, found without importing
    its submodules (only the package itself is located)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise ModuleNotFoundError(f"discover: the package {package!r} is not installed.")
    if not spec.submodule_search_locations:
        assert spec.origin is not None
        return [(package, Path(spec.origin))]
    out = []
    for location in spec.submodule_search_locations:
        base = Path(location)
        for file in sorted(base.rglob("*.py")):
            rel = file.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(not p.isidentifier() for p in parts):
                continue
            out.append((".".join([package, *parts]), file))
    return out


def _base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for base in node.bases:
        while isinstance(base, ast.Subscript):  # Generic[T], ...
            base = base.value
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def discover_classes(package: str, bases: Iterable[str], *, include_private: bool = False,
                     exclude_modules: Iterable[str] = ()) -> list[str]:
    """Qualified names (``module.Class``) of the classes of ``package`` that derive, directly or
    through other classes of the package, from one of ``bases`` (class names; a qualified
    ``module.Class`` is matched by its last part). Read from the source with :mod:`ast`, so
    modules whose dependencies are not installed are listed too. Classes whose name starts
    with ``_`` (and modules with a ``_`` component, tests excluded) are left out unless
    ``include_private``; ``exclude_modules`` (prefixes) are skipped."""
    roots = {b.rsplit(".", 1)[-1] for b in bases}
    excluded = tuple(exclude_modules)
    classes: list[tuple[str, str, list[str]]] = []  # (module, class name, base names), private ones too
    for module, file in _package_files(package):
        if excluded and module.startswith(excluded):
            continue
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        except SyntaxError:
            continue
        classes += [(module, node.name, _base_names(node)) for node in tree.body if isinstance(node, ast.ClassDef)]
    known = set(roots)
    changed = True
    while changed:  # the closure: a class deriving from a known one is known
        changed = False
        for _, name, base_names in classes:
            if name not in known and known.intersection(base_names):
                known.add(name)
                changed = True

    def public(module: str, name: str) -> bool:
        return not name.startswith("_") and not any(p.startswith("_") for p in module.split(".")[1:])

    return sorted({f"{module}.{name}" for module, name, base_names in classes
                   if (name in roots or known.intersection(base_names)) and (include_private or public(module, name))})


def discover_methods(package: str, class_name: str, *, include_private: bool = False) -> list[str]:
    """The public method names of the class ``class_name`` of ``package``: those defined in its
    body, and the module-level functions whose first parameter is annotated ``class_name`` (the
    ``@patch`` idiom of fastcore: ``def lr_find(self: Learner, ...)``). Read from the source,
    like :func:`discover_classes`."""
    names: set[str] = set()
    for _, file in _package_files(package):
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                names.update(m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.args:
                annotation = node.args.args[0].annotation
                if isinstance(annotation, ast.Name) and annotation.id == class_name:
                    names.add(node.name)
    return sorted(n for n in names if include_private or not n.startswith("_"))


def discover_names(module: str, attribute: str = "__all__") -> list[str]:
    """``module.NAME`` for every name in ``module.__all__`` (``attribute``); imports ``module``."""
    mod = importlib.import_module(module)
    return sorted(f"{module}.{name}" for name in getattr(mod, attribute))


# -- checks of tests and published tables --------------------------------------------------------------
def check_exercised(surface: Surface, exercised: Iterable[str], *, kind: str | None = None,
                    names: Iterable[str] | None = None) -> None:
    """A test ran the "works" entries ``exercised``: they are exactly the expected ones — those
    whose ``test`` is this group (``names``), or else every "works" entry of ``kind``."""
    ran = set(exercised)
    expected = set(names) if names is not None else surface.names(kind, WORKS)
    unknown = sorted(ran - surface.names(status=WORKS))
    left_out = sorted(expected - ran)
    extra = sorted(ran - expected)
    problems = []
    if left_out:
        problems.append(f"declared as works but not run by this test: {left_out}")
    if unknown:
        problems.append(f"run, but not declared as works: {unknown}")
    elif extra:
        problems.append(f"run, but not in this test's group: {extra}")
    assert not problems, f"{surface.framework} surface: " + "; ".join(problems) + "."


def check_table(surface: Surface, path: str | os.PathLike[str]) -> None:
    """The committed table at ``path`` is the one generated from ``surface``."""
    file = Path(path)
    want = surface.markdown()
    got = file.read_text(encoding="utf-8") if file.is_file() else None
    assert got == want, (f"{file} is not the table generated from the {surface.framework} surface"
                         f"{' (missing)' if got is None else ''}: regenerate it with "
                         "`python tools/surface_tables.py` and commit it.")


def _load(spec: str) -> Surface:
    # The class of the importable module (under ``python -m`` this file also runs as __main__).
    cls = importlib.import_module("polyparallel.testing.surface").Surface
    module, _, attribute = spec.partition(":")
    obj = getattr(importlib.import_module(module), attribute or "SURFACE")
    surface = obj() if callable(obj) and not isinstance(obj, cls) else obj
    if not isinstance(surface, cls):
        raise TypeError(f"{spec} is a {type(surface).__name__}, not a polyparallel.testing.surface.Surface.")
    return surface


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m polyparallel.testing.surface module:ATTRIBUTE [OUT.md]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2:
        print(main.__doc__, file=sys.stderr)
        return 2
    text = _load(args[0]).markdown()
    if len(args) == 2:
        Path(args[1]).parent.mkdir(parents=True, exist_ok=True)
        Path(args[1]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
