"""Former home of the layout-change Functions: :mod:`tpx.mappings` (the operators' own autograd
now sits beside each operator in :mod:`tpx.ops`). Kept so that ``tpx.autograd.gather_dim``
and its siblings still import."""

import sys

from . import mappings

sys.modules[__name__] = mappings
