"""omni serve: an OpenAI-compatible HTTP server for every pipeline, over one async engine loop (AsyncOmni)."""

__version__ = "0.1.0"
