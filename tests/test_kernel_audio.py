"""Audio in the kernel: the request's audio input (a path or a file's bytes) reaches the entry stage that reads it,
in process and pickled; the values an audio stage returns (Audio, Segment, AudioDelta); `omni run --audio` without
`--prompt`, and `--prompt` still required where no node reads the input given. A fake "listen" node stands in
for speech to text: it reports what it heard, in one step."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

import omni_kernel
import omni_kernel.events
from omni_kernel import hookimpl
from omni_kernel.api import Omni
from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.cli import main
from omni_kernel.core.engine import Engine
from omni_kernel.core.errors import InputError, InvalidParameter
from omni_kernel.core.events import AudioDelta, RequestFinished, StageFinished
from omni_kernel.core.graph import NodeSpec, PipelinePlan
from omni_kernel.core.registry import NodeType
from omni_kernel.core.request import AUDIO, SEGMENTS, Audio, Request, Segment, StageInput, StageOutput, Usage
from omni_kernel.core.scheduler import StepScheduler
from omni_kernel.core.stage import Inputs, Outputs, Stage
from omni_kernel.plugins import PluginHost

RATE = 16_000


class ListenInputs(Inputs):
    """The audio's bytes: read from its path, or as uploaded."""

    def check(self, item: StageInput) -> None:
        if item.audio is None:
            raise InputError("no audio to listen to")

    def process(self, item: StageInput) -> StageInput:
        self.check(item)
        data = item.audio if isinstance(item.audio, bytes) else Path(item.audio).read_bytes()
        return attrs.evolve(item, processed=data)


class ListenRunner:
    def __init__(self, seen: list):
        self.seen = seen

    def add_request(self, record) -> None:
        self.seen.append(record.item)

    def run(self, batch) -> dict:
        return {job.request_id: job.item.processed for job in batch.records}

    def free(self, record) -> None:
        pass


