"""Entry point of the omni_bridge plugin. Imports no torch: models load when a stage is built."""

from omni_kernel import hookimpl


class BridgePlugin:
    pass
