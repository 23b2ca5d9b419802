"""Plain-text layout for the command line (framework-free, imports nothing of polyparallel)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["table"]


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """``rows`` under ``header`` in left-aligned columns separated by two spaces, with a rule of
    dashes under the header; trailing spaces are stripped."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