class ListenOutputs(Outputs):
    """One AudioDelta of what it heard (as PCM), then the transcript: the bytes' count and digest."""

    def process(self, outputs) -> tuple[list, list[str]]:
        events: list = []
        for out in outputs:
            data = out.result
            audio = Audio(data[: len(data) // 2 * 2], RATE)
            text = f"heard {len(data)} bytes {hashlib.sha256(data).hexdigest()[:8]}"
            events.append(AudioDelta(out.request_id, self.node_id, audio.pcm, RATE, text=text))
            output = StageOutput(out.request_id, self.node_id, text=text,
                                 data={AUDIO: audio, SEGMENTS: (Segment(0.0, audio.seconds, text),)},
                                 usage=Usage(audio_seconds=audio.seconds), stop_reason="done")
            events.append(StageFinished(out.request_id, self.node_id, output))
        return events, []


def listen_node(seen: list) -> NodeType:
    return NodeType("test.listen", "asr", inputs={"audio"},
                    engine_settings=lambda node, config, policy: node.id,
                    engine=lambda settings: Engine(StepScheduler(max_batch=4, num_steps=lambda item: 1),
                                                   ListenRunner(seen)),
                    stage=lambda node, config, policy, settings, engine: Stage(node, "asr", ListenInputs(), engine,
                                                                               ListenOutputs(node.id)),
                    check=lambda node, config, policy, settings, item: ListenInputs().check(item))


class ListenPlugin:
    def __init__(self):
        self.seen: list[StageInput] = []

    @hookimpl
    def omni_register_node_types(self, register):
        register(listen_node(self.seen))

    @hookimpl
    def omni_register_pipelines(self, register):
        register(PipelinePlan("listen", [NodeSpec("transcribe", "test.listen", final=True)]))


@pytest.fixture
def listen():
    return ListenPlugin()


@pytest.fixture
def host(listen):
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel")
    host.register(listen, "listen")
    return host


def heard(data: bytes) -> str:
    return f"heard {len(data)} bytes {hashlib.sha256(data).hexdigest()[:8]}"


def test_audio_values_and_their_exports():
    audio = Audio(b"\x00\x01" * RATE, RATE)
    assert audio.samples == RATE and audio.seconds == 1.0
    assert "bytes>" in repr(audio) and "\\x00" not in repr(audio)
    delta = AudioDelta("r", "speak", b"\x00\x00" * 8000, RATE, text="Hi.")
    assert delta.seconds == 0.5 and "\\x00" not in repr(delta)
    assert Segment(0.0, 1.5, "hi").end == 1.5
    assert (AUDIO, SEGMENTS) == ("audio", "segments")
    assert omni_kernel.events.AudioDelta is omni_kernel.AudioDelta is AudioDelta
    assert (omni_kernel.Audio, omni_kernel.Segment, omni_kernel.AUDIO, omni_kernel.SEGMENTS) == (
        Audio, Segment, AUDIO, SEGMENTS)


def test_a_request_takes_audio_as_a_path_or_bytes(tmp_path):
    assert Request("listen", "", audio=tmp_path / "a.wav").audio == str(tmp_path / "a.wav")
    assert Request("listen", "", audio=bytearray(b"RIFF")).audio == b"RIFF"
    assert "<4 bytes>" in repr(Request("listen", "", audio=b"RIFF"))
    with pytest.raises(InvalidParameter) as caught:
        Request("listen", "", audio=3)
    assert caught.value.field == "audio"


@pytest.mark.parametrize("audio", [b"RIFF\x00\x01", "/somewhere/a.wav"])
def test_a_stage_input_with_audio_pickles(audio):
    """What crosses to a placed stage (a worker process) is the pickled StageInput: its audio goes with it."""
    item = StageInput("r", "", audio=audio, params=None, trace={"k": 1})
    again = pickle.loads(pickle.dumps(item))
    assert again == item and again.audio == audio


def test_the_entry_stage_gets_the_requests_audio(host, listen, tmp_path):
    data = bytes(range(256)) * 4
    omni = Omni("listen", host=host)
    events = list(omni.generate_stream(audio=data))
    assert [type(e) for e in events] == [AudioDelta, StageFinished, RequestFinished]
    assert events[0].pcm == data and events[0].sample_rate == RATE
    result = events[-1].result
    assert result.text == heard(data)
    assert result.output.data[AUDIO] == Audio(data, RATE)
    assert result.output.data[SEGMENTS] == (Segment(0.0, len(data) / 2 / RATE, heard(data)),)
    assert listen.seen[-1].audio == data and listen.seen[-1].prompt == ""
    path = tmp_path / "a.raw"
    path.write_bytes(data[:100])
    assert omni.generate(audio=str(path)).text == heard(data[:100])
    assert listen.seen[-1].audio == str(path)


def test_omni_run_json_prints_the_segments_with_times(host, tmp_path):
    path = tmp_path / "a.raw"
    path.write_bytes(b"\x01\x02" * 800)
    result = omni(host, "run", "--pipeline", "listen", "--audio", str(path), "--json")
    assert result.exit_code == 0, result.output
    output = json.loads(result.stdout)["output"]
    assert output == {"text": heard(b"\x01\x02" * 800),
                      "segments": [{"start": 0.0, "end": 0.05, "text": heard(b"\x01\x02" * 800)}]}


def test_a_node_that_needs_audio_refuses_a_request_without_it(host):
    with pytest.raises(InputError, match="no audio"):
        Omni("listen", host=host).generate("words only")


def test_audio_to_a_pipeline_that_reads_none_is_refused(host):
    with pytest.raises(InvalidParameter, match="pipeline 'echo' takes no input audio") as caught:
        Omni("echo", host=host).generate("hi", audio=b"RIFF")
    assert caught.value.field == "audio"


def test_omni_generate_without_a_prompt_where_the_prompt_is_read_says_it_is_empty(host):
    with pytest.raises(InputError, match="the prompt is empty"):
        Omni("echo", host=host).generate()


def omni(host, *args):
    return CliRunner().invoke(main, list(args), obj={"host": host})


def test_omni_run_audio_needs_no_prompt(host, tmp_path):
    path = tmp_path / "a.raw"
    path.write_bytes(b"\x01\x02" * 50)
    result = omni(host, "run", "--pipeline", "listen", "--audio", str(path))
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == heard(b"\x01\x02" * 50)


def test_omni_run_still_needs_a_prompt_where_no_node_reads_the_input_given(host, tmp_path):
    path = tmp_path / "a.raw"
    path.write_bytes(b"\x01\x02")
    for args in (["--pipeline", "echo"], ["--pipeline", "listen"]):
        result = omni(host, "run", *args)
        assert result.exit_code == 2 and "Missing option '--prompt'" in result.stderr, result.output
    result = omni(host, "run", "--pipeline", "echo", "--audio", str(path))
    assert result.exit_code == 2 and "Missing option '--prompt'" in result.stderr, result.output
    result = omni(host, "run", "--pipeline", "echo", "--prompt", "hi", "--audio", str(path))
    assert result.exit_code == 2
    assert result.stderr.strip() == "Error: invalid --audio: pipeline 'echo' takes no input audio"
