"""qwen_to_wan_i2v end to end on both tiny demo checkpoints (real Qwen2 and Wan2.2 classes, random weights).

Three ways in: the installed `omni` script in a subprocess, the Python API in this process, and the scripts
in examples/. The demo checkpoints are built on first use under the session tmp OMNI_CACHE_DIR. Subprocess
starts cost ~5 s each (torch, transformers, diffusers imports), so one `omni run` serves many assertions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from omni_bridge import FALLBACK_REASONS, merge_prompt
from omni_bridge.guidance import ANSWER_PREFIX
from omni_kernel.cli import main

ROOT = Path(__file__).resolve().parents[3]
IMAGE = ROOT / "examples" / "assets" / "image.png"
OMNI = Path(sys.executable).parent / "omni"
PROMPT = "a red fox trotting through fresh snow"
SMOKE = {"num_frames": 9, "height": 128, "width": 128}
BRIDGE_FIELDS = ("diffusion.bridge", "diffusion.source_node", "diffusion.source_request_id",
                 "diffusion.bridge_strategy", "diffusion.bridge_parse_success", "diffusion.bridge_fallback",
                 "diffusion.bridge_constrained",
                 "diffusion.bridge_fallback_reason", "diffusion.ar_guidance_prompt", "diffusion.prompt")
AR_FIELDS = ("ar.input_tokens", "ar.output_tokens", "ar.ttft_ms", "ar.stop_reason", "ar.kv_cache_backend",
             "ar.prompt_mode", "ar.streaming", "ar.token_budget")


@pytest.fixture(scope="module")
def cache(omni_cache):
    """The session tmp OMNI_CACHE_DIR of the kernel's pytest plugin (omni_kernel.testing): never the user's."""
    return omni_cache


def run(args: list[str], cache: Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMNI_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, encoding="utf-8", timeout=300)


def read_video(path: Path):
    import imageio.v3 as iio

    return iio.imread(path)


def parse_trace(text: str) -> dict:
    """The `key  value` lines that omni_kernel.core.trace.format_trace prints (values are JSON)."""
    lines = (re.fullmatch(r"((?:ar|diffusion|request|node)\.[a-z0-9_.]+) {2,}(.+)", line)
             for line in text.splitlines())
    return {m[1]: json.loads(m[2]) for m in lines if m}


def assert_bridge_trace(trace: dict, prompt: str) -> None:
    missing = [k for k in AR_FIELDS + BRIDGE_FIELDS if k not in trace]
    assert not missing, missing
    assert trace["diffusion.bridge"] == "ar_to_diffusion"
    assert trace["diffusion.source_node"] == "bridge"
    assert trace["diffusion.source_request_id"] == trace["request.id"]
    assert trace["diffusion.bridge_strategy"] == "append"
    assert trace["diffusion.bridge_fallback"] is (not trace["diffusion.bridge_parse_success"])
    assert trace["diffusion.prompt"].startswith(prompt)
    if trace["diffusion.bridge_fallback"]:
        assert trace["diffusion.bridge_fallback_reason"] in FALLBACK_REASONS
        assert trace["diffusion.ar_guidance_prompt"] is None and trace["diffusion.prompt"] == prompt
    else:
        assert trace["diffusion.bridge_fallback_reason"] is None
        assert trace["diffusion.prompt"] == merge_prompt(prompt, trace["diffusion.ar_guidance_prompt"])


# ---- the installed `omni` script ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_run(cache, tmp_path_factory):
    """One `omni run --stream` on the demo checkpoints (it also builds them into the module cache)."""
    out = tmp_path_factory.mktemp("cli")
    video, trace = out / "videos" / "fox.mp4", out / "trace.json"
    proc = run([str(OMNI), "run", "--pipeline", "qwen_to_wan_i2v", "--image", str(IMAGE), "--prompt", PROMPT,
                "--output", str(video), "--trace-json", str(trace), "--stream", "--seed", "0"], cache)
    return proc, video, trace


@pytest.mark.cli_subprocess
def test_omni_run_writes_the_mp4_and_a_trace_with_the_bridge_fields(cli_run):
    proc, video, trace_path = cli_run
    assert proc.returncode == 0, proc.stderr
    frames = read_video(video)
    assert frames.shape == (SMOKE["num_frames"], SMOKE["height"], SMOKE["width"], 3)
    trace = json.loads(trace_path.read_text(encoding="utf-8"))
    assert_bridge_trace(trace, PROMPT)
    assert trace["ar.prompt_mode"] == "bridge_chat_template" and trace["ar.streaming"] is True
    assert trace["ar.kv_cache_backend"] and trace["ar.output_tokens"] >= 1
    assert {k: trace[f"diffusion.{k}"] for k in SMOKE} == SMOKE and trace["diffusion.preset"] == "smoke"
    assert trace["diffusion.output"] == str(video)
    assert parse_trace(proc.stderr) == trace  # the trace printed on stderr is the one written as JSON


@pytest.mark.cli_subprocess
def test_stream_prints_the_ar_text_on_stderr_and_only_the_video_path_on_stdout(cli_run, omni):
    """The AR node is not final: its deltas go to stderr, whole and on their own line(s), after the Wan model's
    load line (every stage loads its model when the graph is built) and before the Wan stage's first step. The
    final (video) node streams nothing, so stdout is the path alone. The expected text
    comes from the same greedy request through the Python API."""
    proc, video, _ = cli_run
    assert proc.stdout == f"wrote {video}\n"
    text = omni.generate(PROMPT, image=str(IMAGE), output=str(video.parent / "again.mp4")).outputs["bridge"].text
    assert text
    start = proc.stderr.index(text)
    assert proc.stderr[start - 1] == "\n" and proc.stderr[start + len(text)] == "\n"
    assert proc.stderr.index("omni: loading Wan2.2") < start < proc.stderr.index("omni: video: batching up to")


def test_bad_image_is_one_line_exit_2_and_no_file(cache, omni, tmp_path):
    """Refused by the Wan stage's check before the request runs (the models load when the graph is built);
    --ar-model / --model name the demo dirs so no
    demo notice joins the error line."""
    from omni_qwen.demo import demo_dir as qwen_dir
    from omni_wan.demo import demo_dir as wan_dir

    (tmp_path / "fox.png").write_text("not an image")
    out = tmp_path / "out" / "fox.mp4"
    result = CliRunner().invoke(main, ["run", "--pipeline", "qwen_to_wan_i2v", "--prompt", PROMPT,
                                       "--image", str(tmp_path / "fox.png"), "--output", str(out),
                                       "--ar-model", str(qwen_dir()), "--model", str(wan_dir())])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("omni: loading Wan2.2 from")]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "is not an image" in lines[0], result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    assert not out.exists() and not out.parent.exists()


# ---- the Python API, with good JSON from the AR stage ------------------------------------------------------

@pytest.fixture(scope="module")
def omni(cache):
    import torch

    from omni_kernel import Omni

    torch.set_num_threads(1)  # the same thread count as the subprocesses, so greedy tokens agree with them
    return Omni("qwen_to_wan_i2v", device="cpu")


def test_the_image_is_decoded_once_with_the_wan_node_downstream(omni, tmp_path, monkeypatch):
    """At submit the Wan node only checks the image's header; its pixels are decoded once, at the hand-off."""
    from PIL import ImageFile

    from omni_kernel import RequestFinished

    decodes = []
    real = ImageFile.ImageFile.load

    def counting(self):
        if self.tile:  # pixels still to read: a real decode, not a no-op re-load
            decodes.append(self.filename)
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting)
    rid = omni.submit(omni.request(PROMPT, image=str(IMAGE), max_tokens=4, output=str(tmp_path / "once.mp4")))
    assert decodes == []
    finished = []
    while omni.has_unfinished():
        finished += [e for e in omni.step() if isinstance(e, RequestFinished)]
    assert [e.request_id for e in finished] == [rid] and decodes == [str(IMAGE)]


