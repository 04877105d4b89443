"""webdataset's ``pytorch`` module, used as it is: ``wdsraft.pytorch`` *is* ``webdataset.pytorch``."""

import sys

from webdataset import pytorch as _webdataset_module

sys.modules[__name__] = _webdataset_module
