"""The fenced code blocks of the documentation, and what each one promises.

Every fenced block of ``README.md``, ``DESIGN.md``, ``CONTRIBUTING.md`` and ``docs/**/*.md`` either
runs in the test suite or says why it cannot run here. A block says so with an HTML comment on the
line before its fence, which neither GitHub nor the site renders:

``<!-- docs: run -->``
    run it (the default for ``python`` blocks; required for shell blocks). ``timeout=N`` sets its
    limit in seconds (default :data:`DEFAULT_TIMEOUT`), ``exit=N`` the exit status it must end
    with (default 0: a refusal shown on purpose exits 1). Python blocks run as a script
    (``python block.py``; with ``notebook``, as ``python -c`` runs it, the way a notebook cell
    runs: no file behind ``__main__``), shell blocks with ``bash -euo pipefail``;
    ``toml``/``json`` blocks are parsed.
``<!-- docs: file NAME -->``
    write the block to ``NAME`` in the page's working folder (a script a later block launches);
    a later runnable block of the page must name it.
``<!-- docs: output -->``
    the output of the closest runnable block above it, compared with what that block printed
    (stdout, else stderr): whitespace runs are one space, a line ``...`` stands for any lines and
    ``...`` within a line for any text, and decimal numbers match within 2% (or 5e-4), so a
    loss printed as 0.0793 stays 0.0793 on another machine's rounding. The output of a block
    that does not run is shown as it is.
``<!-- docs: skip CATEGORY: why -->``
    not runnable here, with the reason; ``CATEGORY`` is one of :data:`SKIP_CATEGORIES`.

A block without a marker whose language is not ``python`` fails the test: the author has to say
whether it runs. All the blocks of one page run in order in one temporary working folder (so a
block may write a file a later one reads), with ``examples/`` linked into it from the repository.
Snippet lines inside a block (``--8<-- "path"``) are replaced by that file, as the site does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT = 240
SKIP_CATEGORIES = {
    "gpu": "needs GPUs (CUDA/NCCL)",
    "cluster": "needs several machines or a scheduler (SLURM)",
    "long": "runs for minutes (the demo, the whole suite, the benchmarks)",
    "xla": "needs torch_xla, which has an environment of its own (tools/env-xla.sh)",
    "fragment": "part of a program shown on the page (the signature of a hook, a line of a loop)",
    "not-code": "a listing, a layout or a configuration excerpt, not a program",
    "install": "installs packages into the environment",
    "interactive": "waits for a person (serves a site, opens a browser)",
}
SHELL = {"bash", "sh", "shell", "console"}
PARSED = {"toml", "json"}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)[^`]*$")
MARKER = re.compile(r"^\s*<!--\s*docs:\s*(?P<body>.*?)\s*-->\s*$")
SNIPPET = re.compile(r"^\s*-{1,}8<-{1,}\s+[\"'](?P<path>[^\"']+)[\"']\s*$")


@dataclass
class Block:
    """One fenced block: where it is, its language, its code and its marker."""

    path: Path
    line: int
    lang: str
    code: str
    marker: str | None
    kind: str = ""  # run, file, output, skip, unmarked
    options: dict[str, str] = field(default_factory=dict)
    problem: str | None = None

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def documents() -> list[Path]:
    """Every Markdown file whose code blocks must run or say why not."""
    pages = [ROOT / "README.md", ROOT / "DESIGN.md", ROOT / "CONTRIBUTING.md"]
    return pages + sorted((ROOT / "docs").rglob("*.md"))


def _expand(code: str) -> str:
    out = []
    for line in code.splitlines():
        m = SNIPPET.match(line)
        out.append((ROOT / m["path"]).read_text().rstrip("\n") if m else line)
    return "\n".join(out) + "\n"


def _dedent(lines: list[str], indent: str) -> list[str]:
    return [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, in order, classified by their markers."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["info"].lower()
        j = i + 1
        while j < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        body = "\n".join(_dedent(lines[i + 1:j], indent)) + "\n"
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.match(lines[k]) if k >= 0 else None
        found.append(_classify(Block(path, i + 1, lang, _expand(body), marker["body"] if marker else None)))
        i = j + 1
    return found


def _classify(block: Block) -> Block:
    body = block.marker
    if body is None:
        block.kind = "run" if block.lang == "python" else "unmarked"
        if block.kind == "unmarked":
            block.problem = (f"{block.where}: a ```{block.lang or '(no language)'} block without a marker: put "
                             "<!-- docs: run -->, <!-- docs: output --> or <!-- docs: skip CATEGORY: why --> on the line before it")
        return block
    word, _, rest = body.partition(" ")
    if word == "run":
        block.kind = "run"
        for option in rest.split():
            key, _, value = option.partition("=")
            block.options[key] = value
        if block.lang not in SHELL | PARSED | {"python"}:
            block.problem = f"{block.where}: cannot run a ```{block.lang} block (python, shell, toml or json run)"
    elif word == "file":
        block.kind, block.options["name"] = "file", rest.strip()
        if not rest.strip() or block.lang != "python":
            block.problem = f"{block.where}: <!-- docs: file NAME --> takes a file name and a python block"
    elif word == "output":
        block.kind = "output"
    elif word == "skip":
        block.kind = "skip"
        category, _, why = rest.partition(":")
        block.options["category"], block.options["why"] = category.strip(), why.strip()
        if category.strip() not in SKIP_CATEGORIES or not why.strip():
            block.problem = (f"{block.where}: <!-- docs: skip CATEGORY: why --> needs a category of "
                             f"{sorted(SKIP_CATEGORIES)} and a reason. Received: {body!r}")
    else:
        block.kind = "unmarked"
        block.problem = f"{block.where}: unknown marker <!-- docs: {body} -->"
    return block


# -- comparing an output ---------------------------------------------------------------------------------------

NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def _line_pattern(expected: str) -> tuple[re.Pattern[str], list[float]]:
    parts, numbers = [], []
    for i, chunk in enumerate(expected.split("...")):
        if i:
            parts.append(".*?")
        last = 0
        for m in NUMBER.finditer(chunk):
            parts.append(re.escape(chunk[last:m.start()]))
            parts.append(r"(-?\d+\.\d+(?:e[-+]?\d+)?)")
            numbers.append(float(m.group()))
            last = m.end()
        parts.append(re.escape(chunk[last:]))
    return re.compile("^" + "".join(parts) + "$"), numbers


def _line_matches(expected: str, actual: str) -> bool:
    pattern, numbers = _line_pattern(expected)
    m = pattern.match(actual)
    if not m:
        return False
    return all(abs(float(got) - want) <= max(0.02 * abs(want), 5e-4) for got, want in zip(m.groups(), numbers))


def _normal(text: str) -> list[str]:
    lines = [re.sub(r"\s+", " ", line).strip() for line in text.strip("\n").splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def output_matches(expected: str, actual: str) -> bool:
    """Whether ``actual`` is what ``expected`` shows (see the module's docstring)."""
    want, got = _normal(expected), _normal(actual)

    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(got)
        if want[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and _line_matches(want[i], got[j]) and match(i + 1, j + 1)

    return match(0, 0)


def summary() -> dict[str, int]:
    """How many blocks run, are written as files, are outputs, and are skipped (by category)."""
    counts: dict[str, int] = {}
    for page in documents():
        for block in blocks(page):
            key = f"skip:{block.options['category']}" if block.kind == "skip" else block.kind
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


if __name__ == "__main__":  # python tests/docs/codeblocks.py: the counts
    for key, n in summary().items():
        print(f"{key:20} {n}")
