"""webdataset's ``typecheck`` module name, used as it is: importing it installs typeguard's import hook on
webdataset's modules when typeguard is installed."""

from webdataset.typecheck import modules

__all__ = ["modules"]
