"""Tests of omni serve: the engine loop in-process, then real server processes on loopback ports."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # serving.py, fault_plugin.py
