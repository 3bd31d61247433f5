"""``python -m tpx.selfcheck`` (see :mod:`tpx.selfcheck`)."""

import sys

from . import main

sys.exit(main())
