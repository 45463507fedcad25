"""The package version, in a leaf module so that submodules can record it without importing the package root."""

__version__ = "0.1.0"
