"""Moved to :mod:`hetero_plugins.balancing.time_model`; this alias is kept for one release."""

import sys

from hetero_plugins.balancing import time_model as _moved

sys.modules[__name__] = _moved
