"""The demo problem every plugin trains in ``polyparallel demo``: one definition, so the rows of
the side-by-side table are comparable.

scikit-learn's bundled digits (1,797 8x8 images, 10 classes; no download), a fixed 80/20 split,
features scaled to [0, 1], an MLP 64-64-10 trained with SGD at a global batch size of
:data:`GLOBAL_BATCH` for :data:`EPOCHS` epochs. scikit-learn is imported only when the data is
asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DemoProblem", "PROBLEM", "load_digits_split"]


@dataclass(frozen=True)
class DemoProblem:
    """Hyper-parameters shared by every framework's demo entry."""

    inputs: int = 64
    hidden: int = 64
    classes: int = 10
    global_batch: int = 64
    epochs: int = 8
    lr: float = 0.1
    momentum: float = 0.9
    seed: int = 0


PROBLEM = DemoProblem()


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> tuple[list[list[float]], list[int], list[list[float]], list[int]]:
    """(x_train, y_train, x_test, y_test) as plain lists; deterministic."""
    import random

    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - the demo's extra installs it
        raise ImportError("the demo needs scikit-learn: pip install 'polyparallel[all]'") from exc
    digits = load_digits()
    xs = [[float(v) / 16.0 for v in row] for row in digits.data.tolist()]
    ys = [int(y) for y in digits.target.tolist()]
    order = list(range(len(xs)))
    random.Random(seed).shuffle(order)
    cut = int(len(order) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return [xs[i] for i in train], [ys[i] for i in train], [xs[i] for i in test], [ys[i] for i in test]
