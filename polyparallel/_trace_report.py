"""Reading traces: what every rank of a group was doing (hang reports), and per-rank timelines.

A rank's *state* is what it publishes through a runtime's side channel (or writes at exit): a
dict with ``rank``, its latest ``entries`` (:meth:`polyparallel._trace.Entry.to_dict`), its
``stack`` (the Python stack of the thread that drives its collectives, or ``None``),
``exited`` and, for a rank that exited, its ``outcome`` when known (``"finished"``, ``"failed in
training_step (train.py:42) with ValueError"``; ``None``: reported as "has exited"). :func:`describe_group` turns the
states of a group into the lines of a ``CollectiveTimeout``; :func:`read_dir` and :func:`timeline` serve ``polyparallel trace DIR``.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any

from ._text import table

__all__ = ["describe_group", "entry_problem", "label", "location", "read_dir", "timeline", "timeline_text", "rank_ranges",
           "LEGEND", "WIDTH"]

_OPEN = ("entered", "running")

_TEXT_MAX = 4096
# The fields of an entry (polyparallel._trace.Entry.to_dict) this module reads, and their types
# (``None`` allowed where listed); other fields are kept as they are.
_FIELDS: dict[str, tuple[tuple[type, ...], bool, bool]] = {
    # name: (types, may be None, required)
    "operation": ((str,), False, True), "axis": ((str,), False, True), "state": ((str,), False, True),
    "t0": ((int, float), False, True), "t1": ((int, float), True, False), "seq": ((int,), True, False),
    "n": ((int,), True, False), "detail": ((str,), True, False), "site": ((str,), True, False),
    "user": ((str,), True, False), "error": ((str,), True, False),
}


def entry_problem(entry: Any) -> str | None:
    """Why ``entry`` is not a trace entry these reports can read (a dict with ``operation``,
    ``axis``, ``state`` and ``t0`` of the right types, texts of at most 4096 characters), or
    ``None`` when it is one. Entries come from files and from a store others may write to: they
    are checked before any report reads them."""
    if not isinstance(entry, dict):
        return f"a trace entry is a JSON object, not {type(entry).__name__}"
    for name, (types, nullable, required) in _FIELDS.items():
        if name not in entry:
            if required:
                return f"a trace entry needs {name!r} (it has {sorted(entry)[:8]})"
            continue
        value = entry[name]
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            return f"the trace entry's {name!r} is {type(value).__name__} ({str(value)[:40]!r})"
        if isinstance(value, str) and len(value) > _TEXT_MAX:
            return f"the trace entry's {name!r} is {len(value)} characters long (at most {_TEXT_MAX})"
        if isinstance(value, float) and value != value:
            return f"the trace entry's {name!r} is NaN"
    return None


def location(entry: Mapping[str, Any]) -> str:
    """``file.py:57`` (the user's frame), with the framework's frame when it differs
    (``train.py:57 via trainer.py:120``); ``?`` when unknown."""
    user, site = entry.get("user"), entry.get("site")
    if not user:
        return "?"
    text = _short(user)
    if site and site != user:
        text += f" via {_short(site)}"
    return text


def _short(where: str) -> str:
    path, _, line = where.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


def label(entry: Mapping[str, Any]) -> str:
    """``reduce_metrics #14`` (the operation and its sequence number on its axis)."""
    return entry["operation"] if entry.get("seq") is None else f"{entry['operation']} #{entry['seq']}"


def rank_ranges(ranks: Iterable[int]) -> str:
    """``rank 3``, ``ranks 0–2``, ``ranks 0, 2, 5``."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 2:
        return f"ranks {ordered[0]}\u2013{ordered[-1]}"
    return "ranks " + ", ".join(map(str, ordered))


def _status(state: Mapping[str, Any] | None, mine: Mapping[str, Any] | None, answer_s: float) -> tuple[str, bool]:
    """(what the rank does, whether its stack is worth showing)."""
    if state is None:
        return (f"did not answer within {answer_s:g} s (its process exited or is frozen, or it has no side "
                "channel)", False)
    entries = state.get("entries") or []
    open_ = next((e for e in reversed(entries) if e.get("state") in _OPEN), None)
    exited = bool(state.get("exited"))
    if open_ is not None and not exited:
        same_axis = mine is None or open_.get("axis") == mine.get("axis")
        axis = "" if same_axis else f" over the {open_.get('axis')!r} axis"
        if mine is not None and (open_.get("operation"), open_.get("axis"), open_.get("seq")) == (
                mine.get("operation"), mine.get("axis"), mine.get("seq")):
            return f"waits in {label(open_)} ({location(open_)})", False
        return f"entered {label(open_)}{axis} ({location(open_)})", False
    last = entries[-1] if entries else None
    if exited:
        latest = f"{label(last)} ({location(last)}, {last.get('state')})" if last is not None else "none"
        outcome = state.get("outcome")  # "finished", "failed in f (x.py:3) with ValueError" (when known)
        return f"{outcome if isinstance(outcome, str) and outcome else 'has exited'} (its last collective: {latest})", False
    since = (f"since {label(last)} ({location(last)}, {last.get('state')})" if last is not None
             else "yet")
    return f"has not entered any collective {since}", True


def describe_group(states: Mapping[int, Mapping[str, Any] | None], me: int, answer_s: float) -> tuple[str, list[str]]:
    """``(summary, details)`` of what every rank in ``states`` is doing, relative to rank ``me``'s
    open collective: a one-line summary ("rank 1 has not entered any collective since
    reduce_metrics #12 (train.py:40); rank 0 waits in reduce_metrics #13 (train.py:63)"), ranks
    doing the same grouped, and detail lines with the stacks of the ranks that are outside any
    collective."""
    mine_state = states.get(me)
    mine = None
    if mine_state:
        mine = next((e for e in reversed(mine_state.get("entries") or []) if e.get("state") in _OPEN), None)
    by_text: dict[str, list[int]] = {}
    stacks: list[tuple[int, str]] = []
    for rank in sorted(states):
        text, show_stack = _status(states[rank], mine, answer_s)
        if rank == me and mine is not None:
            text = f"waits in {label(mine)} ({location(mine)})"
        by_text.setdefault(text, []).append(rank)
        state = states[rank]
        if show_stack and state and state.get("stack"):
            stacks.append((rank, state["stack"]))
    # The ranks outside the collective first: they are the ones to look at.
    ordered = sorted(by_text.items(), key=lambda kv: (kv[0].startswith("waits in"), kv[1]))
    parts = []
    for text, ranks in ordered:
        verb = text
        if len(ranks) > 1:  # plural verbs: "ranks 0–2 wait in", "have not entered"
            verb = re.sub(r"^(waits|has|did)\b", lambda m: {"waits": "wait", "has": "have", "did": "did"}[m.group(1)],
                          text)
        parts.append(f"{rank_ranges(ranks)} {verb}")
    summary = "; ".join(parts)
    details = []
    for rank, stack in stacks:
        details.append(f"rank {rank}'s stack (the thread that runs its collectives):")
        details.extend("    " + line for line in stack.rstrip().splitlines())
    return summary, details


# -- trace directories (polyparallel trace DIR) --------------------------------------------------------------------


def read_dir(directory: str) -> dict[int, dict[str, Any]]:
    """The dumps in ``directory``: ``{rank: {"header": {...}, "entries": [...]}}``.

    :raises FileNotFoundError: the directory does not exist.
    :raises ValueError: it holds no ``rank<r>.jsonl`` file, or one is not JSON lines.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory!r} is not a directory. Pass the directory given to --trace-dir "
                                "(or POLYPARALLEL_TRACE_DIR / polyparallel.launch(trace_dir=)).")
    out: dict[int, dict[str, Any]] = {}
    for name in sorted(os.listdir(directory)):
        match = re.fullmatch(r"rank(\d+)\.jsonl", name)
        if not match:
            continue
        path = os.path.join(directory, name)
        records = _read_trace_file(path)
        if not records:
            continue
        out[int(match.group(1))] = {"header": records[0], "entries": records[1:]}
    if not out:
        raise ValueError(f"{directory!r} holds no rank<r>.jsonl trace file. Run the job with --trace-dir "
                         f"{directory} (polyparallel launch) or polyparallel.launch(..., trace_dir=...), and make sure "
                         "POLYPARALLEL_TRACE is not 0.")
    return out


