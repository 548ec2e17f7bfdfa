"""What the server reads of a finished request comes from the kernel's typed fields, not from another plugin's
trace keys: OpenAI `usage` from StageOutput.usage, the structured-output metrics from StageOutput.structured, a
video's size and length from the VideoInfo in its output's data, streamed logprobs from TokenDelta.logprobs, and a
stage's model counters on /metrics from StageStats.model. No torch, no model."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from omni_kernel.core.events import TokenDelta
from omni_kernel.core.request import VIDEO, RequestResult, StageOutput, StageStats, Structured, Usage, VideoInfo
from omni_serve.logprobs import Echo, StreamedLogprobs
from omni_serve.metrics import Metrics
from omni_serve.snapshot import Snapshot, StageSnapshot
from omni_serve.text import LatencyRecorder, usage_of
from omni_serve.videos import VideoJobRecord, VideoJobs


def samples(metrics: Metrics) -> dict:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def result_of(*outputs: StageOutput, trace: dict | None = None) -> RequestResult:
    return RequestResult("r", "p", outputs[-1], {o.node_id: o for o in outputs}, trace or {})


def test_usage_adds_up_what_the_outputs_count_and_reads_no_trace_key():
    a = StageOutput("r", "a", text="x", usage=Usage(input_tokens=5, output_tokens=3, cached_tokens=2))
    b = StageOutput("r", "b", text="y", usage=Usage(input_tokens=4, output_tokens=1))
    assert usage_of(result_of(a, b)) == {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
                                         "prompt_tokens_details": {"cached_tokens": 2}}
    traced = result_of(StageOutput("r", "a", text="x"), trace={"ar.input_tokens": 7, "ar.output_tokens": 2})
    assert usage_of(traced)["total_tokens"] == 0  # a stage that counts nothing


def test_the_structured_metrics_come_from_the_output_constraint():
    metrics = Metrics(Snapshot, dict)
    out = StageOutput("r", "a", text="{}", usage=Usage(input_tokens=1, output_tokens=1),
                      structured=Structured("json_schema", 250.0))
    LatencyRecorder(metrics, "m", time.perf_counter()).done(result_of(out), "chat")
    got = samples(metrics)
    assert got[("omni_structured_requests_total", (("kind", "json_schema"), ("model", "m")))] == 1
    assert got[("omni_grammar_compile_seconds_count", (("model", "m"),))] == 1
    assert got[("omni_grammar_compile_seconds_sum", (("model", "m"),))] == 0.25


def test_a_stages_model_counters_are_exported_by_name():
    class Cached:
        kind = "diffusion"

        def stats(self) -> StageStats:
            return StageStats(running=1, model={"step_cache_hits": 3, "step_cache_misses": 5})

    snap = Snapshot(stages=(StageSnapshot.of("wan_i2v", "video", Cached()),))
    got = samples(Metrics(lambda: snap, dict))
    labels = (("model", "wan_i2v"), ("stage", "video"))
    assert got[("omni_step_cache_hits_total", labels)] == 3 and got[("omni_step_cache_misses_total", labels)] == 5


def test_a_video_jobs_size_and_length_come_from_its_video_info(tmp_path):
    jobs = VideoJobs(None, tmp_path, ttl=None)
    job = VideoJobRecord("v", "wan_i2v", 0, size=None, seconds=None, status="in_progress")
    video = StageOutput("r", "video", path=str(tmp_path / "v.mp4"),
                        data={VIDEO: VideoInfo(width=96, height=64, num_frames=9, fps=24)},
                        trace={"diffusion.width": 1, "diffusion.height": 1, "diffusion.num_frames": 1})
    jobs._completed(job, result_of(video))
    assert (job.status, job.size, job.seconds) == ("completed", "96x64", "0.375")


def test_streamed_logprobs_come_from_the_token_delta():
    entry = {"token_id": 1, "token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
    first = {"token_id": 0, "token": "<s>", "logprob": None, "bytes": [], "top_logprobs": []}
    streamed = StreamedLogprobs(Echo(echo=True, text=None, logprobs=True, prompt_only=False))
    delta = TokenDelta("r", "n", "a", logprobs=(entry,), prompt_logprobs=(first,))
    assert streamed.start(delta) == ("", {"tokens": ["<s>"], "token_logprobs": [None], "top_logprobs": [None],
                                         "text_offset": [0]})  # its text: its bytes (none)
    assert streamed.delta(delta)["tokens"] == ["a"]
    assert streamed.delta(TokenDelta("r", "n", "b"))["tokens"] == []  # a delta that carries none


def test_the_server_names_no_other_plugins_trace_key():
    """Trace keys are for users to read; what the server needs of a stage is a typed field."""
    import ast
    from pathlib import Path

    import omni_serve

    found = [f"{path.name}:{node.lineno}: {node.value!r}" for path in Path(omni_serve.__file__).parent.glob("*.py")
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and node.value.startswith(("ar.", "diffusion."))]
    assert found == []
