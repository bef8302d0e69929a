"""The optimizer a worker of parameter-server training holds: torch's Optimizer interface over the
servers' SGD, so that torch's learning-rate schedulers and the usual loop work unchanged.

    pst = ParameterServerTraining(model, ..., lr=0.1, momentum=0.9)
    opt = pst.optimizer                                   # a ServerSGD
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=N, cycle_momentum=False)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(pst(x), y).backward()   # the forward takes this step's learning rate; pushes carry it
        opt.step()                      # = pst.step()
        sched.step()                    # sets the next step's learning rate

The servers own the parameters and the SGD state; this object holds no state of its own but
the one group's settings. Its ``lr`` travels with every push of a step (read at the step's
forward), so it may change from step to step; ``momentum`` and
``weight_decay`` reached the servers when the workers joined and stay for the run.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Optional

import torch

FIXED = ("momentum", "weight_decay")


class ServerSGD(torch.optim.Optimizer):
    """One param group over every parameter the servers hold; ``step()`` is the training's
    ``step()``. Made by ``ParameterServerTraining`` (``pst.optimizer``), not by hand."""

    def __init__(self, params: list, step: Callable[[], None], worker: int, *, lr: float, momentum: float,
                 weight_decay: float):
        self._step, self._worker = step, worker
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:  # (the constructor's own call adds the one group)
            raise ValueError(f"worker {self._worker}: the parameter servers' optimizer has one param group, every "
                             "parameter the servers hold, and its learning rate is the one each step carries: "
                             "another group (another learning rate for some parameters) is not supported")
        super().add_param_group(param_group)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        """``ParameterServerTraining.step()``: push what is left, ask for the next parameters."""
        if closure is not None:
            raise ValueError(f"worker {self._worker}: the parameter servers' optimizer takes no closure (it cannot "
                             "evaluate the loss again: the gradients went to the servers during backward)")
        self._step()

    def learning_rate(self) -> float:
        """The learning rate the next step takes, checked (a finite number >= 0; 0 is a warm-up's
        first step); the settings fixed for the run checked unchanged."""
        group = self.param_groups[0]
        for key in FIXED:
            if group[key] != self.defaults[key]:
                cycled = (" (torch's OneCycleLR and CyclicLR cycle momentum unless given cycle_momentum=False)"
                          if key == "momentum" else "")
                raise ValueError(f"worker {self._worker}: the optimizer's {key} is {group[key]!r}, but the servers "
                                 f"took {self.defaults[key]!r} when the workers joined and keep it for the run: only "
                                 f"the learning rate may change from step to step{cycled}")
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = lr.item()
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"worker {self._worker}: the learning rate must be a finite number >= 0, got {lr!r}")
        return float(lr)
