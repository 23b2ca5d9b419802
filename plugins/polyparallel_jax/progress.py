"""A plain text progress bar (no dependency, no terminal control beyond ``\\r``)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``epoch 2/5 [#########...........] 12/25 loss=0.4312 accuracy=0.8750 3.1ms/step``.

    :param total: steps in the epoch.
    :param title: text before the bar.
    :param enabled: ``False`` prints nothing (``verbose=0``, or a process other than the logger).
    :param stream: where to write (default ``sys.stderr``).
    """

    def __init__(self, total: int, title: str, enabled: bool = True, stream: TextIO | None = None, width: int = 20):
        self.total, self.title, self.enabled, self.width = total, title, enabled, width
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.tty = getattr(self.stream, "isatty", lambda: False)()

    def update(self, step: int, values: dict[str, Any], final: bool = False) -> None:
        """Show ``step`` of ``total`` with ``values``; a non-terminal gets only the final line."""
        if not self.enabled or (not self.tty and not final):
            return
        filled = int(self.width * step / max(self.total, 1))
        per_step = (time.perf_counter() - self.start) / max(step, 1) * 1e3
        text = " ".join(f"{k}={float(v):.4f}" for k, v in values.items())
        line = f"{self.title} [{'#' * filled}{'.' * (self.width - filled)}] {step}/{self.total} {text} {per_step:.1f}ms/step"
        self.stream.write(("\r" if self.tty else "") + line + ("\n" if final else ""))
        self.stream.flush()
