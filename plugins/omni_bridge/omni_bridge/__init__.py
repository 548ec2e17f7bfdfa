"""omni_bridge plugin: the AR->diffusion connector, the qwen_to_wan and narrated pipelines and the audio/video mux."""

__version__ = "0.1.0"

from .connector import ARToDiffusionConnector, merge_prompt  # noqa: E402
from .guidance import FALLBACK_REASONS, Guidance, parse_guidance  # noqa: E402
from .pipeline import QWEN_TO_WAN_I2V  # noqa: E402

__all__ = ["ARToDiffusionConnector", "FALLBACK_REASONS", "Guidance", "QWEN_TO_WAN_I2V", "merge_prompt",
           "parse_guidance"]
