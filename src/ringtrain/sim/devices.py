"""GPU profiles: how long a layer of known size takes on a given accelerator.

Words used here:

* **peak** — the datasheet's dense arithmetic rate in FLOP/s for the precision a training
  run of that generation would use (FP32 on K80, FP16/BF16 tensor cores from V100 on).
* **efficiency** — the fraction of peak a whole training step achieves in practice. It is
  one number per device, calibrated so that ResNet-50's training FLOPs (3 x 4.1 GMAC x 2
  = 24.6 GFLOP per image) reproduce the per-GPU throughput published for that GPU
  (figures in the table's ``source``). Transformers usually achieve more than convolutional
  networks; one factor per device is a deliberate simplification.
* **memory bandwidth** — bytes/s of device memory; a layer that moves more bytes than it
  computes (batch norm, layer norm, pooling) is timed by the bytes it reads and writes.
* **kernel overhead** — a fixed cost per kernel launch, so that many tiny layers are not
  free.

A layer's forward time is ``max(flops / (peak * efficiency), bytes / bandwidth) + overhead``
(a roofline); backward is twice the forward FLOPs and bytes (gradients with respect to the
input and to the weights), plus two overheads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    name: str
    """Short lower-case name used on the command line."""
    peak_flops: float
    """Dense FLOP/s of the precision used for training (see ``precision``)."""
    efficiency: float
    """Fraction of ``peak_flops`` that a training step achieves, 0 < efficiency <= 1."""
    memory_bw: float
    """Device-memory bandwidth in bytes/s."""
    activation_bytes: int
    """Bytes per activation element (4 for FP32, 2 for FP16/BF16 mixed precision)."""
    precision: str
    """Which arithmetic ``peak_flops`` refers to."""
    kernel_overhead_s: float = 5e-6
    """Seconds added per kernel launch."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("device name must not be empty")
        # (infinity allowed: a device whose compute or memory costs nothing; NaN fails `> 0`)
        if not (self.peak_flops > 0 and self.memory_bw > 0):
            raise ValueError(f"device {self.name}: peak_flops and memory_bw must be numbers > 0, got "
                             f"{self.peak_flops} and {self.memory_bw}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"device {self.name}: efficiency must be in (0, 1], got {self.efficiency}")
        if self.activation_bytes not in (2, 4):
            raise ValueError(f"device {self.name}: activation_bytes must be 2 or 4, got {self.activation_bytes}")
        if not 0 <= self.kernel_overhead_s < math.inf:
            raise ValueError(f"device {self.name}: kernel_overhead_s must be a finite number >= 0, got "
                             f"{self.kernel_overhead_s}")

    def layer_time(self, flops: float, nbytes: float, kernels: int = 1) -> float:
        """Seconds for work of ``flops`` arithmetic and ``nbytes`` memory traffic."""
        if flops < 0 or nbytes < 0 or kernels < 0:
            raise ValueError("flops, nbytes and kernels must be >= 0")
        return max(flops / (self.peak_flops * self.efficiency), nbytes / self.memory_bw) + kernels * self.kernel_overhead_s


# One table, units in the column names' docstrings above: FLOP/s, bytes/s, seconds.
# ResNet-50 calibration: efficiency = throughput [img/s] x 24.6e9 / peak.
DEVICES: dict[str, DeviceProfile] = {
    d.name: d
    for d in (
        DeviceProfile(
            name="k80", peak_flops=4.37e12, efficiency=0.30, memory_bw=240e9, activation_bytes=4,
            precision="fp32",
            source="NVIDIA Tesla K80 datasheet: 8.73 TFLOP/s FP32 boost and 480 GB/s per board of two "
                   "GK210 GPUs (halved here); ResNet-50 ~53 img/s per GPU (Caffe/TensorFlow era) -> 0.30",
        ),
        DeviceProfile(
            name="v100", peak_flops=125e12, efficiency=0.27, memory_bw=900e9, activation_bytes=2,
            precision="fp16 tensor core",
            source="NVIDIA V100 SXM2 datasheet: 125 TFLOP/s tensor, 900 GB/s HBM2; ResNet-50 mixed "
                   "precision ~1,370 img/s per GPU (NVIDIA DeepLearningExamples) -> 0.27",
        ),
        DeviceProfile(
            name="a100", peak_flops=312e12, efficiency=0.22, memory_bw=2039e9, activation_bytes=2,
            precision="bf16/fp16 tensor core",
            source="NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e; ResNet-50 "
                   "~2,800 img/s per GPU (MLPerf Training v1.x class) -> 0.22",
        ),
        DeviceProfile(
            name="h100", peak_flops=989e12, efficiency=0.14, memory_bw=3350e9, activation_bytes=2,
            precision="bf16/fp16 tensor core",
            source="NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3; ResNet-50 "
                   "~5,600 img/s per GPU (MLPerf Training v3.x class) -> 0.14",
        ),
    )
}


def get_device(name: str) -> DeviceProfile:
    """The profile called ``name`` (case-insensitive); ValueError lists the known ones."""
    key = name.strip().lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(DEVICES)}")
    return DEVICES[key]
