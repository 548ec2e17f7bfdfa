"""Utilities for plugins (output files), over the request path only."""
