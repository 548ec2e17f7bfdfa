"""Entry point of the omni_wan plugin. Imports no torch: models load when a stage is built."""

from omni_kernel import hookimpl


class WanPlugin:
    pass
