"""Reliability corpus, torch-free part: output paths, atomic writes on a full disk, request values at the Python
API and `omni run` usage through the kernel's echo pipeline. Each case asserts its exit code (or exception), a
one-line message, no traceback, no file left behind and nothing outside the output path touched."""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from omni_kernel.builtin.echo import KernelPlugin
from omni_kernel.cli import main
from omni_kernel.core.errors import InvalidParameter
from omni_kernel.core.params import ARParams
from omni_kernel.core.request import Request
from omni_kernel.plugins import PluginHost
from omni_kernel.util.files import atomic_path, check_output_path, write_json


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under root with its kind, size and mtime: 'nothing outside the output path touched'."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            found[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size if not stat.S_ISDIR(st.st_mode)
                                               else 0, st.st_mtime_ns if not stat.S_ISDIR(st.st_mode) else 0)
    return found


@pytest.fixture
def sandbox(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "clips").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "to_null").symlink_to("/dev/null")
    return tmp_path


def _sock(sandbox: Path) -> str:
    path = sandbox / "sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    return str(path)


# (case, path builder, expected text in the message)
OUTPUT_PATHS = {
    "a directory": (lambda d: d / "clips", "is a directory"),
    "/dev/null": (lambda d: "/dev/null", "character device"),
    "/dev/full": (lambda d: "/dev/full", "character device"),
    "a FIFO": (lambda d: d / "fifo", "FIFO"),
    "a socket": (_sock, "socket"),
    "a symlink to /dev/null": (lambda d: d / "to_null", "character device"),
    "parent is a file": (lambda d: d / "a_file" / "out.json", "is not a directory"),
    "grandparent is a file": (lambda d: d / "a_file" / "sub" / "out.json", "is not a directory"),
    "parent is a broken symlink": (lambda d: d / "dangling" / "out.json", "broken symbolic link"),
    "name too long": (lambda d: d / ("n" * 250 + ".json"), "bytes"),
    "directory name too long": (lambda d: d / ("d" * 240) / "out.json", "bytes"),
    "names no file": (lambda d: "/", "names no file"),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_PATHS))
def test_output_path_refused_before_work(case, sandbox):
    build, expected = OUTPUT_PATHS[case]
    path = build(sandbox)
    before = snapshot(sandbox)
    with pytest.raises(InvalidParameter) as info:
        check_output_path(path)
    message = str(info.value)
    assert len(message.splitlines()) == 1 and expected in message and message.startswith("invalid output")
    assert snapshot(sandbox) == before


def test_output_path_in_read_only_dir(readonly_dir):
    with pytest.raises(InvalidParameter, match="cannot write in"):
        check_output_path(readonly_dir / "v.json")
    assert list(readonly_dir.iterdir()) == []


def test_output_path_missing_parents_are_created_later(tmp_path, readonly_dir):
    assert check_output_path(tmp_path / "new" / "deeper" / "v.json") == tmp_path / "new" / "deeper" / "v.json"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InvalidParameter, match="cannot write in"):  # ... where they can be created
        check_output_path(readonly_dir / "new" / "v.json")


@pytest.mark.parametrize("device", ["/dev/null", "/dev/full"])
def test_atomic_write_never_replaces_a_special_file(device, tmp_path):
    before = os.stat(device)
    with pytest.raises(OSError, match="not a regular file"):
        write_json(device, {"a": 1})
    after = os.stat(device)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev
    assert not [p for p in Path("/dev").glob(f".{Path(device).name}.*")]


def test_atomic_write_on_a_full_disk_leaves_nothing(small_fs):
    with pytest.raises(OSError) as info:
        write_json(small_fs / "big.json", {"x": "y" * 200_000})
    assert info.value.errno == errno.ENOSPC
    assert list(small_fs.iterdir()) == []


def test_atomic_path_error_inside_block_removes_temp(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "v.bin") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


WRITER = """
import sys, time
from omni_kernel.util.files import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    with open(tmp, "wb") as f:
        f.write(b"half")
        f.flush()
        print("writing", flush=True)
        time.sleep(600)
"""


def test_a_writer_killed_by_sigkill_inside_atomic_path_leaves_nothing(tmp_path):
    """The temporary file has no name until it replaces the output (O_TMPFILE), so even SIGKILL, which no
    handler sees, leaves nothing behind."""
    import signal
    import subprocess
    import sys

    from omni_kernel.util.files import _unnamed_file

    probe = _unnamed_file(tmp_path)
    if probe is None:
        pytest.skip("this file system has no O_TMPFILE: a killed writer leaves a hidden file there")
    os.close(probe)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "v.bin")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline() == "writing\n"
        assert list(tmp_path.iterdir()) == []  # nothing named while it writes
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
    finally:
        if writer.poll() is None:
            writer.kill()
    assert list(tmp_path.iterdir()) == []


