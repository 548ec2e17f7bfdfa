"""omni-hf: the model-loading hygiene omni's torch plugins share (omni_qwen, omni_wan). Torch-free at import."""

from .loading import (
                      DTYPE_NAMES,
                      DTYPES,
                      Loaded,
                      ModelPool,
                      quiet_hf_load,
                      refuse_unpickling,
                      resolve_device,
                      torch_dtype,
)

__all__ = ["DTYPES", "DTYPE_NAMES", "Loaded", "ModelPool", "quiet_hf_load", "refuse_unpickling", "resolve_device",
           "torch_dtype"]
