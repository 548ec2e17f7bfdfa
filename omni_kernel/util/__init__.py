"""Utilities for plugins: output files (files.py) and the launcher of child interpreters (launch.py)."""
