"""How ``polyparallel demo`` runs its entries for a person: a progress line per framework, the
frameworks' own output kept out of the way, and the loss curves drawn next to the table.

Each entry runs with the process's standard output and error (file descriptors 1 and 2, which the
launched processes inherit) pointed at one log file, ``demo-warnings.log``, one section per entry:
Lightning's banners and deprecations, DeepSpeed's untested-optimizer warning and torch's C++
warnings land there, counted, instead of between the progress lines and the table. Nothing is
dropped: polyparallel's own warnings (their message starts with ``polyparallel:``, or they point
at polyparallel's code) are repeated on the terminal, and an entry that fails has the end of its
section printed under its progress line. ``--show-output`` leaves the terminal as it was.

Framework-free: matplotlib is imported only to draw ``loss-curves.png``, and its absence is a
message, not an error.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ._errors import exception_summary

__all__ = ["EntryReport", "LogSection", "classify", "draw_loss_curves", "run_entries", "summary_lines"]

LOG_NAME = "demo-warnings.log"
PLOT_NAME = "loss-curves.png"
RESULTS_NAME = "results.json"
TABLE_NAME = "results.txt"

#: A line that starts a warning: Python's ``file.py:12: Category: message`` (also Lightning's
#: ``file.py:12: message``), a ``...Warning:`` in any other layout, a logger's ``[WARNING]`` or
#: ``WARNING:``, and glog's ``W1201 12:00:00`` (torch's C++ side).
WARNING_LINE = re.compile(r"^\S+\.py:\d+: |\b[A-Z]\w*Warning: |\[WARNING\]|^WARNING\b|^W\d{4} ")
#: polyparallel's own: its messages start with ``polyparallel:``; or the warning points at its code.
OWN_LINE = re.compile(r"polyparallel: |(^|/)(polyparallel|polyparallel_\w+)/\S+\.py:\d+: ")


@dataclass
class LogSection:
    """What one entry's processes wrote while it ran."""

    text: str = ""

    @property
    def lines(self) -> list[str]:
        """The non-empty lines."""
        return [line for line in self.text.splitlines() if line.strip()]


@dataclass
class EntryReport:
    """One entry's outcome: its row, its time, and what its log section holds."""

    name: str
    row: dict[str, Any]
    seconds: float
    warnings: int = 0
    other_lines: int = 0
    own: list[str] = field(default_factory=list)
    tail: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """Whether the entry raised (its row then holds ``error``)."""
        return "error" in self.row


def classify(section: LogSection) -> tuple[int, int, list[str]]:
    """``(warnings, other lines, polyparallel's own warning lines)`` of a log section."""
    warnings, other, own = 0, 0, []
    for line in section.lines:
        if WARNING_LINE.search(line):
            warnings += 1
            if OWN_LINE.search(line):
                own.append(line.strip())
        elif not line.startswith((" ", "\t")):  # a warning's source line or a traceback's body
            other += 1
    return warnings, other, own


def _progress_stream() -> IO[str]:
    """Where progress goes while descriptors 1 and 2 point at the log: a copy of the terminal's
    stderr; ``sys.stderr`` itself when it is no file descriptor (a test's captured stream)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        return sys.stderr
    return os.fdopen(os.dup(fd), "w", buffering=1)


@contextlib.contextmanager
def _redirected(log: Path, title: str) -> Iterator[LogSection]:
    """Descriptors 1 and 2 (this process's and its children's) appended to ``log`` while the
    block runs; the section it wrote is filled in when the block ends."""
    section = LogSection()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    with open(log, "ab") as out:
        out.write(f"===== {title} =====\n".encode())
        out.flush()
        start = out.tell()
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
            yield section
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
    with open(log, "rb") as f:
        f.seek(start)
        section.text = f.read().decode("utf-8", "replace")


class _Ticker:
    """On a terminal, the progress line's seconds count up while an entry runs."""

    def __init__(self, stream: IO[str], prefix: str):
        self.stream, self.prefix = stream, prefix
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Ticker:
        self.started = time.perf_counter()
        self.stream.write(f"{self.prefix} ..." + ("" if self.tty else "\n"))
        self.stream.flush()
        if self.tty:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._done.wait(1.0):
            self.stream.write(f"\r{self.prefix} ... {time.perf_counter() - self.started:.0f} s")
            self.stream.flush()

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self.tty:
            self._thread.join()
            self.stream.write("\r\x1b[K")  # the finished line replaces the ticking one