def _read_trace_file(path: str) -> list[dict[str, Any]]:
    """The records of one ``rank<r>.jsonl``: a header object, then entries (each checked with
    :func:`entry_problem`). :raises ValueError: naming the file and the line."""
    not_trace = f"{path} is not a trace file (JSON lines)"
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    except UnicodeDecodeError:
        raise ValueError(f"{not_trace}: it is not UTF-8 text (a binary file?).") from None
    records: list[dict[str, Any]] = []
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{not_trace}: line {number}: {exc}") from None
        if records:
            problem = entry_problem(record)
        else:
            problem = None if isinstance(record, dict) else f"the header is a JSON object, not {type(record).__name__}"
        if problem:
            raise ValueError(f"{not_trace}: line {number}: {problem}.")
        records.append(record)
    return records


WIDTH = 100
"""Columns ``polyparallel trace``'s table fits in (:func:`timeline_text`)."""

LEGEND = ("!: the ranks differ in this row, or one has no entry (the desync or the hang); "
          "# is the sequence number on the axis, checked on every rank; "
          "u after it: not identity-checked, paired by its order on the axis (the N-th unchecked call on that "
          "axis of each rank); -: no entry from that rank; [entered] waits for the peers, [running] moves the "
          "payload, [failed] failed (no mark: done); a narrow column leaves out the time and the framework's frame "
          "(--rank R shows them); ...[n]: cut to fit, in full below the table.")
