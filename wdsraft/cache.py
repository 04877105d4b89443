"""webdataset's ``cache`` module, used as it is: ``wdsraft.cache`` *is* ``webdataset.cache``."""

import sys

from webdataset import cache as _webdataset_module

sys.modules[__name__] = _webdataset_module
