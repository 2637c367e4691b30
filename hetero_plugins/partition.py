"""Moved to :mod:`hetero_plugins.balancing.partition`; this alias is kept for one release."""

import sys

from hetero_plugins.balancing import partition as _moved

sys.modules[__name__] = _moved