"""What the marks of :func:`timeline`'s table mean (printed under it)."""

_RANK_MIN = 20  # the narrowest rank column before the ranks are split into several tables


def _rows(traces: Mapping[int, Mapping[str, Any]], last: int | None
          ) -> tuple[list[int], list[tuple[list[str], dict[int, tuple[str, str, str, str, str]]]]]:
    """``(ranks, rows)``: each row is its fixed cells (mark, time, axis, number) and, per rank
    present, the parts of its cell: ``(operation, " [state]", " 1.0ms", "file:line", " via
    file:line")`` (empty strings where absent)."""
    ranks = sorted(traces)
    rows: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = {}
    unchecked: dict[tuple[int, str], int] = {}
    for rank in ranks:
        for entry in traces[rank]["entries"]:
            if entry.get("seq") is not None:
                key: tuple[Any, ...] = (entry["axis"], entry["seq"], "")
            else:  # unchecked collectives: paired by their order on the axis
                k = unchecked[(rank, entry["axis"])] = unchecked.get((rank, entry["axis"]), 0) + 1
                key = (entry["axis"], k, "u")
            rows.setdefault(key, {})[rank] = entry
    t_min = min((e["t0"] for row in rows.values() for e in row.values()), default=0.0)
    ordered = sorted(rows.items(), key=lambda kv: min(e["t0"] for e in kv[1].values()))
    if last is not None:
        ordered = ordered[-last:]
    out = []
    for (axis, seq, kind), row in ordered:
        ops = {(e["operation"], e.get("detail")) for e in row.values()}
        differs = len(ops) > 1 or len(row) != len(ranks)
        cells = {}
        for rank, e in row.items():
            took = f" {1e3 * (e['t1'] - e['t0']):.1f}ms" if e.get("t1") else ""
            state = "" if e["state"] == "done" else f" [{e['state']}]"
            user, _, via = location(e).partition(" via ")
            cells[rank] = (e["operation"], state, took, user, f" via {via}" if via else "")
        t0 = min(e["t0"] for e in row.values()) - t_min
        out.append((["!" if differs else "", f"{t0:.3f}", axis, f"{seq}{'u' if kind else ''}"], cells))
    return ranks, out