GOOD_REPLY = '{"guidance": "slow dolly-in,  soft lumière at dawn"}'  # within the bridge's guidance schema


def test_python_api_merges_good_json_through_the_real_stages(omni, tmp_path, monkeypatch):
    """The demo Qwen writes noise, so its reply is forced: `Sampler.sample` is replaced to return, one per
    step, the demo tokenizer's ids of GOOD_REPLY after the answer prefix the node wrote for the model
    (`{"guidance": "`). Everything else is real: the Qwen2 model still runs prefill and every decode step, the
    guidance schema's grammar accepts each token, the executor detokenizes, streams and stops where the grammar is
    complete, the connector
    parses and merges, and the Wan2.2 stage encodes the merged prompt and writes the MP4."""
    from transformers import AutoTokenizer

    from omni_kernel import RequestFinished, TokenDelta
    from omni_qwen import sampling
    from omni_qwen.demo import demo_dir

    tokenizer = AutoTokenizer.from_pretrained(demo_dir())
    continuation = GOOD_REPLY.removeprefix(ANSWER_PREFIX)
    script = tokenizer.encode(continuation)
    assert tokenizer.decode(script, clean_up_tokenization_spaces=False) == continuation

    tokens = iter(script)

    def forced(self, logits, rows):
        return [next(tokens) for _ in rows]

    monkeypatch.setattr(sampling.Sampler, "sample", forced)
    video = tmp_path / "fox.mp4"
    events = list(omni.generate_stream(PROMPT, image=str(IMAGE), output=str(video), return_frames=True))
    result = events[-1].result
    assert isinstance(events[-1], RequestFinished)

    bridge = result.outputs["bridge"]
    assert bridge.text == GOOD_REPLY and bridge.stop_reason == "stop" and bridge.contract == "supplemental_guidance"
    assert "".join(e.text for e in events if isinstance(e, TokenDelta) and e.node_id == "bridge") == GOOD_REPLY
    trace = result.trace
    assert_bridge_trace(trace, PROMPT)
    guidance = "slow dolly-in, soft lumière at dawn"
    assert trace["diffusion.bridge_parse_success"] is True and trace["diffusion.ar_guidance_prompt"] == guidance
    merged = f"{PROMPT}\n\nSupplemental guidance: {guidance}"
    assert trace["diffusion.prompt"] == merged
    assert result.outputs["video"].trace["diffusion.prompt"] == merged  # what the Wan stage itself encoded
    assert trace["ar.stop_reason"] == "stop" and trace["ar.output_tokens"] == len(script)
    assert trace["diffusion.bridge_constrained"] is True and trace["ar.structured_output"] == "json_schema"
    assert result.path == str(video) and video.is_file()
    assert result.output.data["frames"].shape == (9, 128, 128, 3)


