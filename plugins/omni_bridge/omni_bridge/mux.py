"""The `mux.av_mp4` node type: a join of a video (an H.264 MP4 a video stage wrote) and a voice's audio into one MP4,
H.264 video and AAC audio, through the ffmpeg binary imageio-ffmpeg ships (docs/narrated.md).

The length policy, LOOP: the whole narration is heard, never cut. The video plays whole, as often as the narration
needs: ceil(narration seconds / video seconds) times, at least once; a narration shorter than the video ends before
it and the rest of the video is silent. The video's H.264 stream is copied, not encoded again (ffmpeg's
`-stream_loop` with `-c:v copy`), so every frame of the MP4 is the video stage's frame bit for bit; only the audio
is encoded.

The MP4 goes to a temporary file beside the output and replaces it only when ffmpeg succeeded (util.files.atomic_path):
a failure leaves no MP4. The video stage's file is the mux's input alone: the mux removes it once the request is
done, whether it succeeded, failed or was aborted (`release`: a request that ends while the mux still waits for its
audio).
"""

from __future__ import annotations

import math
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InvalidParameter, RequestError
from omni_kernel.core.events import StageFailed, StageFinished
from omni_kernel.core.graph import Join
from omni_kernel.core.params import option, text
from omni_kernel.core.registry import NodeType
from omni_kernel.core.request import AUDIO, VIDEO, Audio, StageInput, StageOutput, VideoInfo
from omni_kernel.core.scheduler import StepScheduler
from omni_kernel.core.stage import Inputs, Outputs, Stage
from omni_kernel.util.files import atomic_path, check_output_path

NODE_TYPE = "mux.av_mp4"
KIND = "mux"
POLICY = "loop"  # the length policy (the module docstring); written to the trace as mux.length_policy
AAC_BITRATE = "96k"
MAX_BATCH = 8  # requests muxed in one step, one ffmpeg each


@attrs.frozen
class VideoPart:
    """The video input: the MP4 the video stage wrote and what it holds."""

    path: str
    info: VideoInfo


@attrs.frozen
class Sources:
    """A request's two inputs, merged (the join's one input): the video stage's MP4 and the voice's audio."""

    video: VideoPart
    audio: Audio


@attrs.frozen
class MuxParams:
    output: str | None = option(None, help="output file (e.g. out.mp4; default: ./omni_<request id>.mp4)",
                                flag="--output", converter=lambda v: os.fspath(v) if isinstance(v, os.PathLike)
                                else v, validator=text)


@attrs.frozen
class MuxEngineSettings:
    """The mux loads nothing: every mux node of a plugin host shares one engine."""

    max_batch: int = MAX_BATCH


def output_path(params: MuxParams | None, request_id: str) -> Path:
    """The request's MP4, or InvalidParameter("output") for one that cannot be written."""
    given = None if params is None else params.output
    if given is not None and not given.strip():
        raise InvalidParameter("output", f"is empty; name a file such as out.mp4, or leave it out for "
                                         f"omni_{request_id}.mp4")
    path = Path(given or f"omni_{request_id}.mp4").expanduser()
    if path.suffix.lower() != ".mp4":
        raise InvalidParameter("output", f"{str(path)!r} must end in .mp4 (the narrated video is an MP4)")
    return check_output_path(path, "output")


def loops_for(video: VideoInfo, audio: Audio) -> int:
    """How often the video plays so that the whole narration is heard: at least once."""
    if video.seconds <= 0:
        raise RequestError("the video has no frames to show the narration with")
    return max(1, math.ceil(round(audio.seconds / video.seconds, 9)))


def merge(inputs: Mapping[str, StageInput], request) -> StageInput:
    """The join's merge step: the video and the audio, as the mux's input (their connectors' traces kept)."""
    video, audio = inputs["video"], inputs["audio"]
    trace = {**video.trace, **audio.trace}
    return StageInput(request.request_id, "", trace=trace, processed=Sources(video.processed, audio.processed))


def release(inputs: Mapping[str, StageInput], request) -> None:
    """A request that ended before both inputs came: the video stage's MP4, if it came, is removed."""
    video = inputs.get("video")
    if video is not None:
        Path(video.processed.path).unlink(missing_ok=True)


class MuxInputs(Inputs):
    """Checks the output path at submit; the merged sources are the processed input, with the output path added."""

    def check(self, item: StageInput) -> None:
        output_path(item.params, item.request_id)

    def process(self, item: StageInput) -> StageInput:
        return attrs.evolve(item, processed=(item.processed, output_path(item.params, item.request_id)))


@attrs.frozen
class Muxed:
    """One request's result: the MP4 written and how."""

    path: Path
    loops: int
    elapsed_ms: float


