"""webdataset's ``tenbin`` module, used as it is: ``wdsraft.tenbin`` *is* ``webdataset.tenbin``."""

import sys

from webdataset import tenbin as _webdataset_module

sys.modules[__name__] = _webdataset_module
