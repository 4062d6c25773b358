"""The package's version, in one place (pyproject.toml reads it; prompt-cache keys include it)."""

__version__ = "0.1.0"
