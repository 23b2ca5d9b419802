"""polyparallel_jax.progress: the text progress bar."""

from __future__ import annotations

import io
import re

from polyparallel_jax.progress import ProgressBar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_non_terminal_gets_only_the_final_line(capsys):
    bar = ProgressBar(10, "epoch 2/5")
    bar.update(3, {"loss": 0.5})
    assert capsys.readouterr().err == ""
    bar.update(10, {"loss": 0.43125, "accuracy": 0.875}, final=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert re.fullmatch(r"epoch 2/5 \[#{20}\] 10/10 loss=0\.4313 accuracy=0\.8750 \d+\.\dms/step\n", captured.err)


def test_disabled_prints_nothing(capsys):
    bar = ProgressBar(10, "epoch 1/1", enabled=False)
    bar.update(5, {"loss": 1.0})
    bar.update(10, {"loss": 1.0}, final=True)
    assert capsys.readouterr() == ("", "")
    terminal = _Terminal()
    ProgressBar(10, "x", enabled=False, stream=terminal).update(10, {}, final=True)
    assert terminal.getvalue() == ""


def test_terminal_redraws_in_place_with_a_proportional_bar():
    terminal = _Terminal()
    bar = ProgressBar(8, "eval", stream=terminal, width=8)
    bar.update(2, {"m": 1})
    bar.update(8, {"m": 2}, final=True)
    lines = terminal.getvalue().split("\r")
    assert lines[0] == "" and len(lines) == 3
    assert lines[1].startswith("eval [##......] 2/8 m=1.0000 ") and not lines[1].endswith("\n")
    assert lines[2].startswith("eval [########] 8/8 m=2.0000 ") and lines[2].endswith("ms/step\n")


def test_zero_total_does_not_divide_by_zero():
    stream = io.StringIO()
    ProgressBar(0, "empty", stream=stream).update(0, {}, final=True)
    assert stream.getvalue().startswith("empty [") and "0/0" in stream.getvalue()
