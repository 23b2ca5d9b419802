"""Every code block of the documentation runs as shown, or says why it cannot run here.

``tests/docs/codeblocks.py`` finds the blocks and reads their markers; this module runs them, one
test per page (its blocks in order, in one temporary folder), and compares each output shown with
what its block printed. A block without a marker, a marker without a reason, a file no block
runs, or an output block with nothing above it to compare with fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import codeblocks as cb

PAGES = [page for page in cb.documents() if cb.blocks(page)]
_RUNS: dict[str, subprocess.CompletedProcess] = {}  # python code -> its run (the README's example is the quickstart's)


def test_every_block_runs_or_says_why_not():
    problems = [block.problem for page in cb.documents() for block in cb.blocks(page) if block.problem]
    assert not problems, "\n".join(problems)


def test_every_written_file_is_run_and_every_output_follows_a_block():
    problems = []
    for page in cb.documents():
        found = cb.blocks(page)
        for i, block in enumerate(found):
            if block.kind == "file":
                name = block.options["name"]
                used = (name, name.removesuffix(".py"))  # run as a script, or imported as a module
                if not any(n in later.code for later in found[i + 1:] if later.kind in ("run", "file") for n in used):
                    problems.append(f"{block.where}: {name} is written but no later block of the page runs it")
            if block.kind == "output" and not any(b.kind in ("run", "skip") for b in found[:i]):
                problems.append(f"{block.where}: an output block with no code block above it")
    assert not problems, "\n".join(problems)


def _env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", NO_MKDOCS_2_WARNING="1",
               POLYPARALLEL_CACHE_DIR=str(workdir / ".cache"))  # bench-comm/plan write no user cache
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(workdir), env.get("PYTHONPATH", "")) if p)
    return env


def _run(block: cb.Block, workdir: Path, index: int) -> subprocess.CompletedProcess:
    timeout = int(block.options.get("timeout") or cb.DEFAULT_TIMEOUT)
    if block.lang == "python":
        if block.code in _RUNS:
            return _RUNS[block.code]
        if "notebook" in block.options:  # as a notebook cell runs: no file behind __main__ (`python -` has one: <stdin>)
            command = [sys.executable, "-c", block.code]
        else:
            script = workdir / f"block{index}_line{block.line}.py"
            script.write_text(block.code)
            command = [sys.executable, script.name]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    done = subprocess.run(["timeout", "-k", "10", str(timeout), *command], cwd=workdir, env=_env(workdir),
                          capture_output=True, text=True, timeout=timeout + 30)
    if block.lang == "python":
        _RUNS[block.code] = done
    return done


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(cb.ROOT)) for p in PAGES])
def test_page_blocks_run_and_print_what_is_shown(page: Path, tmp_path: Path):
    (tmp_path / "examples").symlink_to(cb.ROOT / "examples")
    last: tuple[cb.Block, subprocess.CompletedProcess | None] | None = None
    ran = 0
    for index, block in enumerate(cb.blocks(page)):
        if block.problem:
            pytest.fail(block.problem)
        if block.kind == "skip":
            last = (block, None)
        elif block.kind == "file":
            (tmp_path / block.options["name"]).write_text(block.code)
        elif block.kind == "run" and block.lang in cb.PARSED:
            if block.lang == "toml":
                pytest.importorskip("tomllib").loads(block.code)  # Python 3.11+
            else:
                json.loads(block.code)
        elif block.kind == "run":
            done = _run(block, tmp_path, index)
            ran += 1
            expected = int(block.options.get("exit") or 0)  # `polyparallel plan` refusing a topology exits 1
            assert done.returncode == expected, (
                f"{block.where} exited with {done.returncode}, expected {expected}\n--- stdout\n{done.stdout[-4000:]}"
                f"\n--- stderr\n{done.stderr[-4000:]}")
            last = (block, done)
        elif block.kind == "output":
            assert last is not None, f"{block.where}: an output block with no code block above it"
            source, done = last
            if done is None:
                continue  # the output of a block that cannot run here: shown as it is
            assert any(cb.output_matches(block.code, text) for text in (done.stdout, done.stderr, done.stdout + done.stderr)), (
                f"{block.where}: the output shown differs from what {source.where} printed\n--- shown\n{block.code}"
                f"--- printed (stdout)\n{done.stdout[-4000:]}\n--- printed (stderr)\n{done.stderr[-4000:]}")
    assert ran or all(b.kind in ("skip", "output", "file") or b.lang in cb.PARSED for b in cb.blocks(page))
