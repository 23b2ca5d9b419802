"""The README's example runs as printed (4 processes, data=2 x tensor=2) and its metric is the
same on every rank."""

import ast
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs(tmp_path):
    text = README.read_text()
    start = text.index("```python\nimport torch") + len("```python\n")
    code = text[start:text.index("```", start)]
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = subprocess.run(["timeout", "-k", "10", "240", sys.executable, str(script)], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 4 and all(r == results[0] for r in results) and 0 < results[0]["loss"] < 2
