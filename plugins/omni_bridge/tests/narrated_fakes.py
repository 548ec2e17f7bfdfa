"""Fake video and voice stages under the real node names (diffusion.wan22_i2v, tts.vits), for the narrated pipelines'
routing, failures and clean-up without the models: the video stage writes a real small H.264 MP4 (ffmpeg's test
pattern) at its `output`, the voice makes a tone of 0.2 s a word, one word a step. The mux is the real one.

What a prompt or narration holds picks a failure: a prompt with "BREAK" fails the video stage at its step; a
narration with "stumble" fails the voice at its third word, after the one-step video has finished.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import Future
from pathlib import Path

import attrs
import numpy as np

from omni_bridge.plugin import BridgePlugin
from omni_kernel import NodeType, StageOutput, hookimpl, option
from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InvalidParameter, RequestError
from omni_kernel.core.params import integer
from omni_kernel.core.request import AUDIO, VIDEO, Audio, VideoInfo
from omni_kernel.core.scheduler import StepScheduler
from omni_kernel.core.stage import Inputs, Outputs, Stage
from omni_kernel.events import StageFinished
from omni_kernel.plugins import PluginHost

from bridge_fakes import FakeModels, FakeWanConfig, FakeWanPolicy

SAMPLE_RATE = 16000
WORD_SECONDS = 0.2
VIDEO_INFO = VideoInfo(64, 64, 9, 24.0)  # what the fake video stage writes: 0.375 s
VOICES = ("anna", "ben")


@attrs.frozen
class VideoParams:
    seed: int | None = option(None, help="random seed", type=int, flag="--seed", validator=integer(0))
    output: str | None = option(None, help="output file", flag="--output")


@attrs.frozen
class VoiceParams:
    voice: str | None = option(None, help="the voice", flag="--voice")
    seed: int | None = option(None, help="random seed", type=int, flag="--seed", validator=integer(0))
    output: str | None = option(None, help="output file", flag="--output")
    response_format: str | None = option(None, help="audio format")


def write_test_video(path: str | Path, info: VideoInfo = VIDEO_INFO) -> None:
    import imageio_ffmpeg

    subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-v", "error", "-f", "lavfi", "-i",
                    f"testsrc=size={info.width}x{info.height}:rate={info.fps:g}", "-frames:v", str(info.num_frames),
                    "-c:v", "libx264", "-pix_fmt", "yuv420p", "-f", "mp4", str(path)], check=True)


def failed(error: Exception) -> Future:
    """A step's result that fails its request alone (the scheduler collects it as that request's error)."""
    future: Future = Future()
    future.set_exception(error)
    return future


def tone(seconds: float) -> Audio:
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return Audio((np.sin(2 * np.pi * 440 * t) * 8000).astype("<i2").tobytes(), SAMPLE_RATE)


class VideoRunner:
    """One step: the MP4 at the request's output, or the failure its prompt asks for."""

    def add_request(self, record):
        pass

    def run(self, batch):
        results = {}
        for job in batch.records:
            if "BREAK" in job.item.prompt:
                results[job.request_id] = failed(RequestError("the video stage broke"))
                continue
            write_test_video(job.item.params.output)
            results[job.request_id] = job.item.params.output
        return results

    def free(self, record):
        pass


class VideoOutputs(Outputs):
    def process(self, outputs):
        events, _ = super().process([o for o in outputs if o.error is not None])
        for out in (o for o in outputs if o.error is None and o.finished is not None):
            events.append(StageFinished(out.request_id, self.node_id, StageOutput(
                out.request_id, self.node_id, path=out.result, data={VIDEO: VIDEO_INFO}, contract="video/mp4")))
        return events, []


class VoiceInputs(Inputs):
    def check(self, item):
        params = item.params or VoiceParams()
        if params.voice is not None and params.voice not in VOICES:
            raise InvalidParameter("voice", f"{params.voice!r} is not a voice of this model")
        if params.output is not None or params.response_format is not None:
            raise AssertionError("the narrated plan withholds the voice's file")


@attrs.define
class VoiceRunner:
    """One word a step; `said` keeps every text it was given."""

    said: dict = attrs.Factory(dict)

    def add_request(self, record):
        self.said[record.request_id] = record.item.prompt

    def run(self, batch):
        results = {}
        for job, step in zip(batch.records, batch.steps):
            stumbled = "stumble" in job.item.prompt and step == 2
            results[job.request_id] = failed(RequestError("the voice stumbled")) if stumbled else step
        return results

    def free(self, record):
        pass


class VoiceOutputs(Outputs):
    def process(self, outputs):
        events, _ = super().process([o for o in outputs if o.error is not None])
        for out in (o for o in outputs if o.error is None and o.finished is not None):
            audio = tone(WORD_SECONDS * len(out.item.prompt.split()))
            events.append(StageFinished(out.request_id, self.node_id, StageOutput(
                out.request_id, self.node_id, data={AUDIO: audio})))
        return events, []


@attrs.frozen
class Settings:
    name: str


class FakeAV:
    """Registers the fake video and voice node types; `voice` is the voice runner, kept for the tests to look at."""

    def __init__(self):
        self.voice = VoiceRunner()

    @hookimpl
    def omni_register_node_types(self, register):
        register(NodeType("diffusion.wan22_i2v", "diffusion", engine_settings=lambda n, c, p: Settings("video"),
                          engine=lambda s: Engine(StepScheduler(max_batch=4, num_steps=lambda item: 1),
                                                  VideoRunner()),
                          stage=lambda node, c, p, s, engine: Stage(node, "diffusion", None, engine,
                                                                    VideoOutputs(node.id)),
                          config=FakeWanConfig, params=VideoParams, policy=FakeWanPolicy, inputs={"image"}))
        register(NodeType("tts.vits", "tts", engine_settings=lambda n, c, p: Settings("voice"),
                          engine=lambda s: Engine(StepScheduler(max_batch=4,
                                                                num_steps=lambda item: len(item.prompt.split())),
                                                  self.voice),
                          stage=lambda node, c, p, s, engine: Stage(node, "tts", VoiceInputs(), engine,
                                                                    VoiceOutputs(node.id)),
                          check=lambda node, c, p, s, item: VoiceInputs().check(item), params=VoiceParams))


def narrated_host() -> tuple[PluginHost, FakeAV]:
    host, av = PluginHost(), FakeAV()
    host.register(BridgePlugin(), "omni_bridge")
    host.register(FakeModels(only=("ar.prompt_bridge",)), "fake_ar")
    host.register(av, "fake_av")
    return host, av
