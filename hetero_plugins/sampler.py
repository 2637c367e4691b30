"""Moved to :mod:`hetero_plugins.balancing.sampler`; this alias is kept for one release."""

import sys

from hetero_plugins.balancing import sampler as _moved

sys.modules[__name__] = _moved
