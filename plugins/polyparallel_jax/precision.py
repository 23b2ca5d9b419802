"""``Strategy(precision=)`` on JAX: each :class:`polyparallel.PrecisionPolicy` field and its mechanism.

JAX has no autocast: the dtypes are where the arrays are cast, and the four roles map to four
places (what :class:`polyparallel_jax.Model` does; the runtime's operations do their part of it
for a hand-written loop):

- ``param_dtype``: the parameters are *kept* in it. ``wrap_model`` (and so ``Model``) casts the
  floating ``nnx.Param`` leaves once, when the state is placed on the mesh; ``apply_updates``
  keeps them in it (optax casts each update to its parameter's dtype). Gradients come out of
  ``jax.grad`` in it (the transpose of a cast is the cast back) and are accumulated in it.
- ``compute_dtype``: forward and backward run in it. Inside the step the floating parameters and
  the floating inputs are cast to it before the module is called (:func:`for_compute`), so every
  op of the module, Flax's layers or the user's own, runs in it. The loss is taken on the
  predictions cast back to the parameters' dtype (as autocast computes losses in float32).
  BatchNorm statistics (``nnx.BatchStat``) are not parameters: they stay float32 (Flax reduces
  them in float32).
- ``reduce_dtype``: the data-axis reduction of the gradients runs in it: ``sync_grads`` casts each
  floating gradient to it, reduces (``pmean``/``psum``), and casts back to the gradient's dtype.
- ``optimizer_dtype``: the optimizer's parameter-shaped state (Adam's moments) is kept in it
  (:func:`optimizer`, which wraps the user's optax transformation: ``optax.tree_map_params``
  finds those leaves, so step counts and hyperparameters are left alone).

Refused before anything is compiled, by :func:`check` (``launch`` refuses them before any
process starts): ``loss_scaling=True`` (dynamic loss scaling is not implemented here: optax has
no gradient scaler, and a float16 run without one underflows silently) and float64 anywhere
unless ``jax_enable_x64`` is on (JAX would silently compute in float32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import polyparallel as pp

__all__ = ["Dtypes", "check", "dtypes", "for_compute", "optimizer", "REFUSED", "RUNS", "bytes_per_device", "to_dtype"]

#: The presets the JAX runtime and Model run, and "custom" (any other combination of dtypes,
#: minus what :func:`check` refuses).
RUNS = frozenset({"32", "bf16-mixed", "bf16-true", "custom"})
#: Why the others are refused (given in the refusal).
REFUSED = {"fp16-mixed": "its dynamic loss scaling is not implemented on JAX (optax has no gradient scaler, and "
                         "float16 compute without one underflows gradients silently); use 'bf16-mixed' (bfloat16 "
                         "keeps float32's exponent range and needs no scaling)"}


@dataclass(frozen=True)
class Dtypes:
    """A policy's four dtypes as ``jnp`` dtypes."""

    param: Any
    compute: Any
    reduce: Any
    optimizer: Any

    @property
    def mixed(self) -> bool:
        return bool(self.compute != self.param)


def check(policy: pp.PrecisionPolicy | None, where: str = "polyparallel_jax") -> None:
    """Refuse what JAX would not run as stated (see the module docstring), naming the fix."""
    if policy is None:
        return
    if policy.loss_scaling:
        raise pp.UnsupportedTopologyError(
            f"{where} cannot run {policy!r}: {REFUSED['fp16-mixed'].replace('its dynamic', 'dynamic')}. Or set "
            "loss_scaling=False explicitly for float16 compute without scaling.")
    wide = [role for role, dtype in policy.dtypes().items() if dtype == "float64"]
    if wide:
        import jax

        if not jax.config.read("jax_enable_x64"):
            raise pp.UnsupportedTopologyError(
                f"{where} cannot run {policy!r}: float64 {', '.join(wide)} needs jax_enable_x64 (without it JAX "
                "computes in float32). Set jax.config.update('jax_enable_x64', True) before creating arrays, or "
                "use float32.")


def to_dtype(name: str) -> Any:
    import jax.numpy as jnp

    return jnp.dtype(name)


def dtypes(policy: pp.PrecisionPolicy | None) -> Dtypes | None:
    """``policy``'s dtypes as ``jnp`` dtypes (``None``: no policy, nothing is cast)."""
    if policy is None:
        return None
    return Dtypes(*(to_dtype(policy.dtypes()[role]) for role in ("param", "compute", "reduce", "optimizer")))


def _floating(x: Any) -> bool:
    import jax.numpy as jnp

    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def cast(tree: Any, dtype: Any) -> Any:
    """``tree`` with its floating array leaves cast to ``dtype`` (integers, keys untouched)."""
    import jax

    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if _floating(x) and x.dtype != dtype else x, tree)


def for_compute(tree: Any, policy: Dtypes | pp.PrecisionPolicy | None) -> Any:
    """Parameters or inputs cast to the compute dtype (for a hand-written forward: call the
    module on ``nnx.merge(graphdef, for_compute(params, strategy.precision), ...)``)."""
    if isinstance(policy, pp.PrecisionPolicy):
        policy = dtypes(policy)
    return tree if policy is None else cast(tree, policy.compute)


def optimizer(tx: Any, dtype: Any) -> Any:
    """``tx`` whose parameter-shaped state is kept in ``dtype``: cast at ``init`` and after every
    ``update`` (optax computes the moments in the promoted dtype of state and gradients, and
    would otherwise leave them in float32 after the first step). The state has ``tx``'s own
    structure, so checkpoints do not depend on the precision."""
    import optax

    def keep(state: Any) -> Any:
        return optax.tree_map_params(tx, lambda leaf: cast(leaf, dtype), state)

    def init(params: Any) -> Any:
        return keep(tx.init(params))

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        updates, state = tx.update(updates, state, params, **extra)
        return updates, keep(state)

    return optax.GradientTransformationExtraArgs(init, update)


def bytes_per_device(tree: Any) -> int:
    """The bytes ``tree``'s arrays hold on one device (the first of the mesh: the largest share
    under an even split), for memory figures per rank (parameters, optimizer state)."""
    import jax

    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            shards = leaf.addressable_shards
            first = min(shards, key=lambda shard: shard.device.id)
            total += first.data.nbytes
        elif hasattr(leaf, "nbytes"):
            total += int(leaf.nbytes)
    return total
