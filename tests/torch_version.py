"""Which torch the tests run under: the pin is 2.13.0, and scripts/torch_compat.sh runs them under
others (2.4.1, the oldest the package accepts; 2.14.1). A few of torch's own behaviours that the
tests compare with differ in older releases; each test that depends on one says which."""

from __future__ import annotations

import torch

#: Older than the pinned 2.13 (checked against 2.4.1; torch's TorchVersion compares with a tuple).
OLDER_TORCH = torch.__version__ < (2, 13)
