"""The package version, read by provenance without importing the package face."""

__version__ = "0.1.0"
