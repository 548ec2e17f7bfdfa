"""Reliability corpus for `wan_i2v` (demo model): bad values, output paths checked before any model work, a
full disk, special files, a failed trace write, SIGTERM/SIGHUP, and checkpoints that do not match their
config. Each case asserts the exit code, one `Error:` line on stderr, no traceback, no file left behind and
nothing outside the output path touched."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from omni_kernel.cli import main
from omni_kernel.core.errors import ModelError


def snapshot(root: Path) -> dict[str, tuple]:
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(Path(dirpath) / name)
            regular = stat.S_ISREG(st.st_mode)
            found[str((Path(dirpath) / name).relative_to(root))] = (
                stat.S_IFMT(st.st_mode), st.st_size if regular else 0, st.st_mtime_ns if regular else 0)
    return found


@pytest.fixture
def sandbox(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "clips.mp4").mkdir()
    os.mkfifo(tmp_path / "fifo.mp4")
    return tmp_path


def wan(model: Path, image: Path, *args: str):
    return CliRunner().invoke(main, ["run", "--pipeline", "wan_i2v", "--model", str(model), "--image", str(image),
                                     *args])


def assert_one_line(result, code: int, expected: str) -> None:
    assert result.exit_code == code, result.output
    errors = [line for line in result.stderr.splitlines() if not line.startswith("omni: ")]
    assert len(errors) == 1 and errors[0].startswith("Error: ") and expected in errors[0], result.stderr
    assert "Traceback" not in result.output


SMOKE = ["--preset", "smoke", "--steps", "1", "--num-frames", "5", "--height", "32", "--width", "32"]

# (args given the sandbox dir, exit code, expected text); the output defaults to sandbox/v.mp4
CLI_CASES = {
    "empty prompt": (lambda d: ["--prompt", "", "--output", str(d / "v.mp4")], 2, "the prompt is empty"),
    "whitespace prompt": (lambda d: ["--prompt", " \t\n ", "--output", str(d / "v.mp4")], 2, "prompt is empty"),
    "invalid UTF-8 prompt": (lambda d: ["--prompt", "a\udcff", "--output", str(d / "v.mp4")], 2, "UTF-8"),
    "guidance inf": (lambda d: ["--prompt", "x", "--guidance-scale", "inf", "--output", str(d / "v.mp4")], 2,
                     "guidance_scale"),
    "guidance nan": (lambda d: ["--prompt", "x", "--guidance-scale", "nan", "--output", str(d / "v.mp4")], 2,
                     "guidance_scale"),
    "guidance -1": (lambda d: ["--prompt", "x", "--guidance-scale", "-1", "--output", str(d / "v.mp4")], 2,
                    "guidance_scale"),
    "seed 2**64": (lambda d: ["--prompt", "x", "--seed", str(2**64), "--output", str(d / "v.mp4")], 2, "seed"),
    "seed 2**70": (lambda d: ["--prompt", "x", "--seed", str(2**70), "--output", str(d / "v.mp4")], 2, "seed"),
    "seed -1": (lambda d: ["--prompt", "x", "--seed", "-1", "--output", str(d / "v.mp4")], 2, "seed"),
    "steps 0": (lambda d: ["--prompt", "x", "--steps", "0", "--output", str(d / "v.mp4")], 2, "num_inference_steps"),
    "output /dev/full": (lambda d: ["--prompt", "x", "--output", "/dev/full"], 2, "must end in .mp4"),
    "output a directory": (lambda d: ["--prompt", "x", "--output", str(d / "clips.mp4")], 2, "is a directory"),
    "output a FIFO": (lambda d: ["--prompt", "x", "--output", str(d / "fifo.mp4")], 2, "FIFO"),
    "output parent is a file": (lambda d: ["--prompt", "x", "--output", str(d / "a_file" / "v.mp4")], 2,
                                "is not a directory"),
    "output name too long": (lambda d: ["--prompt", "x", "--output", str(d / ("v" * 240 + ".mp4"))], 2, "bytes"),
    "output name over NAME_MAX": (lambda d: ["--prompt", "x", "--output", str(d / ("v" * 300 + ".mp4"))], 2,
                                  "too long"),
    "profile trace name too long": (lambda d: ["--prompt", "x", "--profile", "--output",
                                               str(d / ("v" * 220 + ".mp4"))], 2, "bytes"),
    "trace-json equals output": (lambda d: ["--prompt", "x", "--output", str(d / "v.mp4"), "--trace-json",
                                            str(d / "v.mp4")], 2, "also the request's output"),
    "trace-json a directory": (lambda d: ["--prompt", "x", "--output", str(d / "v.mp4"), "--trace-json",
                                          str(d / "clips.mp4")], 2, "is a directory"),
    "trace-json /dev/null": (lambda d: ["--prompt", "x", "--output", str(d / "v.mp4"), "--trace-json",
                                        "/dev/null"], 2, "character device"),
    "trace-json parent is a file": (lambda d: ["--prompt", "x", "--output", str(d / "v.mp4"), "--trace-json",
                                               str(d / "a_file" / "t.json")], 2, "is not a directory"),
    "output missing parent under a file": (lambda d: ["--prompt", "x", "--output", str(d / "a_file" / "a" / "v.mp4")],
                                           2, "is not a directory"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_case(case, tiny_model, image_path, sandbox, monkeypatch):
    """Each is refused before anything is built: no model loads for a bad request."""
    from omni_kernel.core.planner import GraphBuilder

    built = []
    monkeypatch.setattr(GraphBuilder, "build", lambda self, plan, *a, **k: built.append(plan.name))
    args, code, expected = CLI_CASES[case]
    before = snapshot(sandbox)
    dev = {p: os.stat(p).st_rdev for p in ("/dev/null", "/dev/full")}
    result = wan(tiny_model, image_path, *SMOKE, *args(sandbox))
    assert_one_line(result, code, expected)
    assert built == []
    assert snapshot(sandbox) == before
    assert {p: os.stat(p).st_rdev for p in dev} == dev and all(stat.S_ISCHR(os.stat(p).st_mode) for p in dev)


def test_output_in_read_only_dir_is_refused_before_work(tiny_model, image_path, readonly_dir, monkeypatch):
    from omni_wan.runner import PHASES

    monkeypatch.setitem(PHASES, "prepare", lambda *a: pytest.fail("the request ran before the output check"))
    result = wan(tiny_model, image_path, *SMOKE, "--prompt", "x", "--output", str(readonly_dir / "v.mp4"))
    assert_one_line(result, 2, "cannot write in")
    assert list(readonly_dir.iterdir()) == []


@pytest.mark.parametrize("name", ["t.json", "missing/t.json"])
def test_trace_json_in_read_only_dir(name, tiny_model, image_path, readonly_dir, tmp_path):
    result = wan(tiny_model, image_path, *SMOKE, "--prompt", "x", "--output", str(tmp_path / "v.mp4"),
                 "--trace-json", str(readonly_dir / name))
    assert_one_line(result, 2, "cannot write in")
    assert list(tmp_path.iterdir()) == [] and list(readonly_dir.iterdir()) == []


def test_full_disk_is_one_line_and_no_file(tiny_model, image_path, small_fs):
    result = wan(tiny_model, image_path, "--prompt", "x", "--preset", "smoke", "--steps", "1", "--num-frames", "9",
                 "--height", "256", "--width", "256", "--seed", "1", "--output", str(small_fs / "v.mp4"))
    assert_one_line(result, 1, "No space left on device")
    assert list(small_fs.iterdir()) == []


def test_failed_trace_write_removes_the_video(tiny_model, image_path, tmp_path, monkeypatch):
    import omni_kernel.cli.run as cli_run

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli_run, "write_json", full)
    result = wan(tiny_model, image_path, *SMOKE, "--prompt", "x", "--output", str(tmp_path / "v.mp4"),
                 "--trace-json", str(tmp_path / "t.json"))
    assert_one_line(result, 1, "cannot write the trace")
    assert "removed" in result.stderr and list(tmp_path.iterdir()) == []


def test_good_run_after_refusals_in_the_same_process(tiny_model, image_path, sandbox, tmp_path, monkeypatch):
    """After refusals of each sort the corpus covers (a bad value, a bad output path, a refused trace path, a
    trace write that failed after the render), the same process still renders: nothing was left half-done.
    Self-contained: it makes its own refusals rather than counting on the tests above having run first."""
    import omni_kernel.cli.run as cli_run

    for case in ("guidance nan", "output a FIFO", "trace-json a directory"):
        build, code, expected = CLI_CASES[case]
        assert_one_line(wan(tiny_model, image_path, *SMOKE, *build(sandbox)), code, expected)
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    failed = tmp_path / "failed"
    failed.mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(cli_run, "write_json", full)
        result = wan(tiny_model, image_path, *SMOKE, "--prompt", "x", "--output", str(failed / "v.mp4"),
                     "--trace-json", str(failed / "t.json"))
    assert_one_line(result, 1, "cannot write the trace")
    assert list(failed.iterdir()) == []

    good = tmp_path / "good"
    good.mkdir()
    result = wan(tiny_model, image_path, *SMOKE, "--prompt", "x", "--output", str(good / "v.mp4"),
                 "--trace-json", str(good / "t.json"))
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in good.iterdir()) == ["t.json", "v.mp4"]


# Signals: a subprocess that sends itself the signal while the MP4's temporary file exists (inside export).
SIGNAL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import omni_wan.video as video
    real, signum = video.sync_file, getattr(signal, sys.argv[1])
    def sync_then_signal(path):
        real(path)
        os.kill(os.getpid(), signum)
        time.sleep(5)  # parked: the handler ends the process here; only a lost signal would get past it
    video.sync_file = sync_then_signal
    from omni_kernel.cli import main
    sys.argv = ["omni"] + sys.argv[2:]
    main()
""")


