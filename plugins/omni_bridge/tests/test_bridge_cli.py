"""`omni run --pipeline qwen_to_wan_i2v` without the model plugins: one line naming the plugin, exit 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from omni_kernel.cli import main

from bridge_fakes import FakeModels, make_host

ARGS = ["run", "--pipeline", "qwen_to_wan_i2v", "--prompt", "a fox in snow"]


def _error_line(result):
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize("extra", [[], ["--image", "fox.png", "--steps", "2"]])
def test_only_the_bridge_loaded_says_to_install_omni_qwen(extra):
    result = CliRunner().invoke(main, ARGS + extra, env={"OMNI_PLUGINS": "omni_bridge"})
    assert result.exit_code == 2
    line = _error_line(result)
    assert "ar.prompt_bridge" in line and "install" in line and "omni-qwen" in line
    assert "Traceback" not in result.output


def test_qwen_without_wan_says_to_install_omni_wan():
    result = CliRunner().invoke(main, ARGS + ["--image", "fox.png"],
                                obj={"host": make_host(FakeModels(only=("ar.prompt_bridge",)))})
    assert result.exit_code == 2
    line = _error_line(result)
    assert "diffusion.wan22_i2v" in line and "install" in line and "omni-wan" in line and "omni-qwen" not in line


@pytest.mark.cli_subprocess
def test_the_installed_omni_script_says_it_in_one_line():
    env = dict(os.environ, OMNI_PLUGINS="omni_bridge", HF_HUB_OFFLINE="1")
    proc = subprocess.run([str(Path(sys.executable).parent / "omni"), *ARGS], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0
    assert "omni-qwen" in proc.stderr


@pytest.mark.cli_subprocess
def test_the_plugin_module_imports_no_torch():
    code = "import sys, omni_bridge.plugin; sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_docs_show_the_message_the_cli_prints():
    docs = Path(__file__).resolve().parents[3] / "docs" / "bridge.md"
    documented = next(line for line in docs.read_text(encoding="utf-8").splitlines() if line.startswith("Error: "))
    result = CliRunner().invoke(main, ARGS, env={"OMNI_PLUGINS": "omni_bridge"})
    assert _error_line(result) == documented
