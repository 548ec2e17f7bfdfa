"""The installed `omni` script in a subprocess, the import-weight contract, and the pip-installed example plugin."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omni_kernel.plugins import ENTRY_POINT_GROUP

pytestmark = [pytest.mark.cli_subprocess]

ROOT = Path(__file__).resolve().parents[1]
OMNI = Path(sys.executable).parent / "omni"
HEAVY = ("torch", "transformers", "diffusers")


def run(args, env_extra=None, timeout=120, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUTF8": "1", "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    return subprocess.run(args, capture_output=True, text=True, encoding="utf-8", env=env, timeout=timeout,
                          **kwargs)


def omni(*args, env_extra=None) -> subprocess.CompletedProcess:
    if not OMNI.exists():
        pytest.skip(f"no installed omni script next to {sys.executable}")
    return run([str(OMNI), *args], env_extra)


def test_importing_the_kernel_and_cli_loads_no_model_library():
    code = ("import sys, omni_kernel, omni_kernel.cli, omni_kernel.api; "
            f"print([m for m in {HEAVY!r} if m in sys.modules])")
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_loading_every_installed_plugin_loads_no_model_library():
    """`omni --help` imports every plugin's entry module: they must import torch lazily, in stage factories."""
    code = ("import sys; from omni_kernel.plugins import load_host; host = load_host(); "
            f"print([m for m in {HEAVY!r} if m in sys.modules]); "
            "print([p.name for p in host.plugins if p.status == 'failed'])")
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "[]"], result.stdout + result.stderr


def test_installed_script_streams_echo_and_writes_the_trace(tmp_path):
    result = omni("run", "--pipeline", "echo", "--prompt", "héllo 世界", "--stream", "--trace-json",
                  str(tmp_path / "t.json"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "héllo 世界\n"
    trace = json.loads((tmp_path / "t.json").read_text(encoding="utf-8"))
    assert trace["ar.stop_reason"] == "eos" and trace["ar.streaming"] is True


def test_installed_script_user_error_is_one_line_exit_2():
    result = omni("run", "--pipeline", "nope", "--prompt", "x")
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "known pipelines: " in result.stderr
    assert "echo" in result.stderr and "Traceback" not in result.stderr


def test_installed_script_lists_the_kernel_and_version():
    result = omni("plugins")
    assert result.returncode == 0, result.stderr
    assert f"omni_kernel {importlib.metadata.version('omni-kernel')} [loaded]" in result.stdout.splitlines()
    version = omni("--version")
    assert version.returncode == 0 and version.stdout.startswith("omni, version ")


def test_installed_script_loads_every_plugin_under_plugins():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch-free kernel venv (make test-kernel-only): the plugins under plugins/ are not installed")
    # Every distribution under plugins/ but the libraries they share (omni-hf), which declare no entry point.
    texts = [p.read_text(encoding="utf-8") for p in ROOT.glob("plugins/*/pyproject.toml")]
    dists = sorted(re.search(r'^name = "([^"]+)"', t, re.M).group(1) for t in texts if ENTRY_POINT_GROUP in t)
    assert dists, "no plugins/*/pyproject.toml"
    lines = omni("plugins").stdout.splitlines()
    for dist in dists:
        try:
            installed = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{dist} is not installed in {sys.prefix} (make setup installs every plugin)")
        names = [ep.name for ep in installed.entry_points if ep.group == ENTRY_POINT_GROUP]
        assert names, f"{dist} declares no {ENTRY_POINT_GROUP!r} entry point"
        for name in names:
            assert f"{name} {installed.version} [loaded]" in lines, "\n".join(lines)


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory) -> Path:
    """examples/plugin_example, pip-installed into a private target directory."""
    work = tmp_path_factory.mktemp("example")
    source = work / "src"
    shutil.copytree(ROOT / "examples" / "plugin_example", source,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache"))
    target = work / "site"
    result = run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                  "--no-index", "--disable-pip-version-check", "--target", str(target), str(source)], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return target


def test_pip_installed_example_plugin_joins_pipelines_and_runs(installed_example, tmp_path):
    env = {"PYTHONPATH": str(installed_example)}
    listing = omni("pipelines", env_extra=env)
    assert listing.returncode == 0, listing.stderr
    assert "echo_upper (from omni_plugin_example)" in listing.stdout
    assert "  edge echo -> upper via ar_to_text" in listing.stdout
    plugins = omni("plugins", env_extra=env)
    assert "omni_plugin_example 0.1.0 [loaded]" in plugins.stdout and "node types: text.upper" in plugins.stdout
    result = omni("run", "--pipeline", "echo_upper", "--prompt", "héllo world", "--stream", "--trace-json",
                  str(tmp_path / "t.json"), env_extra=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "HÉLLO WORLD\n"
    assert json.loads((tmp_path / "t.json").read_text(encoding="utf-8"))["upper.chars"] == 11
    shout = omni("run", "--pipeline", "echo_upper", "--prompt", "hi", "--shout", env_extra=env)
    assert shout.returncode == 0 and shout.stdout == "HI!\n", shout.stderr  # the plugin's own flag
    refused = omni("run", "--pipeline", "echo", "--prompt", "x", "--shout", env_extra=env)
    assert refused.returncode == 2 and refused.stderr == "Error: pipeline 'echo' does not use --shout\n"
    hidden = omni("pipelines", env_extra={**env, "OMNI_PLUGINS": "none_of_them"})
    assert "echo_upper" not in hidden.stdout and "echo (from omni_kernel)" in hidden.stdout
