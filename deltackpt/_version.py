"""The package's version, read by the build (pyproject.toml) and written into each step's
metadata (``library_version``)."""

__version__ = "0.1.0"
