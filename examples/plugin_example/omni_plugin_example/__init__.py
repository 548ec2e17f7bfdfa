"""An example omni plugin: the text.upper stage, the ar_to_text connector and the echo_upper pipeline."""

__version__ = "0.1.0"
