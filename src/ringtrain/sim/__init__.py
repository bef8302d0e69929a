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