def timeline(traces: Mapping[int, Mapping[str, Any]], last: int | None = None) -> tuple[list[str], list[list[str]]]:
    """A table aligning the ranks' collectives: one row per (axis, sequence number) — checked
    collectives — or per unchecked collective in order (``#`` ``3u``: the third unchecked one on
    that axis), one column per rank holding ``operation state (file:line)``; rows where the ranks
    differ are marked ``!``. The time column is seconds since the earliest entry of any rank.
    ``last``: only the last N rows. Cells are in full: :func:`timeline_text` fits them in a width."""
    ranks, rows = _rows(traces, last)
    header = ["", "t (s)", "axis", "#", *(f"rank {r}" for r in ranks)]
    return header, [[*fixed, *(_cell(*cells[r]) if r in cells else "-" for r in ranks)] for fixed, cells in rows]


def _cell(op: str, state: str, took: str, user: str, via: str) -> str:
    return f"{op}{state}{took} ({user}{via})"


def timeline_text(traces: Mapping[int, Mapping[str, Any]], last: int | None = None, width: int = WIDTH) -> list[str]:
    """:func:`timeline` as lines of at most ``width`` characters (``polyparallel trace``).

    A cell too long for its column leaves out the framework's frame (``via fit_loop.py:301``),
    then the time (``--rank R`` shows both); if still too long, it keeps its state and
    ``file:line`` and cuts the operation's name, marked ``...[n]``, and the full cells are listed
    under the table as ``[n] ...`` (one number per distinct text); then :data:`LEGEND`. Each rank column is at least 20
    characters wide: when the ranks do not fit so, they are split into several tables of as many
    ranks as fit (4 ranks of long names in 100 columns: ranks 0-1, then ranks 2-3), each with
    the same rows. An axis name longer than 12 characters is cut the same way. The notes under
    the table are not cut (they hold the full text).
    """
    ranks, rows = _rows(traces, last)
    notes: dict[str, int] = {}

    def fit(w: int, op: str, state: str = "", took: str = "", user: str = "", via: str = "") -> str:
        # the framework's frame goes first, then the time (both in --rank R), then the name is cut
        full = _cell(op, state, took, user, via) if user else op
        for text in (full, _cell(op, state, took, user, "") if user else op, _cell(op, state, "", user, "") if user
                     else op):
            if len(text) <= w:
                return text
        n = notes.setdefault(full, len(notes) + 1)
        mark = f"...[{n}]"
        rest = f"{state} ({user})" if user else ""
        room = w - len(rest) - len(mark)
        if room >= 8:
            return op[:room] + mark + rest
        short = _cell(op, state, "", user, "") if user else op
        return short[:max(w - len(mark), 1)] + mark

    axis_w = min(12, max([4, *(len(fixed[2]) for fixed, _ in rows)]))
    fixed_rows = [[f[0], f[1], fit(axis_w, f[2]), f[3]] for f, _ in rows]
    fixed_w = [max([len(h), *(len(f[i]) for f in fixed_rows)]) for i, h in enumerate(["", "t (s)", "axis", "#"])]
    room = width - sum(w + 2 for w in fixed_w)
    natural = max([len(f"rank {r}") for r in ranks] + [len(_cell(*c)) for _, cells in rows for c in cells.values()],
                  default=0)
    per_table = len(ranks) if (natural + 2) * len(ranks) <= room + 2 else max(1, (room + 2) // (_RANK_MIN + 2))
    chunks = -(-len(ranks) // per_table) if ranks else 1
    size = -(-len(ranks) // chunks) if ranks else 0
    lines: list[str] = []
    for c in range(chunks):
        group = ranks[c * size:(c + 1) * size]
        w = max(_RANK_MIN, (room + 2) // max(len(group), 1) - 2)
        body = [[*fixed, *(fit(w, *cells[r]) if r in cells else "-" for r in group)]
                for fixed, (_, cells) in zip(fixed_rows, rows)]
        if c:
            lines.append("")
        lines.extend(table(["", "t (s)", "axis", "#", *(f"rank {r}" for r in group)], body).splitlines())
    if notes:
        lines.append("")
        lines.extend(f"[{n}] {text}" for text, n in notes.items())
    lines.append("")
    lines.extend(textwrap.wrap(LEGEND, width))
    return lines