class MuxRunner:
    """One step muxes each request of the step (one ffmpeg each); the video stage's MP4 is removed after it, and when
    the engine frees a request that never got there (aborted)."""

    def add_request(self, record) -> None:
        pass

    def run(self, batch) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for record in batch.records:
            sources, path = record.item.processed
            start = time.perf_counter()
            try:
                loops = write_mp4(sources, path)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                out[record.request_id] = exc
                continue
            finally:
                Path(sources.video.path).unlink(missing_ok=True)
            out[record.request_id] = Muxed(path, loops, round((time.perf_counter() - start) * 1000, 3))
        return out

    def free(self, record) -> None:
        sources, _ = record.item.processed
        Path(sources.video.path).unlink(missing_ok=True)


def write_mp4(sources: Sources, path: Path) -> int:
    """The MP4 at `path`: the video's H.264 stream copied, looped (loops_for), and the audio as AAC. Returns the
    loops."""
    loops = loops_for(sources.video.info, sources.audio)
    with atomic_path(path, suffix=".tmp.mp4") as tmp:
        _ffmpeg(sources, loops, tmp, path)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # a full or failing disk shows up here, not after the rename
        finally:
            os.close(fd)
    return loops


def _ffmpeg(sources: Sources, loops: int, out: Path, target: Path) -> None:
    import imageio_ffmpeg

    audio = sources.audio
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-hide_banner", "-v", "error",
           "-stream_loop", str(loops - 1), "-i", sources.video.path,
           "-f", "s16le", "-ar", str(audio.sample_rate), "-ac", "1", "-i", "pipe:0",
           "-map", "0:v:0", "-map", "1:a:0", "-c:v", "copy", "-c:a", "aac", "-b:a", AAC_BITRATE,
           "-movflags", "+faststart", "-f", "mp4", str(out)]  # `out` may have no extension
    with tempfile.TemporaryFile() as errors:
        # its own session: a terminal's Ctrl-C reaches omni, which stops ffmpeg and removes the file
        proc = subprocess.run(cmd, input=audio.pcm, stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True)
        errors.seek(0)
        message = errors.read().decode("utf-8", "replace").strip()
    if proc.returncode != 0:
        last = message.splitlines()[-1] if message else f"exit status {proc.returncode}"
        raise RequestError(f"cannot write {target}: ffmpeg failed ({last})")


class MuxOutputs(Outputs):
    """The MP4's StageOutput: its path, the video as written (VideoInfo: every loop's frames), the narration's Audio
    and the mux.* trace."""

    def process(self, outputs) -> tuple[list, list[str]]:
        events: list = []
        for out in outputs:
            error = out.result if isinstance(out.result, Exception) else out.error
            if error is not None:
                events.append(StageFailed.of(out.request_id, self.node_id, error))
            elif out.finished is not None:
                events.append(StageFinished(out.request_id, self.node_id, self.finish(out)))
        return events, []

    def finish(self, out) -> StageOutput:
        sources, _ = out.item.processed
        muxed: Muxed = out.result
        video, audio = sources.video.info, sources.audio
        info = VideoInfo(video.width, video.height, video.num_frames * muxed.loops, video.fps)
        trace = {"mux.output": str(muxed.path), "mux.length_policy": POLICY, "mux.loops": muxed.loops,
                 "mux.video_seconds": round(video.seconds, 3), "mux.narration_seconds": round(audio.seconds, 3),
                 "mux.seconds": round(info.seconds, 3), "mux.elapsed_ms": muxed.elapsed_ms}
        return StageOutput(out.request_id, self.node_id, path=str(muxed.path), data={VIDEO: info, AUDIO: audio},
                           contract="video/mp4", stop_reason="done", trace=trace)


def engine_settings(node, config, policy) -> MuxEngineSettings:
    return MuxEngineSettings()


def engine(settings: MuxEngineSettings) -> Engine:
    return Engine(StepScheduler(max_batch=settings.max_batch, num_steps=lambda item: 1), MuxRunner())


def stage(node, config, policy, settings: MuxEngineSettings, engine: Engine) -> Stage:
    return Stage(node, KIND, MuxInputs(), engine, MuxOutputs(node.id), summary=f"mux {node.id}: video + narration "
                 f"-> H.264/AAC MP4 (ffmpeg), length policy {POLICY}")


def check(node, config, policy, settings, item: StageInput) -> None:
    MuxInputs().check(item)


MUX = NodeType(NODE_TYPE, KIND, engine_settings=engine_settings, engine=engine, stage=stage, check=check,
               params=MuxParams, join=Join(("video", "audio"), merge, release),
               description="joins a video stage's MP4 and a voice's audio into one MP4 (H.264 copied, AAC); the "
                           "video loops whole until the narration has ended")
