"""Moved to :mod:`hetero_plugins.scheduler.sim`; this alias is kept for one release."""

import sys

from hetero_plugins.scheduler import sim as _moved

sys.modules[__name__] = _moved
