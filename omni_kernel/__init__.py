"""omni_kernel: the torch-free core of the omni runtime."""

from .api import Omni
from .errors import (GraphError, InputError, InvalidParameter, ModelError, OmniError, RequestError, UserError)
from .events import (STOP_REASONS, TRUNCATED_STOP_REASONS, RequestFailed, RequestFinished, StageFailed, StageFinished,
                     StageProgress, StopReason, TokenDelta)
from .graph import EdgeSpec, NodeSpec, PipelinePlan, StageGraph
from .hookspecs import hookimpl
from .params import ARParams, option
from .registry import NodeType
from .request import Request, RequestResult, StageInput, StageOutput, StageStats
from .scheduler import RequestOutput
from .stage import Stage

__version__ = "0.1.0"

__all__ = ["ARParams", "EdgeSpec", "GraphError", "InputError", "InvalidParameter", "ModelError", "NodeSpec",
           "NodeType", "Omni", "OmniError", "PipelinePlan", "Request", "RequestError", "RequestFailed",
           "RequestFinished", "RequestOutput", "RequestResult", "STOP_REASONS", "Stage", "StageFailed",
           "StageFinished", "StageGraph", "StageInput", "StageOutput", "StageProgress", "StageStats", "StopReason",
           "TRUNCATED_STOP_REASONS", "TokenDelta", "UserError", "hookimpl", "option"]
