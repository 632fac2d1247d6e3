"""The package version, in a module of its own so that the modules which record it (provenance, card)
import it without importing the package's __init__ (which would be an upward import)."""

__version__ = "0.1.0"
