"""omni_kernel: the torch-free core of the omni runtime."""

__version__ = "0.1.0"

from .api import Omni  # noqa: E402
from .errors import (GraphError, InputError, InvalidParameter, ModelError, OmniError, RequestError,  # noqa: E402
                     UserError)
from .events import (RequestFailed, RequestFinished, StageFailed, StageFinished, StageProgress,  # noqa: E402
                     TokenDelta)
from .graph import EdgeSpec, NodeSpec, PipelinePlan, StageGraph  # noqa: E402
from .hookspecs import hookimpl  # noqa: E402
from .params import ARParams, DiffusionParams  # noqa: E402
from .registry import NodeType  # noqa: E402
from .request import Request, RequestResult, StageInput, StageOutput  # noqa: E402

__all__ = ["ARParams", "DiffusionParams", "EdgeSpec", "GraphError", "InputError", "InvalidParameter", "ModelError",
           "NodeSpec", "NodeType", "Omni", "OmniError", "PipelinePlan", "Request", "RequestError", "RequestFailed",
           "RequestFinished", "RequestResult", "StageFailed", "StageFinished", "StageGraph", "StageInput",
           "StageOutput", "StageProgress", "TokenDelta", "UserError", "hookimpl"]
