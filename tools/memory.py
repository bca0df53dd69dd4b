#!/usr/bin/env python
"""The formula estimate of a recipe's peak memory per GPU (moved to :mod:`fgrpo.models.memory_formula`;
``fgrpo memory`` measures it on fake tensors and prints this estimate beside)."""

from __future__ import annotations

import sys

from fgrpo.models.memory_formula import *  # noqa: F403
from fgrpo.models.memory_formula import main

if __name__ == "__main__":
    sys.exit(main())
