"""Per-sample losses and metrics by name for :class:`polyparallel_jax.Model`.

Each function takes ``(predictions, targets)`` and returns one value per sample (shape
``(batch,)``); the Model weights them by the padding mask and reduces them count-weighted, so a
loss or metric is exactly the mean over the data set whatever the sharding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["LOSSES", "METRICS", "resolve"]


def cross_entropy(logits: Any, labels: Any) -> Any:
    """Softmax cross-entropy with integer labels."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def mse(predictions: Any, targets: Any) -> Any:
    """Mean squared error per sample (averaged over the feature dimensions)."""
    import jax.numpy as jnp

    diff = (predictions - targets.reshape(predictions.shape)) ** 2
    return jnp.mean(diff.reshape(diff.shape[0], -1), axis=1)


def accuracy(logits: Any, labels: Any) -> Any:
    """1.0 where the arg-max class equals the integer label."""
    import jax.numpy as jnp

    return (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)


LOSSES: dict[str, Callable[[Any, Any], Any]] = {"cross_entropy": cross_entropy, "mse": mse}
METRICS: dict[str, Callable[[Any, Any], Any]] = {"accuracy": accuracy, "mse": mse}


def resolve(value: Any, table: dict[str, Callable[[Any, Any], Any]], what: str) -> tuple[str, Callable[[Any, Any], Any]]:
    """``(name, fn)`` for a name in ``table`` or a callable."""
    if isinstance(value, str):
        if value not in table:
            raise ValueError(f"Unknown {what} {value!r}. Expected one of {sorted(table)} or a callable "
                             "fn(predictions, targets) -> per-sample values.")
        return value, table[value]
    if callable(value):
        return getattr(value, "__name__", what), value
    raise TypeError(f"A {what} is a name ({sorted(table)}) or a callable. Received: {type(value).__name__}.")
