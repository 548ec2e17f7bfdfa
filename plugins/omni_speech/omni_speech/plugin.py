"""Entry point of the omni_speech plugin: its node types, pipelines and models. Imports no torch: models load when
an engine is built."""

from __future__ import annotations

from pathlib import Path

from omni_kernel import EdgeSpec, NodeSpec, NodeType, PipelinePlan, hookimpl
from omni_kernel.core.engine import Engine
from omni_kernel.core.request import StageInput
from omni_kernel.core.stage import Stage

from .asr_stages import ASR, ASRStages
from .text_stream import TEXT_TO_SPEECH
from .tts_config import TTSConfig, TTSParams
from .tts_engine import TTSEngineSettings, TTSInputs, TTSOutputs, build_engine
from .voice_chat import TRANSCRIPT_TO_PROMPT, VOICE_CHAT

TTS = PipelinePlan("tts", [NodeSpec("speak", "tts.vits", final=True, plugin_hint="omni-speech")],
                   description="text to speech with a VITS voice (default: the Piper voice joe), sentence by sentence")
# The AR node is omni_qwen's, named by its type alone (graph validation says to install omni-qwen where it is not).
AR_SPEECH = PipelinePlan(
    "ar_speech", [NodeSpec("answer", "ar.text_generation", final=True, plugin_hint="omni-qwen"),
                  NodeSpec("speak", "tts.vits", final=True, plugin_hint="omni-speech")],
    [EdgeSpec("answer", "speak", TEXT_TO_SPEECH.name, stream=True)],
    description="a spoken answer: the AR stage answers and the voice speaks it sentence by sentence while it is "
                "written; outputs: the text and the audio (--output names the audio file)")


class TTSStages:
    """Builds each TTS engine and stage; owns the loaded voices, one per (path, dtype, device), and each directory's
    voice front end (read once: a check reads it for every request)."""

    def __init__(self):
        from omni_hf import ModelPool

        self.models = ModelPool(_load_voice)
        self.voices = ModelPool(_read_voice)

    def engine_settings(self, node: NodeSpec, config: TTSConfig, policy) -> TTSEngineSettings:
        from omni_hf import resolve_device

        path = config.tts_model
        if path is None:
            path = _default_voice()
        device = resolve_device(config.tts_device, "tts_device")
        model = (str(Path(path).expanduser().resolve()), config.tts_dtype, device)
        batch_decoder = device.startswith("cuda") if config.tts_batch_decoder is None else config.tts_batch_decoder
        return TTSEngineSettings(model, config.tts_max_batch, batch_decoder)

    def engine(self, settings: TTSEngineSettings) -> Engine:
        return build_engine(self.models.acquire(settings.model).model, settings)

    def stage(self, node: NodeSpec, config: TTSConfig, policy, settings: TTSEngineSettings, engine: Engine) -> Stage:
        voice = self.voice(settings)
        return Stage(node, "tts", TTSInputs(voice), engine, TTSOutputs(node.id, voice.sample_rate),
                     summary=f"tts {node.id}: voice {voice.name} ({settings.model[0]}), {settings.model[2]}, "
                             f"up to {settings.max_batch} sentences a step"
                             f"{'' if settings.batch_decoder else ' (decoder row by row)'}")

    def check(self, node: NodeSpec, config: TTSConfig, policy, settings: TTSEngineSettings, item: StageInput) -> None:
        TTSInputs(self.voice(settings)).check(item)

    def choices(self, node: NodeSpec, config: TTSConfig, policy, settings: TTSEngineSettings) -> dict:
        """The voices the built model has (the default first), for what lists them (omni serve's voices)."""
        return {"voice": self.voice(settings).names}

    def voice(self, settings: TTSEngineSettings):
        return self.voices.acquire(settings.model[0]).model


def _default_voice() -> Path:
    from omni_kernel.core.errors import ModelError

    from . import weights

    path = weights.fetched(weights.VOICE)
    if path is None:
        raise ModelError(weights.not_fetched(weights.VOICE))
    return path


def _read_voice(path: str):
    from .tts_voice import Voice

    return Voice.read(path)


def _load_voice(key: tuple):
    import torch
    from omni_hf import quiet_hf_load, torch_dtype

    from .vits_decoder import load_voice

    path, dtype, device = key
    with quiet_hf_load(["transformers"]):
        return load_voice(path, dtype=torch_dtype(dtype, "tts_dtype") or torch.float32, device=device)


class SpeechPlugin:
    def __init__(self):
        self.tts = TTSStages()
        self.asr = ASRStages()

    @hookimpl
    def omni_register_node_types(self, register):
        tts = self.tts
        register(NodeType("tts.vits", "tts", engine_settings=tts.engine_settings, engine=tts.engine, stage=tts.stage,
                          check=tts.check, choices=tts.choices, config=TTSConfig, params=TTSParams,
                          stream_input=True,
                          description="speaks the prompt with a VITS voice (a transformers VitsModel directory), "
                                      "sentence by sentence, as 16-bit mono PCM; writes --output in its format"))
        register(self.asr.node_type())

    @hookimpl
    def omni_register_connectors(self, register):
        register(TEXT_TO_SPEECH)
        register(TRANSCRIPT_TO_PROMPT)

    @hookimpl
    def omni_register_pipelines(self, register):
        register(TTS)
        register(ASR)
        register(AR_SPEECH)
        register(VOICE_CHAT)

    @hookimpl
    def omni_register_models(self, register):
        from .weights import register_models

        register_models(register)