# ---- qwen_to_wan_t2v: the same graph, Wan's text-to-video half -------------------------------------------------

def test_qwen_to_wan_t2v_renders_from_the_merged_prompt_and_refuses_an_image(omni, tmp_path):
    """On the same plugin host as the i2v fixture (both models already loaded). An image is refused by the Wan
    node's check at submit, before the AR stage runs."""
    from omni_kernel import InvalidParameter, Omni

    t2v = Omni("qwen_to_wan_t2v", host=omni.host, device="cpu")
    with pytest.raises(InvalidParameter, match="takes no image") as info:
        t2v.submit(t2v.request(PROMPT, image=str(IMAGE), max_tokens=4, output=str(tmp_path / "no.mp4")))
    assert info.value.field == "image" and not t2v.has_unfinished()
    result = t2v.generate(PROMPT, max_tokens=4, num_inference_steps=2, output=str(tmp_path / "t2v.mp4"),
                          return_frames=True)
    assert_bridge_trace(result.trace, PROMPT)
    assert result.trace["diffusion.task"] == "text_to_video" and result.trace["diffusion.image_cache"] == "none"
    assert result.output.data["frames"].shape == (9, 128, 128, 3) and (tmp_path / "t2v.mp4").is_file()
    assert not (tmp_path / "no.mp4").exists()


# ---- examples/ -------------------------------------------------------------------------------------------------

EXAMPLES = ["ar_text_stream", "wan_i2v", "qwen_to_wan_i2v"]
# One interpreter runs every example script (as `python script.py` would, via runpy), so the suite pays for
# importing torch, transformers and diffusers once; each script's output goes to its own file.
RUN_EXAMPLES = """
import contextlib, runpy, sys
for name, out in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = [name]
    with open(out, "w", encoding="utf-8") as f, contextlib.redirect_stdout(f):
        try:
            runpy.run_path(name, run_name="__main__")
        except SystemExit as exit:
            assert not exit.code, (name, exit.code)
"""


@pytest.fixture(scope="module")
def example_runs(cache, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """Run from another directory: defaults (image, models) must not depend on the working directory."""
    cwd = tmp_path_factory.mktemp("examples")
    args = [a for script in EXAMPLES for a in (str(ROOT / "examples" / f"{script}.py"), str(cwd / f"{script}.txt"))]
    proc = run([sys.executable, "-c", RUN_EXAMPLES, *args], cache, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return cwd, {script: (cwd / f"{script}.txt").read_text(encoding="utf-8") for script in EXAMPLES}


@pytest.mark.cli_subprocess
@pytest.mark.parametrize("script", EXAMPLES)
def test_example_runs_with_no_arguments(script, example_runs):
    tmp_path, outputs = example_runs
    stdout = outputs[script]
    trace = parse_trace(stdout)
    assert trace["request.pipeline"] == script.removesuffix("_stream")
    if script == "ar_text_stream":
        text = stdout.split("\nar.context_window ")[0]
        assert text.strip() and trace["ar.streaming"] is True and trace["ar.output_tokens"] <= 64
        return
    video = tmp_path / "out" / f"{script}.mp4"
    assert f"wrote {video}" in stdout
    assert read_video(video).shape == (9, 128, 128, 3)
    assert trace["diffusion.output"] == str(video)
    if script == "wan_i2v":
        assert not [k for k in trace if k.startswith(("diffusion.bridge", "diffusion.source"))]  # no bridge
    if script == "qwen_to_wan_i2v":
        assert_bridge_trace(trace, "A lighthouse on a rocky coast at dusk, waves rolling in")
        assert stdout.startswith("guidance from the AR stage: ")
