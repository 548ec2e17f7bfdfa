"""omni_kernel: the torch-free core of the omni runtime."""

from omni_kernel.api import Omni
from omni_kernel.core.errors import (
                                     GraphError,
                                     InputError,
                                     InvalidParameter,
                                     ModelError,
                                     OmniError,
                                     RequestError,
                                     UserError,
)
from omni_kernel.core.events import (
                                     STOP_REASONS,
                                     TRUNCATED_STOP_REASONS,
                                     AudioDelta,
                                     RequestFailed,
                                     RequestFinished,
                                     StageFailed,
                                     StageFinished,
                                     StageProgress,
                                     StopReason,
                                     TokenDelta,
)
from omni_kernel.core.graph import EdgeSpec, NodeSpec, PipelinePlan, StageGraph
from omni_kernel.core.hookspecs import hookimpl
from omni_kernel.core.models import FetchableModel
from omni_kernel.core.params import ARParams, option
from omni_kernel.core.registry import NodeType
from omni_kernel.core.request import (
    AUDIO,
    SEGMENTS,
    VIDEO,
    Audio,
    Request,
    RequestResult,
    Segment,
    StageInput,
    StageOutput,
    StageStats,
    Structured,
    Usage,
    VideoInfo,
)
from omni_kernel.core.scheduler import RequestOutput
from omni_kernel.core.stage import Stage

__version__ = "0.1.0"

__all__ = ["ARParams", "AUDIO", "Audio", "AudioDelta", "EdgeSpec", "FetchableModel", "GraphError", "InputError",
           "InvalidParameter", "ModelError", "NodeSpec", "NodeType", "Omni", "OmniError", "PipelinePlan", "Request",
           "RequestError", "RequestFailed", "RequestFinished", "RequestOutput", "RequestResult", "SEGMENTS",
           "STOP_REASONS", "Segment", "Stage", "StageFailed", "StageFinished", "StageGraph", "StageInput",
           "StageOutput", "StageProgress", "StageStats", "StopReason", "Structured", "TRUNCATED_STOP_REASONS",
           "TokenDelta", "Usage", "UserError", "VIDEO", "VideoInfo", "hookimpl", "option"]
