"""The optimizer a worker of parameter-server training holds: torch's Optimizer interface over the
servers' optimizer (SGD, Adam or AdamW), so that torch's learning-rate schedulers and the usual
loop work unchanged.

    pst = ParameterServerTraining(model, ..., lr=0.1, momentum=0.9)   # or optimizer="adamw", betas=...
    opt = pst.optimizer                                   # a ServerOptimizer
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=N, cycle_momentum=False)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(pst(x), y).backward()   # the forward takes this step's learning rate; pushes carry it
        opt.step()                      # = pst.step()
        sched.step()                    # sets the next step's learning rate

The servers own the parameters and the optimizer's state; this object holds no state of its own
but the one group's settings, the same keys as torch's optimizer of that name has (so that a
scheduler that reads ``betas`` or ``momentum`` finds them). Its ``lr`` travels with every push
of a step (read at the step's forward), so it may change from step to step; every other setting
(``momentum``, ``betas``, ``eps``, ``weight_decay``, ...) reached the servers when the workers
joined and stays for the run.

``torch_optimizer`` is the one place that says which torch optimizer a name is and which of the
HELLO's settings it takes: the servers build theirs with it and the worker's group takes its keys
from it, so the two cannot disagree.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Optional

import torch

#: The optimizers the servers apply (``PSOptions.optimizer``, the HELLO's "optimizer").
OPTIMIZERS = ("sgd", "adam", "adamw")
#: Settings of every optimizer from the HELLO, beside ``lr``: those each one takes.
_TAKES = {"sgd": ("momentum", "weight_decay"), "adam": ("betas", "eps", "weight_decay"),
          "adamw": ("betas", "eps", "weight_decay")}
_CLASSES = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def torch_optimizer(name: str, params: Iterable[torch.Tensor], settings: dict) -> torch.optim.Optimizer:
    """torch's optimizer ``name`` over ``params`` with the job's ``settings`` (a checked HELLO, or
    PSOptions' fields: lr, momentum, betas, eps, weight_decay; those it does not take are ignored).
    Everything else is torch's default (no amsgrad, no nesterov; single-tensor kernels on the CPU,
    so that a partition stepped alone gets the bits one step over every parameter would)."""
    kw = {key: tuple(settings[key]) if key == "betas" else settings[key] for key in _TAKES[name]}
    return _CLASSES[name](params, lr=settings["lr"], **kw)


class ServerOptimizer(torch.optim.Optimizer):
    """One param group over every parameter the servers hold; ``step()`` is the training's
    ``step()``. Made by ``ParameterServerTraining`` (``pst.optimizer``), not by hand."""

    def __init__(self, params: list, step: Callable[[], None], worker: int, *, optimizer: str = "sgd",
                 **settings: Any):
        self._step, self._worker, self.name = step, worker, optimizer
        # The group's keys and values are those of torch's own optimizer of that name and settings
        # (a throw-away one over a stand-in tensor: torch's defaults, not a copy of them here).
        defaults = torch_optimizer(optimizer, [torch.zeros(1, requires_grad=True)], settings).defaults
        super().__init__(params, dict(defaults))

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:  # (the constructor's own call adds the one group)
            raise ValueError(f"worker {self._worker}: the parameter servers' optimizer has one param group, every "
                             "parameter the servers hold, and its learning rate is the one each step carries: "
                             "another group (another learning rate for some parameters) is not supported")
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, for what this object holds: the group's settings (the learning rate a scheduler
        set, saved with ``state_dict()``). A state_dict that carries optimizer state (torch's SGD's
        ``momentum_buffer``, Adam's ``exp_avg``: a torch optimizer's, or a loop moved from one
        process) is refused: that state is the servers', and kept here it would never reach them
        (the step would go on with the servers' own). The servers' state is saved and resumed with
        ``pst.save_checkpoint()`` and servers started with ``resume=True``."""
        held = state_dict.get("state") if isinstance(state_dict, dict) else None
        if held:
            keys = ", ".join(sorted({key for entry in held.values() if isinstance(entry, dict) for key in entry}))
            raise ValueError(f"worker {self._worker}: this state_dict carries optimizer state ({keys or 'entries'} of "
                             f"{len(held)} parameters), but the parameter servers hold the optimizer's state and this "
                             "optimizer would only keep it, unused: resume the servers' state from their checkpoints "
                             "(pst.save_checkpoint(), servers started with resume=True); to restore the learning "
                             "rate alone, load a state_dict without 'state' entries")
        super().load_state_dict(state_dict)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        """``ParameterServerTraining.step()``: push what is left, ask for the next parameters."""
        if closure is not None:
            raise ValueError(f"worker {self._worker}: the parameter servers' optimizer takes no closure (it cannot "
                             "evaluate the loss again: the gradients went to the servers during backward)")
        self._step()

    def learning_rate(self) -> float:
        """The learning rate the next step takes, checked (a finite number >= 0; 0 is a warm-up's
        first step); the settings fixed for the run (every other key of torch's group) checked unchanged."""
        group = self.param_groups[0]
        for key, fixed in self.defaults.items():
            if key != "lr" and group[key] != fixed:
                cycled = (" (torch's OneCycleLR and CyclicLR cycle momentum, Adam's betas, unless given "
                          "cycle_momentum=False)" if key in ("momentum", "betas") else "")
                raise ValueError(f"worker {self._worker}: the optimizer's {key} is {group[key]!r}, but the servers "
                                 f"took {fixed!r} when the workers joined and keep it for the run: only "
                                 f"the learning rate may change from step to step{cycled}")
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() == 1:
            lr = lr.item()
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"worker {self._worker}: the learning rate must be a finite number >= 0, got {lr!r}")
        return float(lr)

