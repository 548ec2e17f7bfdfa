"""The `asr.whisper` node type's parts and the `asr` pipeline: ASRStages builds each speech-to-text engine and stage
and owns the loaded models, one per (path, dtype, device), and each directory's model-free assets (read once: a
check reads them for every request). Imports no torch: models load when an engine is built."""

from __future__ import annotations

from pathlib import Path

import attrs

from omni_kernel import NodeSpec, NodeType, PipelinePlan
from omni_kernel.core.engine import Engine
from omni_kernel.core.request import StageInput
from omni_kernel.core.stage import Stage

from .asr_config import ASRConfig, ASRParams

ASR = PipelinePlan("asr", [NodeSpec("transcribe", "asr.whisper", final=True, plugin_hint="omni-speech")],
                   description="speech to text with Whisper (default: tiny.en), 30-second windows, batched")


@attrs.frozen
class ASREngineSettings:
    """Everything a speech-to-text engine depends on (its share key): the model's (path, dtype, device) and the
    requests a step runs."""

    model: tuple
    max_batch: int


class ASRStages:
    def __init__(self):
        from omni_hf import ModelPool

        self.models = ModelPool(_load_whisper)
        self.assets = ModelPool(_read_assets)

    def engine_settings(self, node: NodeSpec, config: ASRConfig, policy) -> ASREngineSettings:
        from omni_hf import resolve_device

        path = config.asr_model
        if path is None:
            path = _default_whisper()
        if not Path(path).expanduser().is_dir():
            from omni_kernel.core.errors import InvalidParameter

            raise InvalidParameter("asr_model", f"{str(path)!r} is not a directory")
        model = (str(Path(path).expanduser().resolve()), config.asr_dtype,
                 resolve_device(config.asr_device, "asr_device"))
        return ASREngineSettings(model, config.asr_max_batch)

    def engine(self, settings: ASREngineSettings) -> Engine:
        from .asr_engine import ASRRunner, ASRScheduler, WindowLimits
        from .asr_model import WhisperForward

        assets = self.asset(settings)
        forward = WhisperForward(self.models.acquire(settings.model).model, settings.max_batch)
        return Engine(ASRScheduler(WindowLimits.of(assets), settings.max_batch), ASRRunner(forward, assets))

    def stage(self, node: NodeSpec, config: ASRConfig, policy, settings: ASREngineSettings, engine: Engine) -> Stage:
        from .asr_inputs import ASRInputs
        from .asr_outputs import ASROutputs

        assets = self.asset(settings)
        outputs = ASROutputs(node.id, assets.tokenizer, assets.eos, assets.timestamp_begin)
        return Stage(node, "asr", ASRInputs(assets), engine, outputs,
                     summary=f"asr {node.id}: {settings.model[0]}, {settings.model[2]}, up to {settings.max_batch} "
                             "requests a step")

    def check(self, node: NodeSpec, config: ASRConfig, policy, settings: ASREngineSettings, item: StageInput) -> None:
        from .asr_inputs import ASRInputs

        ASRInputs(self.asset(settings)).check(item)

    def asset(self, settings: ASREngineSettings):
        return self.assets.acquire(settings.model[0]).model

    def node_type(self) -> NodeType:
        return NodeType("asr.whisper", "asr", engine_settings=self.engine_settings, engine=self.engine,
                        stage=self.stage, check=self.check, config=ASRConfig, params=ASRParams, inputs={"audio"},
                        description="transcribes the request's audio with Whisper (a transformers "
                                    "WhisperForConditionalGeneration directory); the prompt, if any, is Whisper's "
                                    "previous-text prompt")


def _default_whisper() -> Path:
    from omni_kernel.core.errors import ModelError

    from . import weights

    path = weights.fetched(weights.WHISPER)
    if path is None:
        raise ModelError(weights.not_fetched(weights.WHISPER))
    return path


def _read_assets(path: str):
    from .asr_inputs import WhisperAssets

    return WhisperAssets.load(path)


def _load_whisper(key: tuple):
    import torch
    from omni_hf import quiet_hf_load, torch_dtype

    from .ct2_whisper import load_whisper

    path, dtype, device = key
    chosen = torch_dtype(dtype, "asr_dtype")
    if chosen is None:  # auto: fp32 on a CPU (fp16 convolutions fail there; fp32 equals generate), else the saved
        chosen = torch.float32 if device.startswith("cpu") else "auto"
    with quiet_hf_load(["transformers"]):
        return load_whisper(path, dtype=chosen, device=device)
