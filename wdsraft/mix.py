"""webdataset's ``mix`` module, used as it is: ``wdsraft.mix`` *is* ``webdataset.mix``."""

import sys

from webdataset import mix as _webdataset_module

sys.modules[__name__] = _webdataset_module
