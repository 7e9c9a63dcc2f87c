# A package, so that this directory's conftest.py does not replace tests/conftest.py as the
# module "conftest" that the other test modules import from.
