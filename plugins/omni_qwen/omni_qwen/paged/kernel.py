"""The C++ decode attention kernel (decode_attention.cpp) for the compiled decode step on a CPU: built for this
machine at load with the C++ compiler inductor uses, and kept in omni's cache directory under a key of the source,
torch, the compiler and the CPU (it is built with -march=native, and the machine may change under the same home).

SDPA on a decode's 3-row query per K/V head has a fixed cost per (request, head), and the block gather before it
copies every request's context once more; the kernel reads each request's blocks in place, one pass over each
block's K and V (docs/qwen-measurements.md has the figures).
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from torch._inductor import config as inductor_config
from torch.utils import cpp_extension

from omni_kernel.util.files import cache_dir

from ..precision import CpuInfo

SOURCE = Path(__file__).with_name("decode_attention.cpp")
# -ffast-math: the exponentials of the softmax vectorize (glibc's vector math); the kernel keeps no infinities.
# Compile only: linked with it, gcc < 13 adds crtfastmath.o, which flushes denormals to zero in the whole process.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++20", "-fPIC")


class KernelBuildError(RuntimeError):
    """The kernel could not be built here (no C++ compiler, or it failed): one line saying why."""


def compiler() -> str:
    """The C++ compiler inductor compiles with (its `cpp.cxx` setting: $CXX, else g++)."""
    return inductor_config.cpp.cxx[-1] or "g++"


def _commands(output: Path) -> list[list[str]]:
    """Compile, then link (without -ffast-math)."""
    libs, objects = cpp_extension.library_paths(), output.with_suffix(".o")
    return [[compiler(), *FLAGS, *(f"-I{p}" for p in cpp_extension.include_paths()), "-c", str(SOURCE), "-o",
             str(objects)],
            [compiler(), "-shared", "-fopenmp", str(objects), "-o", str(output), *(f"-L{p}" for p in libs),
             *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu"]]


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as exc:
        raise KernelBuildError(f"the C++ decode attention kernel needs a C++ compiler: {exc.strerror}: "
                               f"{command[0]!r}") from exc
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line] or [done.stderr.strip()[-300:]]
        raise KernelBuildError(f"{command[0]} could not build the C++ decode attention kernel: {errors[0].strip()}")
    return done.stdout


def _version() -> str:
    return (_run([compiler(), "--version"]).splitlines() or [""])[0]


def built(directory: Path | None = None) -> Path:
    """The kernel's shared library for this machine: from the cache, or compiled now (about 7 s)."""
    source = SOURCE.read_bytes()
    key = CpuInfo.read().key(hashlib.sha256(source).hexdigest(), torch.__version__, _version(), FLAGS)
    directory = directory or cache_dir() / "kernels"
    path = directory / f"decode_attention-{key}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        partial = Path(scratch) / path.name
        for command in _commands(partial):
            _run(command)
        os.replace(partial, path)  # whole or absent: another process may be building the same key
    return path


@functools.cache
def load() -> None:
    """Register torch.ops.omni_qwen_cpu.decode_attention in this process (once), and the shape of its output for
    torch.compile's tracing."""
    torch.ops.load_library(str(built()))

    @torch.library.register_fake("omni_qwen_cpu::decode_attention")
    def _output(q, k, v, kv, layer, slots, blocks, positions):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
