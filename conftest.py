"""Every suite in this repository (tests/, plugins/*/tests, examples/plugin_example/tests) runs under these
fixtures, and the reliability suites share the small and read-only file systems below. pytest reads
`pytest_plugins` only in the rootdir conftest, so the opt-in lives here; no torch."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["omni_kernel.testing"]

# The pytest workers, the servers and stage workers they start and torch's threads in each share this machine's
# cores: with libgomp's default spin-wait at every barrier a waiting thread burns the core another process needs
# (SmolLM2's `generate`, two processes at 2 threads on 2 cores: 17.6 s each; with PASSIVE 6.9 s; one alone 7.3 s
# either way). libgomp reads it when torch loads it: here, before any test module imports torch; every process a
# test starts inherits it. A value already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The suite starts some 500 interpreters (stage workers, servers, ranks, Ray workers), and `make setup` installs
# without byte-compiling (--no-compile: 35 s instead of 77 s). Where the environment says PYTHONDONTWRITEBYTECODE
# (this machine's does) no process would keep its bytecode, and each one would compile torch, transformers and
# diffusers from source again: pytest took 1278 s instead of about 700 on 2 cores. So the suite writes each
# module's bytecode at its first import, from this process on and in every process it starts.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_addoption(parser):
    parser.addoption("--durations-file", metavar="PATH", default=None,
                     help="write every test's time (setup + call + teardown), slowest first, to PATH (make test)")


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    path = config.getoption("durations_file")
    if path is None:
        return
    slowest = sorted(_durations.items(), key=lambda item: item[1], reverse=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{seconds:8.2f}s  {nodeid}" for nodeid, seconds in slowest]
    path.write_text("\n".join(lines) + "\n")
    terminalreporter.write_sep("=", f"{len(lines)} tests' times in {path}, the slowest 10")
    for line in lines[:10]:
        terminalreporter.write_line(line)


# The tiers that follow from a fixture (markers in pyproject.toml): a test that asks for one of these is in
# that tier wherever it lives, so a new test of the real model or of a served module needs no mark of its own.
TIER_OF_FIXTURE = {
    "smollm2_dir": "real_model",
    "qwen25_tokenizer_dir": "real_model",
    "qwen25_tokenizer": "real_model",
    "voice_dir": "real_model",
    "whisper_dir": "real_model",
    "recordings": "real_model",
    "server": "server",
}


# Modules that must not run beside themselves on two pytest-xdist workers (`make test` runs `--dist loadgroup`):
# each starts Ray clusters on this machine's ports and /tmp/ray, or unpacks and drives the one headless Chromium.
XDIST_GROUPS = {"test_ray.py": "ray", "test_ray_nodes.py": "ray", "test_wan_parallel_ray.py": "ray",
                "test_page_browser.py": "browser", "test_page_audio_browser.py": "browser",
                "test_page_voice_chat_browser.py": "browser"}
# Longest first, so that two workers end together instead of one waiting on the other's last slow module.
TIER_ORDER = ("wheels", "browser", "server", "process", "real_model", "cli_subprocess")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        for fixture, tier in TIER_OF_FIXTURE.items():
            if fixture in fixtures and item.get_closest_marker(tier) is None:
                item.add_marker(tier)
        group = XDIST_GROUPS.get(item.path.name)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    order: dict[Path, int] = {}
    for item in items:
        order[item.path] = min(order.get(item.path, len(TIER_ORDER)), _rank(item))
    items.sort(key=lambda item: order[item.path])  # stable: a module's tests stay together and in order


def pytest_collection_finish(session):
    """On a pytest-xdist worker under `--dist loadgroup`: every test of a group carries its group in its id (what
    the scheduler groups by), else pytest and pytest-xdist disagree (constraints.txt) and the groups would split."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    split = [item.nodeid for item in session.items
             if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if split:
        raise pytest.UsageError(f"pytest-xdist's --dist loadgroup does not group under pytest {pytest.__version__} "
                                f"({len(split)} tests, e.g. {split[0]}): install the pytest of constraints.txt")


def _rank(item) -> int:
    if item.path.name in XDIST_GROUPS:
        return -1
    return next((i for i, tier in enumerate(TIER_ORDER) if item.get_closest_marker(tier)), len(TIER_ORDER))


@pytest.fixture(scope="session", autouse=True)
def _omni_cache(omni_cache):
    """Plus OMNI_AR_DEFAULT=tiny: a run without ar_model uses the tiny random-weight model, fast and always
    there; tests of the real default model (SmolLM2, omni_qwen/default_model.py) pass it explicitly. And
    OMNI_AR_COMPILE=false: an AR engine built without ar_compile runs its decode steps eager, as `-c
    ar_compile=false` does, where by default it would compile them (seconds to a minute an engine, and the suite
    builds hundreds, in servers and workers too); the tests of the compiled default remove it (omni_qwen's
    `compiled_default` fixture)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("OMNI_AR_DEFAULT", "tiny")
    patch.setenv("OMNI_AR_COMPILE", "false")
    yield omni_cache
    patch.undo()


@pytest.fixture(autouse=True)
def _omni_logger(omni_logger):
    return omni_logger


CHECKOUT = Path(__file__).resolve().parent
CORE_DUMP = re.compile(r"core(\.\d+)?")


@pytest.fixture(autouse=True)
def _leaves_no_file_in_the_checkout():
    """A test's outputs go to its tmp_path: a file it leaves at the checkout's top (a video at its default path
    omni_<id>.mp4, say) fails it, named. A stage worker or server that writes after the test returned is caught
    by the next test on that pytest worker."""
    before = _top_files()
    yield
    left = sorted(_top_files() - before)
    if left:
        for name in left:
            (CHECKOUT / name).unlink(missing_ok=True)
        pytest.fail(f"the test left {', '.join(left)} in {CHECKOUT}: give it a path under tmp_path", pytrace=False)


def _top_files() -> set[str]:
    """The plain files at the checkout's top, core dumps aside (a crashed browser's, where core_pattern is "core":
    the launch retry in test_page_browser.py tolerates that crash, and the dump is worth keeping)."""
    return {entry.name for entry in os.scandir(CHECKOUT)
            if entry.is_file(follow_symlinks=False) and not CORE_DUMP.fullmatch(entry.name)}


def _mount_tmpfs(target, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    target.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                          capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory):
    """A 64 KiB tmpfs: a disk that fills up (reliability tests)."""
    path = tmp_path_factory.mktemp("small-fs")
    if not _mount_tmpfs(path, "size=64k"):
        pytest.skip("a 64 KiB tmpfs needs root and mount(8) (not available here)")
    yield path
    subprocess.run(["umount", str(path)], check=False)


@pytest.fixture(scope="module")
def readonly_dir(tmp_path_factory):
    """A directory nobody can write in: a read-only tmpfs as root (root ignores mode bits), else mode 0555."""
    path = tmp_path_factory.mktemp("read-only")
    if _mount_tmpfs(path, "ro,size=16k"):
        yield path
        subprocess.run(["umount", str(path)], check=False)
        return
    if os.geteuid() == 0:
        pytest.skip("root ignores mode bits and a read-only tmpfs cannot be mounted here")
    path.chmod(0o555)
    yield path
    path.chmod(0o755)