@pytest.mark.cli_subprocess
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_signal_during_export_cleans_up(signame, tiny_model, image_path, tmp_path, omni_cache):
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", SIGNAL_SCRIPT, signame, "run", "--pipeline", "wan_i2v", "--model", str(tiny_model),
         "--image", str(image_path), "--prompt", "x", *SMOKE, "--output", str(out / "v.mp4")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("omni: ")]
    assert errors == ["Error: interrupted; the request was aborted and no partial output was kept"], proc.stderr
    assert list(out.iterdir()) == []


# Checkpoints that do not match their config: one ModelError line when the model loads, nothing unpickled.
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _weights(d: Path, component: str) -> Path:
    return next((d / component).glob("*.safetensors"))


def _drop(component, pick):
    def mutate(d):
        from safetensors.torch import load_file, save_file

        w = load_file(_weights(d, component))
        w.pop(next(k for k in sorted(w) if pick in k))
        save_file(w, _weights(d, component))
    return mutate


def _extra(component):
    def mutate(d):
        import torch
        from safetensors.torch import load_file, save_file

        w = load_file(_weights(d, component))
        w["surprise.weight"] = torch.zeros(2)
        save_file(w, _weights(d, component))
    return mutate


def _config(component, key, value):
    def mutate(d):
        f = d / component / "config.json"
        body = json.loads(f.read_text())
        body[key] = value
        f.write_text(json.dumps(body))
    return mutate


