"""``polyparallel/_demo_report.py``: how ``polyparallel demo`` shows its run to a person.

The command runs in a subprocess, as a user runs it, with a plugin of this file's making whose
entries start real child processes that print the kinds of output frameworks print (Python
warnings, Lightning's own warning layout, a logger's ``[WARNING]``, banners on stdout): those must
land in the log, counted, and never between the progress lines and the table; polyparallel's own
warnings must still reach the terminal.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from polyparallel import _demo_report as report

pytestmark = pytest.mark.timeout(120)

PLUGIN = textwrap.dedent('''
    import subprocess, sys
    import polyparallel as pp

    CHILD = """
    import sys, warnings
    print("DeepSpeed op built successfully")  # stdout: a banner
    sys.stdout.flush()
    warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning)
    sys.stderr.write("/site-packages/lightning/pytorch/utilities/_pytree.py:21: `LeafSpec` is deprecated\\\\n")
    sys.stderr.write("[2026-12-01 20:35:01,011] [WARNING] [engine.py:2304] untested optimizer\\\\n")
    warnings.warn("polyparallel: skipping plugin 'x' (x:y): ImportError")
    """

    def row(name, strategy, nprocs, losses):
        return {"framework": name, "topology": repr(strategy.topology.resolve(nprocs)), "final_loss": losses[-1],
                "accuracy": 0.9, "step_time_ms": 1.0, "losses": losses, "epochs": 2}

    def noisy(strategy, nprocs):
        subprocess.run([sys.executable, "-c", CHILD], check=True)  # inherits descriptors 1 and 2
        return row("noisy", strategy, nprocs, [2.0, 1.0, 0.5, 0.25])

    def quiet(strategy, nprocs):
        return row("quiet", strategy, nprocs, [2.0, 1.1, 0.6, 0.3])

    def broken(strategy, nprocs):
        print("the last thing the framework said")
        raise RuntimeError("diverged")

    @pp.hookimpl
    def polyparallel_register_demos(register):
        register("noisy", noisy)
        register("quiet", quiet)
        register("broken", broken)
''')


def demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "noisy_demo_plugin.py").write_text(PLUGIN)
    env = {**os.environ, "POLYPARALLEL_DISABLE_PLUGIN_AUTOLOAD": "1", "POLYPARALLEL_PLUGINS": "noisy_demo_plugin",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "polyparallel.cli", "demo", "--out", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=100)


def test_framework_output_goes_to_the_log_counted_and_polyparallel_warnings_stay_visible(tmp_path):
    done = demo(tmp_path, "--only", "noisy", "--only", "quiet")
    assert done.returncode == 0, done.stderr
    terminal = done.stdout + done.stderr
    for noise in ("built successfully", "all_gather_into_tensor", "LeafSpec", "untested optimizer"):
        assert noise not in terminal
    log = (tmp_path / "out" / "demo-warnings.log").read_text()
    for noise in ("built successfully", "all_gather_into_tensor", "LeafSpec", "untested optimizer"):
        assert noise in log
    assert "===== noisy =====" in log and "===== quiet =====" in log
    progress = done.stderr.splitlines()
    noisy_done = [line for line in progress if line.startswith("[1/2] noisy: training on 2 processes: done in ")]
    assert len(noisy_done) == 1 and noisy_done[0].endswith("(loss 0.2500, accuracy 0.9000); 4 framework warnings logged")
    # polyparallel's own warning is repeated under the entry's line, not only logged
    assert any("polyparallel: skipping plugin 'x'" in line for line in progress)
    lines = done.stdout.splitlines()
    assert lines[0].split()[:3] == ["framework", "topology", "final"]
    assert f"4 framework warnings (noisy 4) and 1 other line of framework output logged to {tmp_path / 'out' / 'demo-warnings.log'}" in lines
    assert f"loss curves: {tmp_path / 'out' / 'loss-curves.png'}" in lines
    assert (tmp_path / "out" / "loss-curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["losses"] for r in rows] == [[2.0, 1.0, 0.5, 0.25], [2.0, 1.1, 0.6, 0.3]]
    assert (tmp_path / "out" / "results.txt").read_text().splitlines()[2].startswith("noisy ")


def test_a_failing_entry_shows_the_end_of_its_output_and_the_others_still_report(tmp_path):
    done = demo(tmp_path, "--only", "broken", "--only", "quiet")
    assert done.returncode == 1
    progress = done.stderr.splitlines()
    pattern = re.compile(r"\[2/2\] broken: training on 2 processes: FAILED after \d+ s: RuntimeError: diverged$")
    (failed,) = [i for i, line in enumerate(progress) if pattern.match(line)]  # [2/2]: registration order
    assert progress[failed + 1] == "    the last thing the framework said"
    assert any(line.startswith("quiet ") and "0.3000" in line for line in done.stdout.splitlines())


def test_json_mode_keeps_stdout_for_the_rows(tmp_path):
    done = demo(tmp_path, "--only", "noisy", "--json")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert row["losses"] == [2.0, 1.0, 0.5, 0.25] and row["epochs"] == 2
    assert "4 framework warnings (noisy 4)" in done.stderr


def test_show_output_leaves_the_terminal_as_it_was(tmp_path):
    done = demo(tmp_path, "--only", "noisy", "--show-output")
    assert done.returncode == 0, done.stderr
    assert "all_gather_into_tensor" in done.stderr and "built successfully" in done.stdout
    assert "logged to" not in done.stdout


def test_classify_counts_each_warning_once_and_picks_polyparallels_own():
    text = textwrap.dedent("""\
        GPU available: False, used: False
        /venv/site-packages/torch/distributed/c10d_logger.py:83: FutureWarning: `all_gather_into_tensor` is deprecated.
          return func(*args, **kwargs)
        /venv/site-packages/lightning/pytorch/utilities/_pytree.py:21: `isinstance(treespec, LeafSpec)` is deprecated
        [2026-12-01 20:35:01,011] [WARNING] [engine.py:2304:_do_optimizer_sanity_check] untested optimizer
        W1201 20:35:01.000000 123 gloo.cpp:42] a C++ warning
        /work/repo/plugins/polyparallel_lightning/strategy.py:40: DeprecationWarning: an API our adapter calls
        <string>:1: UserWarning: polyparallel: skipping plugin 'x'
        `Trainer.fit` stopped: `max_epochs=8` reached.
        """)
    warnings, other, own = report.classify(report.LogSection(text))
    assert (warnings, other) == (6, 2)
    assert [line.split(": ", 1)[0] for line in own] == ["/work/repo/plugins/polyparallel_lightning/strategy.py:40", "<string>:1"]


def test_without_matplotlib_the_demo_says_so_instead_of_failing(tmp_path, monkeypatch):
    # `import matplotlib...` raises ImportError, also when an earlier test imported its submodules.
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] or ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    rows = [{"framework": "a", "losses": [1.0, 0.5], "epochs": 1}]
    line = report.draw_loss_curves(rows, tmp_path / "curves.png", "title")
    assert line == "loss curves: not drawn, matplotlib is not installed (pip install matplotlib)"
    assert not (tmp_path / "curves.png").exists()
    assert report.draw_loss_curves([{"framework": "a"}], tmp_path / "c.png", "t") == (
        "loss curves: not drawn (no entry returned its per-step losses)")
