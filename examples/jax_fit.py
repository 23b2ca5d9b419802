"""Train an MLP on scikit-learn's digits with an Elegy-style ``Model.fit`` on Flax NNX, parallelised
by the same polyparallel Strategy as the PyTorch examples.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/jax_fit.py            # data=8
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/jax_fit.py --tensor 2  # data=4 x tensor=2
"""

from __future__ import annotations

import argparse

import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import polyparallel as pp
import polyparallel_jax.plugin
from polyparallel_jax import Model


class MLP(nnx.Module):
    """64 -> 128 -> BatchNorm -> 10."""

    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 128, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensor", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    # The plugin is found through the `polyparallel` entry point once polyparallel[jax] is
    # installed; registering it here keeps the example working from a bare checkout.
    pm = pp.get_plugin_manager()
    if not any(p.module == "polyparallel_jax.plugin" for p in pm.plugins()):
        pm.register(polyparallel_jax.plugin, name="jax")

    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    strategy = pp.Strategy(data=-1, tensor=args.tensor)  # the same object every framework takes

    model = Model(MLP(nnx.Rngs(0)), loss="cross_entropy", optimizer=optax.adam(3e-3), metrics=["accuracy"])
    history = model.fit(x[:1440], y[:1440], epochs=args.epochs, batch_size=args.batch_size,
                        validation_data=(x[1440:], y[1440:]), strategy=strategy)
    print(f"final loss {history['loss'][-1]:.4f}, validation accuracy {history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
