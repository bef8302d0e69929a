"""The cluster simulator: cost models, layer traces, cluster profiles, simulation.

Modules: ``costs`` (time of one collective from α, β, γ), ``calibrate`` (α–β fitted to
measurements); traces, clusters and the simulator itself live beside them.
"""

# --- cost models and calibration (owner: sim.costs / sim.calibrate) ----------------------
from .calibrate import fit_alpha_beta

__all__ = ["fit_alpha_beta"]
# --- end of cost models and calibration ---------------------------------------------------
