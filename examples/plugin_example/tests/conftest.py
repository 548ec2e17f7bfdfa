import sys
from pathlib import Path

try:
    import omni_plugin_example  # noqa: F401 - installed (pip install ./examples/plugin_example)
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
