"""webdataset's ``extradatasets`` module, used as it is: ``wdsraft.extradatasets`` *is* ``webdataset.extradatasets``."""

import sys

from webdataset import extradatasets as _webdataset_module

sys.modules[__name__] = _webdataset_module
