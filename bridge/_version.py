"""The package's version, its one source: pyproject.toml reads it (setuptools' dynamic version)."""

__version__ = "0.2.0.dev0"
