"""The distribution's version: read by ``setup.py`` (without importing) and re-exported as ``replicator.__version__``."""

__version__ = "0.1.0"
