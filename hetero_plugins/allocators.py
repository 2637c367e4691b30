"""Moved to :mod:`hetero_plugins.balancing.allocators`; this alias is kept for one release."""

import sys

from hetero_plugins.balancing import allocators as _moved

sys.modules[__name__] = _moved
