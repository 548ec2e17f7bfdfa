"""The compiled decode step by default (`ar_compile` not given), each case in a fresh process as a user starts one:
the Python API compiles where the machine has a C++ compiler and stores the graphs in omni's compile cache, which
the next process finds (its load line says so); with the compiler hidden the engine runs eager and one line says
why, while `ar_compile=true` stays a one-line error; `omni run` (one request) stays eager. The test session sets
OMNI_AR_COMPILE=false (root conftest.py); these processes run without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Tens of seconds of torch.compile (the tiny model's graph, once cold and once from the cache): outside the fast tier
pytestmark = [pytest.mark.real_model]

SCRIPT = """
import json, logging, sys
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(logging.Formatter("omni: %(message)s"))
logging.getLogger("omni").addHandler(handler)
logging.getLogger("omni").setLevel(logging.INFO)
from omni_kernel import Omni
omni = Omni("ar_text", ar_model=sys.argv[1], ar_device="cpu", ar_max_num_seqs=4)
result = omni.generate("Hello there", max_tokens=8, temperature=0)
print(json.dumps({"text": result.text, "compiled": result.trace["ar.decode_compiled"]}))
"""


def environment(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMNI_AR_COMPILE", "TORCHINDUCTOR_CACHE_DIR")}
    return {**env, "OMNI_CACHE_DIR": str(cache), **extra}


def python_api(model: Path, env: dict[str, str]) -> tuple[dict, list[str]]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr.splitlines()


def omni_run(model: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).with_name("omni")), "run", "--pipeline", "ar_text", "--ar-model", str(model),
               "--prompt", "Hello there", "--max-tokens", "8", "--temperature", "0", "-c", "ar_device=cpu",
               "-c", "ar_max_num_seqs=4", "--json", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)


def load_line(lines: list[str], start: str) -> str:
    found = [line for line in lines if line.startswith(start)]
    assert len(found) == 1, lines
    return found[0]


def test_the_default_compiles_once_and_the_next_process_finds_it_in_the_cache(tiny_ckpt, tmp_path):
    env = environment(tmp_path / "cache")
    first, first_log = python_api(tiny_ckpt, env)
    second, second_log = python_api(tiny_ckpt, env)
    assert first["compiled"] is True and second["compiled"] is True
    assert first["text"] == second["text"]
    directory = next((tmp_path / "cache" / "compile").iterdir())
    assert "; compile cache miss: 1 graph stored in " + str(directory) in load_line(
        first_log, "omni: decode steps compiled with torch.compile (inductor) in ")
    assert load_line(second_log, "omni: decode steps compiled with torch.compile (inductor) in ").endswith(
        f"; compile cache hit (1 graph from {directory})")
    assert any(line.endswith("decode steps compiled (ar_compile)") for line in second_log), second_log

    ran = omni_run(tiny_ckpt, env)  # one request: eager unless asked (option run_default)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["trace"]["ar.decode_compiled"] is False
    assert json.loads(ran.stdout)["output"]["text"] == first["text"]


def test_without_a_compiler_the_default_runs_eager_and_says_why(tiny_ckpt, tmp_path):
    """PATH without any directory and CXX unset: inductor looks for $CXX, else g++ (torch._inductor.config.cpp.cxx,
    cpp_builder.cpp_compiler_search), and omni's C++ kernel is built with the same."""
    env = {k: v for k, v in environment(tmp_path / "cache").items() if k != "CXX"}
    env["PATH"] = str(tmp_path / "no-compiler-here")
    out, lines = python_api(tiny_ckpt, env)
    assert out["compiled"] is False
    line = load_line(lines, "omni: decode steps eager: ")
    assert line == ("omni: decode steps eager: the compiled step cannot run here: the C++ decode attention kernel "
                    "needs a C++ compiler: No such file or directory: 'g++' (-c ar_compile=false skips the attempt)")
    assert any(line.endswith("decode steps eager") for line in lines), lines

    required = omni_run(tiny_ckpt, env, "-c", "ar_compile=true")
    assert required.returncode == 2, required.stderr
    assert required.stderr.strip().splitlines()[-1] == (
        "Error: ar_compile: the C++ decode attention kernel needs a C++ compiler: No such file or directory: 'g++'; "
        "run without ar_compile")