def run_entries(entries: Mapping[str, Callable[..., Any]], strategy: Any, nprocs: int, out: Path,
                show_output: bool = False) -> list[EntryReport]:
    """Run every entry with ``strategy`` on ``nprocs`` processes, one progress line each; with
    ``show_output=False`` the frameworks' output goes to ``out / demo-warnings.log``."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / LOG_NAME
    log.write_text("")
    progress = _progress_stream()
    reports = []
    try:
        for i, (name, run) in enumerate(entries.items(), start=1):
            prefix = f"[{i}/{len(entries)}] {name}: training on {nprocs} processes"
            with _Ticker(progress, prefix) as ticker:
                context = contextlib.nullcontext(LogSection()) if show_output else _redirected(log, name)
                with context as section:
                    try:
                        row = dict(run(strategy, nprocs))
                    except Exception as exc:  # one framework failing must not hide the others' results
                        row = {"framework": name, "topology": repr(strategy.topology.resolve(nprocs)),
                               "error": exception_summary(exc, first_line=False)}
            report = EntryReport(name, row, time.perf_counter() - ticker.started)
            report.warnings, report.other_lines, report.own = classify(section)
            report.tail = section.lines[-15:] if report.failed else []
            progress.write(_done_line(prefix, report) + "\n")
            for line in report.own + report.tail:
                progress.write(f"    {line}\n")
            progress.flush()
            reports.append(report)
    finally:
        if progress is not sys.stderr:
            progress.close()
    return reports


def _done_line(prefix: str, report: EntryReport) -> str:
    row = report.row
    if report.failed:
        outcome = f"FAILED after {report.seconds:.0f} s: {row['error'].splitlines()[0]}"
    else:
        figures = ", ".join(f"{label} {row[key]:.4f}" for key, label in (("final_loss", "loss"), ("accuracy", "accuracy"))
                            if isinstance(row.get(key), (int, float)))
        outcome = f"done in {report.seconds:.0f} s" + (f" ({figures})" if figures else "")
    logged = f"; {report.warnings} framework warning{'s' if report.warnings != 1 else ''} logged" if report.warnings else ""
    return f"{prefix}: {outcome}{logged}"


def draw_loss_curves(rows: list[dict[str, Any]], path: Path, title: str) -> str:
    """Every row's ``losses`` (spanning ``epochs`` epochs) on one plot in ``path``; returns the line
    to print: where the picture is, or why there is none."""
    curves = [(r["framework"], [float(v) for v in r["losses"]], r.get("epochs") or 1, r.get("final_loss"))
              for r in rows if r.get("losses")]
    if not curves:
        return "loss curves: not drawn (no entry returned its per-step losses)"
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return "loss curves: not drawn, matplotlib is not installed (pip install matplotlib)"
    fig = Figure(figsize=(9, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # Identical curves lie on top of each other: the first is drawn widest, each next one
    # narrower and dashed, so every framework stays visible where they agree.
    dashes: list[tuple[float, ...]] = [(), (6, 2), (2, 2), (8, 3, 2, 3), (4, 4), (1, 1), (10, 2)]  # () solid
    for k, (name, losses, epochs, final) in enumerate(curves):
        x = [(i + 1) * epochs / len(losses) for i in range(len(losses))]
        marker = "o" if len(losses) <= 2 * epochs else None  # one point per epoch: show the points
        label = f"{name} ({final:.4f})" if isinstance(final, (int, float)) else name
        line, = ax.plot(x, losses, label=label, linewidth=max(4.0 - 0.6 * k, 0.8), alpha=0.85, marker=marker,
                        markersize=5)
        if dashes[k % len(dashes)]:
            line.set_dashes(dashes[k % len(dashes)])
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss per step (global mean over the data axis)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title="framework (final epoch's mean loss)", title_fontsize=8)
    note = agreement(curves)
    if note:
        ax.text(0.01, 0.01, note, transform=ax.transAxes, fontsize=8, va="bottom", wrap=True)
    fig.tight_layout()
    fig.savefig(path)
    return f"loss curves: {path}"


def agreement(curves: list[tuple[str, list[float], Any, Any]]) -> str:
    """A line saying how far apart the curves with the same number of steps are (the torch-based
    frameworks train the same steps: their curves should coincide)."""
    by_length: dict[int, list[tuple[str, list[float]]]] = {}
    for name, losses, *_ in curves:
        by_length.setdefault(len(losses), []).append((name, losses))
    notes = []
    for group in by_length.values():
        if len(group) > 1:
            first = group[0][1]
            gap = max(abs(a - b) for _, losses in group[1:] for a, b in zip(first, losses))
            notes.append(f"{len(group)} curves of {len(first)} steps differ by at most {gap:.1e}")
    return "; ".join(notes)


def summary_lines(reports: list[EntryReport], out: Path, show_output: bool) -> list[str]:
    """What the demo says after its table: where the log is, and what it holds."""
    if show_output:
        return []
    log = out / LOG_NAME
    warnings = sum(r.warnings for r in reports)
    other = sum(r.other_lines for r in reports)
    per = ", ".join(f"{r.name} {r.warnings}" for r in reports if r.warnings)
    line = (f"{warnings} framework warning{'s' if warnings != 1 else ''}" + (f" ({per})" if per else "")
            + f" and {other} other line{'s' if other != 1 else ''} of framework output logged to {log}")
    return [line]


def write_results(rows: list[dict[str, Any]], table_text: str, out: Path) -> None:
    """The rows (losses included) as JSON and the table as text, next to the picture."""
    (out / RESULTS_NAME).write_text(json.dumps(rows, indent=1) + "\n")
    (out / TABLE_NAME).write_text(table_text + "\n")
