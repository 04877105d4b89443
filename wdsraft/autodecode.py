"""webdataset's ``autodecode`` module, used as it is: ``wdsraft.autodecode`` *is* ``webdataset.autodecode``."""

import sys

from webdataset import autodecode as _webdataset_module

sys.modules[__name__] = _webdataset_module
