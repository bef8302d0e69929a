"""Shared test setup: faulthandler on, so a hung test shows every thread's stack."""

from __future__ import annotations

import faulthandler
import sys

faulthandler.enable(file=sys.stderr)
