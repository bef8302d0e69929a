"""Parameter servers: synchronous, asynchronous (stale-synchronous) and sharded.

Servers own the parameters and the optimizer's state (SGD with momentum, Adam or AdamW); workers push gradients during
backward and pull parameters before forward, over ringtrain's framed, authenticated wire.
See docs/ps.md for the loop, the launch roles and the guarantees.
"""

from .launch import LocalServers, benchmark, is_server_rank, launch_local, run_server_role, worker_from_env
from .server import ParameterServer, run_server
from .server_config import STRATEGIES, ServerConfig
from .server_optimizer import OPTIMIZERS, ServerOptimizer
from .sharding import Layout, Partition, make_layout
from .worker import ParameterServerTraining, PSOptions

__all__ = [
    "OPTIMIZERS", "STRATEGIES", "Layout", "LocalServers", "ParameterServer", "ParameterServerTraining", "PSOptions",
    "Partition", "ServerConfig", "ServerOptimizer", "benchmark", "is_server_rank", "launch_local",
    "make_layout", "run_server", "run_server_role", "worker_from_env",
]
