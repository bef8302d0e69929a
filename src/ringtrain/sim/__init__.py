"""The cluster simulator: cost models, layer traces, cluster profiles, simulation.

Modules: ``costs`` (time of one collective from α, β, γ), ``calibrate`` (α–β fitted to
measurements); traces, clusters and the simulator itself live beside them.
"""

# --- cost models and calibration (owner: sim.costs / sim.calibrate) ----------------------
from .calibrate import fit_alpha_beta
from .costs import ALGORITHMS, NETWORKS, NetworkProfile, allreduce_cost, allreduce_time, algbw, busbw, network

__all__ = [
    "ALGORITHMS",
    "NETWORKS",
    "NetworkProfile",
    "algbw",
    "allreduce_cost",
    "allreduce_time",
    "busbw",
    "fit_alpha_beta",
    "network",
]
# --- end of cost models and calibration (other blocks: extend __all__ with +=) -----------

# --- traces, clusters and the simulator (owner: sim.traces / clusters / simulator) -------
from .clusters import Cluster
from .devices import DEVICES, DeviceProfile
from .models_zoo import MODELS, build_trace
from .simulator import SCHEDULES, Prediction, predict, predict_with_cost, sweep
from .traces import Layer, Trace, profile_module

__all__ += [
    "Cluster",
    "DEVICES",
    "DeviceProfile",
    "Layer",
    "MODELS",
    "Prediction",
    "SCHEDULES",
    "Trace",
    "build_trace",
    "predict",
    "predict_with_cost",
    "profile_module",
    "sweep",
]
# --- end of traces, clusters and the simulator ------------------------------------------
