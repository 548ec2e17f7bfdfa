"""Entry point of the omni_qwen plugin. Imports no torch: models load when a stage is built."""

from omni_kernel import hookimpl


class QwenPlugin:
    pass
