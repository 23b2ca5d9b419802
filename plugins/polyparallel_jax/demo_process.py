"""The process :func:`polyparallel_jax.demo.run` starts: ``python -m polyparallel_jax.demo_process
SPEC`` builds the JAX strategy SPEC describes (JSON: axis sizes, seed, timeout) on a plugin
manager holding this plugin (the entry point need not be installed) and prints
:func:`polyparallel_jax.demo.train`'s result as one JSON line.

It lives apart from :mod:`polyparallel_jax.demo` because it imports the plugin module, which
imports the demo to register it.
"""

from __future__ import annotations

import json
import sys

import polyparallel as pp

from . import plugin
from .demo import train

__all__ = ["main"]


def main(spec: str) -> None:
    """Train the demo under the strategy ``spec`` describes and print its result row."""
    options = json.loads(spec)
    pm = pp.PluginManager(autoload=False)
    pm.register(plugin, name="jax")
    strategy = pp.Strategy(**options["sizes"], seed=options["seed"], timeout=options["timeout"], runtime="jax",
                           plugin_manager=pm)
    print(json.dumps(train(strategy)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
