"""Moved to :mod:`hetero_plugins.horovod.lr`; this alias is kept for one release."""

import sys

from hetero_plugins.horovod import lr as _moved

sys.modules[__name__] = _moved
