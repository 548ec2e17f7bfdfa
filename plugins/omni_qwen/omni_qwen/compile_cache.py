"""Where the compiled decode step (`ar_compile`, paged/graph.py) is cached across processes, and whether a load
found it there.

Inductor keeps its artefacts in TORCHINDUCTOR_CACHE_DIR (default /tmp/torchinductor_$USER). omni points it at
its own cache directory, under a key of the CPU and the torch version (`$OMNI_CACHE_DIR/compile/<key>/`), so a
run with a fresh OMNI_CACHE_DIR (`make test`'s) compiles as a new user's first run does, and a home directory
that moves to another machine does not reuse code built for another CPU. Inside it, inductor's FX graph cache keys
each graph by its code, shapes and dtypes (the model), inductor's settings and torch.

The decode step is compiled with freezing, which packs the weights for oneDNN into mkldnn tensors. torch 2.13's
FX graph cache refuses every graph holding one ("mkldnn tensors unpickleable"), so each load lowered and
generated the whole graph again (about 40 s of SmolLM2's compile). Yet it caches frozen weights by their
metadata alone and takes their values from the graph being compiled on a hit (CompiledFxGraphConstantsWithGm);
a packed weight is such a frozen weight, so `install()` has the cache treat it the same way: keyed by its dtype,
shape and packed size. Its packing (oneDNN's layout for this CPU) is redone at every load, by freezing, before
the cache is asked.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch._inductor import codecache
from torch._inductor.freezing_utils import is_frozen_param

from omni_kernel.util.files import cache_dir

from .precision import CpuInfo


def directory() -> Path:
    """This machine's and this torch's compile cache under omni's cache directory."""
    return cache_dir() / "compile" / CpuInfo.read().key(torch.__version__)


def use() -> Path:
    """Point inductor at omni's compile cache (before it compiles; it reads the variable at each use) and let its
    FX graph cache take graphs with packed weights. The directory is returned."""
    path = directory()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    install()
    return path


def _packed(tensor: torch.Tensor) -> bool:
    return tensor.is_mkldnn and is_frozen_param(tensor)


@functools.cache
def install() -> None:
    """FxGraphCache keys a frozen mkldnn weight by its metadata, as it keys every other frozen weight."""
    reduce_tensor = codecache.FxGraphCachePickler._reduce_tensor
    check_tensor = codecache.CacheabilityValidator.check_tensor

    def _reduce(self, tensor):
        if _packed(tensor):
            return codecache._ident, (("mkldnn", str(tensor.dtype), tuple(tensor.shape),
                                       torch.ops.mkldnn._nbytes(tensor)),)
        return reduce_tensor(self, tensor)

    def _check(tensor):
        if not _packed(tensor):
            check_tensor(tensor)

    codecache.FxGraphCachePickler._reduce_tensor = _reduce
    codecache.CacheabilityValidator.check_tensor = staticmethod(_check)


def graph_counts() -> tuple[int, int]:
    """(hits, misses) of inductor's FX graph cache in this process so far."""
    inductor = counters["inductor"]
    return inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]
