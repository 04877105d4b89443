"""webdataset's ``utils`` module, used as it is: ``wdsraft.utils`` *is* ``webdataset.utils``."""

import sys

from webdataset import utils as _webdataset_module

sys.modules[__name__] = _webdataset_module
