"""Former home of tpx's autocast support, now :mod:`tpx.ops.amp`. Kept so that the old import
path still works."""

import sys

from .ops import amp

sys.modules[__name__] = amp
