"""Moved to :mod:`hetero_plugins.balancing.planner`; this alias is kept for one release."""

import sys

from hetero_plugins.balancing import planner as _moved

sys.modules[__name__] = _moved
