"""omni_qwen plugin."""

__version__ = "0.1.0"
