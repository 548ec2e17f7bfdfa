"""omni_wan plugin."""

__version__ = "0.1.0"