# Request values through the Python API: one-line InvalidParameter naming the field.
BAD_PARAMS = {
    "seed 2**63": ({"seed": 2**63}, "seed"), "seed 2**70": ({"seed": 2**70}, "seed"),
    "seed -1": ({"seed": -1}, "seed"), "seed True": ({"seed": True}, "seed"),
    "seed 1.5": ({"seed": 1.5}, "seed"),
    "temperature inf": ({"temperature": float("inf")}, "temperature"),
    "temperature nan": ({"temperature": float("nan")}, "temperature"),
    "temperature -1": ({"temperature": -1.0}, "temperature"),
    "temperature text": ({"temperature": "hot"}, "temperature"),
    "top_p 0": ({"top_p": 0.0}, "top_p"), "top_p nan": ({"top_p": float("nan")}, "top_p"),
    "top_p 1.5": ({"top_p": 1.5}, "top_p"), "top_p -inf": ({"top_p": float("-inf")}, "top_p"),
    "top_k 0": ({"top_k": 0}, "top_k"), "top_k -2": ({"top_k": -2}, "top_k"),
    "stop empty": ({"stop": ("",)}, "stop"), "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens 1.5": ({"max_tokens": 1.5}, "max_tokens"), "stream 'yes'": ({"stream": "yes"}, "stream"),
}


@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_bad_param_is_invalid_parameter(case):
    values, field = BAD_PARAMS[case]
    with pytest.raises(InvalidParameter) as info:
        ARParams(**values)
    assert info.value.field == field and len(str(info.value).splitlines()) == 1


def test_edge_values_that_pass():
    assert ARParams(seed=2**63 - 1).seed == 2**63 - 1
    assert ARParams(seed=0, temperature=1e-300, top_p=1e-300).temperature == 1e-300


@pytest.mark.parametrize("prompt", ["bad \udcff bytes", "\ud800", b"bytes", None, 3])
def test_bad_prompt_is_one_line(prompt):
    with pytest.raises(InvalidParameter, match="invalid prompt") as info:
        Request("echo", prompt)
    assert len(str(info.value).splitlines()) == 1


# `omni run` through the echo pipeline (no model): usage errors and --trace-json, checked before any work.
@pytest.fixture
def host():
    host = PluginHost()
    host.register(KernelPlugin(), "omni_kernel", "0.1.0")
    return host


def _echo(host, *args):
    return CliRunner().invoke(main, ["run", "--pipeline", "echo", *args], obj={"host": host})


CLI_CASES = {
    "unknown option": (lambda d: ["--prompt", "x", "--bogus"], 2, "No such option"),
    "missing --prompt": (lambda d: [], 2, "Missing option"),
    "option without value": (lambda d: ["--prompt"], 2, "requires an argument"),
    "unknown -o key": (lambda d: ["--prompt", "x", "-o", "max_tokns=3"], 2, "max_tokns"),
    "-o without =": (lambda d: ["--prompt", "x", "-o", "max_tokens"], 2, "max_tokens"),
    "--seed 2**64": (lambda d: ["--prompt", "x", "--seed", str(2**64)], 2, "invalid seed"),
    "--seed -1": (lambda d: ["--prompt", "x", "--seed", "-1"], 2, "invalid seed"),
    "--temperature inf": (lambda d: ["--prompt", "x", "--temperature", "inf"], 2, "invalid temperature"),
    "--temperature nan": (lambda d: ["--prompt", "x", "--temperature", "nan"], 2, "invalid temperature"),
    "--max-tokens 0": (lambda d: ["--prompt", "x", "--max-tokens", "0"], 2, "invalid max_tokens"),
    "prompt with invalid UTF-8": (lambda d: ["--prompt", "a\udcffb"], 2, "not valid UTF-8"),
    "--trace-json a directory": (lambda d: ["--prompt", "x", "--trace-json", str(d / "clips")], 2,
                                 "is a directory"),
    "--trace-json /dev/null": (lambda d: ["--prompt", "x", "--trace-json", "/dev/null"], 2, "character device"),
    "--trace-json a FIFO": (lambda d: ["--prompt", "x", "--trace-json", str(d / "fifo")], 2, "FIFO"),
    "--trace-json under a FIFO": (lambda d: ["--prompt", "x", "--trace-json", str(d / "fifo" / "t.json")], 2,
                                  "is not a directory"),
    "--trace-json parent is a file": (lambda d: ["--prompt", "x", "--trace-json", str(d / "a_file" / "t.json")],
                                      2, "is not a directory"),
    "--trace-json name too long": (lambda d: ["--prompt", "x", "--trace-json", str(d / ("t" * 300))], 2,
                                   "too long"),
    "--trace-json name near the limit": (lambda d: ["--prompt", "x", "--trace-json", str(d / ("t" * 240))], 2,
                                         "bytes"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_bad_use_is_one_line(case, host, sandbox):
    build, code, expected = CLI_CASES[case]
    before = snapshot(sandbox)
    result = _echo(host, *build(sandbox))
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0], result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    assert snapshot(sandbox) == before


@pytest.mark.parametrize("name", ["t.json", "missing/parent/t.json"])
def test_cli_trace_json_in_read_only_dir(name, host, readonly_dir):
    result = _echo(host, "--prompt", "x", "--trace-json", str(readonly_dir / name))
    assert result.exit_code == 2 and "cannot write in" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and list(readonly_dir.iterdir()) == []


def test_cli_trace_json_on_a_full_disk(host, small_fs):
    filler = small_fs / "filler"
    with open(filler, "wb", buffering=0) as f:  # fill it: the path check passes, the trace does not fit
        try:
            while True:
                f.write(b"\0" * 1024)
        except OSError:
            pass
    try:
        result = _echo(host, "--prompt", "word " * 400, "--trace-json", str(small_fs / "t.json"))
        assert result.exit_code == 1, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot write the trace" in lines[0] and "No space left" in lines[0]
        assert sorted(p.name for p in small_fs.iterdir()) == ["filler"]
    finally:
        filler.unlink()