def _pickle_index(component):
    def mutate(d):
        import torch
        from safetensors.torch import load_file

        marker = d / "UNPICKLED"

        class Payload:
            def __reduce__(self):
                return (open, (str(marker), "w"))

        torch.save({"x": Payload()}, d / component / "weights.bin")
        (d / component / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {k: "weights.bin" for k in load_file(_weights(d, component))}}))
    return mutate


CHECKPOINTS = {
    "transformer missing a layer": (_drop("transformer", "blocks.1."), "missing tensor"),
    "text encoder missing its embedding": (_drop("text_encoder", "shared"), "missing tensor"),
    "vae missing a tensor": (_drop("vae", "decoder.conv_in"), "missing tensor"),
    "transformer with an extra tensor": (_extra("transformer"), "unexpected tensor"),
    "vae shapes do not match config": (_config("vae", "base_dim", 16), "has shape"),
    "transformer heads do not match": (_config("transformer", "num_attention_heads", 3), "has shape"),
    "vae scale_factor_spatial 0": (_config("vae", "scale_factor_spatial", 0), "scale_factor_spatial"),
    "vae scale_factor_temporal text": (_config("vae", "scale_factor_temporal", "4"), "scale_factor_temporal"),
    "vae latents_std zero": (_config("vae", "latents_std", [0.0] * 48), "latents_std"),
    "vae latents_mean wrong length": (_config("vae", "latents_mean", [0.0] * 3), "latents_mean"),
    "vae z_dim text": (_config("vae", "z_dim", "x"), "z_dim"),
    "transformer patch_size odd": (_config("transformer", "patch_size", [1, 0, 2]), "patch_size"),
    "transformer index points at a pickle": (_pickle_index("transformer"), "not a .safetensors file"),
    "text encoder index points at a pickle": (_pickle_index("text_encoder"), "not a .safetensors file"),
    "vae index points at a pickle": (_pickle_index("vae"), "not a .safetensors file"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINTS))
def test_checkpoint_refused_in_one_line(case, tiny_model, image_path, tmp_path, capfd):
    from omni_kernel import Omni

    mutate, expected = CHECKPOINTS[case]
    ckpt = _copy(tiny_model, tmp_path / "ckpt")
    mutate(ckpt)
    out = tmp_path / "v.mp4"
    with pytest.raises(ModelError) as info:
        Omni("wan_i2v", model=str(ckpt), device="cpu").generate("x", image=str(image_path), output=str(out),
                                                                 preset="smoke", num_inference_steps=1,
                                                                 num_frames=5, height=32, width=32)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and expected in message, message
    assert not out.exists() and not (ckpt / "UNPICKLED").exists()
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == "", captured.err  # library reports went to the debug log
