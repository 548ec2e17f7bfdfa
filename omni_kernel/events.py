"""The public events module: what `Omni.step`, `generate_stream` and `AsyncOmni` yield (defined in core.events)."""

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

__all__ = ["STOP_REASONS", "TRUNCATED_STOP_REASONS", "AudioDelta", "RequestFailed", "RequestFinished", "StageFailed",
           "StageFinished", "StageProgress", "StopReason", "TokenDelta"]
