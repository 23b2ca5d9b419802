"""polyparallel_jax.losses: per-sample losses and metrics against numpy/optax references."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from polyparallel_jax import losses

RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(6, 4)).astype(np.float32)
LABELS = np.array([0, 3, 1, 1, 2, 0], np.int32)


def test_cross_entropy_is_per_sample_log_softmax():
    got = np.asarray(losses.cross_entropy(jnp.asarray(LOGITS), jnp.asarray(LABELS)))
    shifted = LOGITS - LOGITS.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    assert got.shape == (6,)
    np.testing.assert_allclose(got, -log_softmax[np.arange(6), LABELS], rtol=1e-5)
    np.testing.assert_allclose(got, np.asarray(optax.softmax_cross_entropy_with_integer_labels(LOGITS, LABELS)))


def test_mse_averages_features_per_sample():
    predictions = RNG.normal(size=(5, 2, 3)).astype(np.float32)
    targets = RNG.normal(size=(5, 2, 3)).astype(np.float32)
    got = np.asarray(losses.mse(jnp.asarray(predictions), jnp.asarray(targets)))
    np.testing.assert_allclose(got, ((predictions - targets) ** 2).reshape(5, -1).mean(axis=1), rtol=1e-5)


def test_mse_reshapes_flat_targets_to_the_predictions():
    predictions = RNG.normal(size=(5, 1)).astype(np.float32)
    targets = RNG.normal(size=(5,)).astype(np.float32)
    got = np.asarray(losses.mse(jnp.asarray(predictions), jnp.asarray(targets)))
    np.testing.assert_allclose(got, (predictions[:, 0] - targets) ** 2, rtol=1e-5)
    assert float(np.mean(got)) == pytest.approx(float(optax.l2_loss(predictions[:, 0], targets).mean() * 2), rel=1e-5)


def test_accuracy_is_argmax_equality():
    got = np.asarray(losses.accuracy(jnp.asarray(LOGITS), jnp.asarray(LABELS)))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, (LOGITS.argmax(axis=1) == LABELS).astype(np.float32))


def test_resolve_names_and_callables():
    assert losses.resolve("cross_entropy", losses.LOSSES, "loss") == ("cross_entropy", losses.cross_entropy)
    assert losses.resolve("accuracy", losses.METRICS, "metric") == ("accuracy", losses.accuracy)

    def hinge(p, t):
        return p - t

    assert losses.resolve(hinge, losses.LOSSES, "loss") == ("hinge", hinge)
    with pytest.raises(ValueError, match=r"Unknown loss 'mae'. Expected one of \['cross_entropy', 'mse'\]"):
        losses.resolve("mae", losses.LOSSES, "loss")
    with pytest.raises(TypeError, match="A metric is a name.*Received: int"):
        losses.resolve(3, losses.METRICS, "metric")
