"""Fitting the α–β model of one allreduce to measured times.

A *sample* is one measured allreduce: its size in bytes and its time in seconds. The model is
``time = alpha + beta * nbytes`` with alpha (start-up, seconds) and beta (seconds per byte)
both >= 0. :func:`fit_alpha_beta` is the least-squares fit under those two bounds (a
two-variable non-negative least squares): the unconstrained fit when both come out
non-negative, else the better of the two fits with one of them held at 0. The same fit is
used by the trainer (a short allreduce sweep on the live communicator) and the simulator
(α/β from a saved ``bench allreduce`` run), so both read a network the same way.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..plan import check_vector


def fit_alpha_beta(sizes_bytes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(alpha, beta)`` with both >= 0 for ``times ≈ alpha + beta * sizes_bytes``.

    Needs at least two distinct sizes. Sizes and times must be finite and >= 0.
    """
    x = check_vector("sizes_bytes", sizes_bytes)
    y = check_vector("times", times)
    if len(x) != len(y):
        raise ValueError(f"sizes_bytes has {len(x)} entries and times {len(y)}; they must be equal")
    if len(np.unique(x)) < 2:
        raise ValueError("sizes_bytes needs at least two distinct sizes to separate alpha from beta")
    # Centre on the means so the normal equations stay well conditioned when sizes are ~1e9.
    mx, my = x.mean(), y.mean()
    dx, dy = x - mx, y - my
    beta = float(np.dot(dx, dy) / np.dot(dx, dx))
    alpha = float(my - beta * mx)
    if alpha >= 0.0 and beta >= 0.0:
        return alpha, beta
    # The optimum lies on the boundary: alpha = 0 (a line through the origin) or beta = 0.
    through_origin = (0.0, max(0.0, float(np.dot(x, y) / np.dot(x, x))))
    flat = (max(0.0, float(my)), 0.0)
    return min(through_origin, flat, key=lambda ab: float(np.sum((ab[0] + ab[1] * x - y) ** 2)))
