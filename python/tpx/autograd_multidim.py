"""Former home of the multi-dimensional operators' autograd, now :mod:`tpx.ops.multidim`.
Kept so that the old import path still works."""

import sys

from .ops import multidim

sys.modules[__name__] = multidim
