"""polyparallel: one parallel-training strategy for every framework.

Build one :class:`Strategy` (a :class:`Topology` of named axes plus policies) and hand it to any
framework through its plugin. Importing this package imports no framework and loads no plugin:
plugins are discovered through the ``polyparallel`` entry-point group on first use.
"""

from __future__ import annotations

from ._capabilities import Capabilities
from ._checkpoint_manager import CheckpointManager
from ._checkpoints import latest_checkpoint
from ._errors import (
    CheckpointError,
    CollectiveError,
    CollectiveTimeout,
    LaunchError,
    NoPluginError,
    PluginError,
    PolyparallelError,
    TopologyError,
    UnsupportedTopologyError,
)
from ._launch import launch
from ._manager import PluginManager, get_plugin_manager, hookimpl
from ._policies import DataPolicy, GradPolicy, Mean, MetricPolicy, PrecisionPolicy, ShardPolicy, StatePolicy
from ._session import ProcessInfo, Session, SessionScope, current_session_scope, session_scope
from ._sharding import micro_batch_size, shard_indices, shard_length
from ._strategy import Strategy
from ._topology import AXES, Topology
from .hookspecs import hookspec

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "Capabilities",
    "CheckpointError",
    "CheckpointManager",
    "CollectiveError",
    "CollectiveTimeout",
    "DataPolicy",
    "GradPolicy",
    "LaunchError",
    "Mean",
    "MetricPolicy",
    "NoPluginError",
    "PluginError",
    "PluginManager",
    "PolyparallelError",
    "PrecisionPolicy",
    "ProcessInfo",
    "Session",
    "SessionScope",
    "ShardPolicy",
    "StatePolicy",
    "Strategy",
    "Topology",
    "TopologyError",
    "UnsupportedTopologyError",
    "current_session_scope",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "latest_checkpoint",
    "launch",
    "micro_batch_size",
    "session_scope",
    "shard_indices",
    "shard_length",
]
