"""kvforge's version, below every layer: a module the package imports (kvforge.LLM's MODEL resolver, the engine
cache's keys) reads it here, not from the package itself, so importing it never makes an import cycle."""

__version__ = "0.2.0"
