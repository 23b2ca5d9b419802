"""``docs/troubleshooting.md`` has an entry for every exception class polyparallel and its plugins
define: a new error class without one fails here.

The classes are found by reading the source (no framework is imported): every public class in
``polyparallel/``, ``plugins/`` and the example third-party plugin whose base is an exception.
"""

from __future__ import annotations

import ast
import re

import polyparallel as pp
from polyparallel import _errors

from .codeblocks import ROOT

PAGE = ROOT / "docs" / "troubleshooting.md"
SOURCES = [ROOT / "polyparallel", ROOT / "plugins", ROOT / "examples" / "third_party_plugin" / "src"]


def exception_classes() -> set[str]:
    """Names of the public classes whose bases (transitively, within the sources) are exceptions."""
    bases: dict[str, list[str]] = {}
    for source in SOURCES:
        for path in source.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    bases[node.name] = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in ("Exception", "BaseException") or (name.endswith(("Error", "Timeout")) and name not in bases):
            return True
        return name not in seen and any(is_exception(b, seen | {name}) for b in bases.get(name, []))

    return {name for name in bases if not name.startswith("_") and is_exception(name)}


def test_every_error_class_has_an_entry():
    headings = set(re.findall(r"^## (\w+)$", PAGE.read_text(), flags=re.MULTILINE))
    classes = exception_classes()
    assert set(_errors.__all__) - {"exception_summary"} <= classes  # the finder sees the core's errors
    missing = sorted(classes - headings)
    assert not missing, f"docs/troubleshooting.md has no '## Name' entry for {missing}: say what each means and what to do"


def test_every_entry_says_what_it_means_and_what_to_do():
    text = PAGE.read_text()
    for name in sorted(exception_classes() - {"PolyparallelError"}):
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert "**Means:**" in section and "**Do:**" in section, name


def test_the_finder_sees_the_exported_errors():
    exported = {name for name in pp.__all__ if isinstance(getattr(pp, name), type)
                and issubclass(getattr(pp, name), BaseException)}
    assert exported <= exception_classes()
