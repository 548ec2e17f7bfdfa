"""The AR stage's dtype under `ar_dtype=auto` (the default): what this machine runs fastest, and why.

On a GPU it is the checkpoint's dtype. On a CPU it is bf16 where bf16 matmuls are fast: a CPU with AMX-BF16
(`amx_bf16` in /proc/cpuinfo) has bf16 tile units; one with only AVX512-BF16 (or Arm's bf16) may still run
bf16 slower than fp32 (on an AMD EPYC a batch-32 bf16 matmul took 4x the fp32 time, FACTS.md), so there a
short measurement of the model's own decode matmuls decides, cached in omni's cache directory under the CPU
model, its flags, the torch version and the shapes (the same home directory may move to another machine).
A CPU with no bf16 instructions at all runs fp32. auto never rounds an fp32 checkpoint down to bf16: its
owner chose fp32 (`ar_dtype=bf16` asks for it).
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from omni_kernel.util.files import cache_dir

SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
BF16_FLAGS = ("avx512_bf16", "bf16")  # x86's AVX512-BF16, Arm's BF16 (its /proc/cpuinfo "Features")
MEASURE_ROWS = 32  # the decode batch the measurement stands for
MEASURE_BYTES = 256 * 2**20  # of fp32 weights: well beyond a CPU's last-level cache


@attrs.frozen
class CpuInfo:
    model: str
    flags: frozenset[str]

    @classmethod
    def read(cls, path: Path = Path("/proc/cpuinfo")) -> CpuInfo:
        """The first processor's model name and flags (x86 "flags", Arm "Features"); no flags where there is no
        /proc/cpuinfo."""
        fields: dict[str, str] = {}
        try:
            lines = path.read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        model = fields.get("model name") or platform.processor() or platform.machine()
        return cls(model, frozenset((fields.get("flags") or fields.get("Features") or "").split()))

    def key(self, *extra: object) -> str:
        """A cache key naming this CPU (model and flags) and whatever else a measurement depends on."""
        text = json.dumps([self.model, sorted(self.flags), *map(str, extra)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@attrs.frozen
class DecodeShapes:
    """One decoder layer's matmul sizes, merged as the paged decoder runs them (q/k/v and gate/up as one)."""

    hidden: int
    q: int  # query heads x head_dim
    kv: int  # K/V heads x head_dim
    intermediate: int
    num_layers: int = 1

    @classmethod
    def of(cls, config) -> DecodeShapes:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        return cls(text.hidden_size, heads * head_dim, kv_heads * head_dim, text.intermediate_size,
                   text.num_hidden_layers)

    @property
    def weights(self) -> tuple[tuple[int, int], ...]:
        """(out, in) of qkv, o, gate_up and down."""
        h, i = self.hidden, self.intermediate
        return (self.q + 2 * self.kv, h), (h, self.q), (2 * i, h), (h, i)


@attrs.frozen
class Timing:
    fp32_ms: float
    bf16_ms: float

    @property
    def bf16_faster(self) -> bool:
        return self.bf16_ms < self.fp32_ms


@attrs.frozen
class Precision:
    """What auto (or the config) chose: `dtype` is bf16, fp32 or fp16; `reason` says why, for the load line
    and the trace (`ar.precision_reason`)."""

    dtype: str
    reason: str

    @property
    def torch_name(self) -> str:
        return {short: name for name, short in SHORT_NAMES.items()}[self.dtype]


def short_name(torch_dtype) -> str:
    """bf16, fp32 or fp16 for a torch dtype (or its name); other dtypes by torch's name."""
    name = str(torch_dtype).removeprefix("torch.")
    return SHORT_NAMES.get(name, name)


def time_matmuls(shapes: DecodeShapes, rounds: int = 5, reps: int = 2) -> Timing:
    """Median time of the layers' decode matmuls at MEASURE_ROWS rows, run as the paged decoder runs them
    (paged/linear.py), fp32 against bf16, alternating. Enough layers to stream their weights from memory, as a
    whole model does (at most MEASURE_BYTES of fp32, at most the model's)."""
    import torch

    from .paged.linear import Linear

    layer_bytes = 4 * sum(o * i for o, i in shapes.weights)
    num_layers = max(1, min(shapes.num_layers, MEASURE_BYTES // layer_bytes))

    def setup(dtype):
        x = {i: torch.full((MEASURE_ROWS, i), 0.5, dtype=dtype) for _, i in shapes.weights}
        return [(x[i], Linear(torch.full((o, i), 0.01, dtype=dtype))) for _ in range(num_layers)
                for o, i in shapes.weights]

    def run(pairs) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(reps):
                for x, linear in pairs:
                    linear(x)
        return (time.perf_counter() - start) * 1000 / reps

    fp32, bf16 = setup(torch.float32), setup(torch.bfloat16)
    run(fp32), run(bf16)  # warm-up: oneDNN picks and caches its kernels
    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for _ in range(rounds):
        times["fp32"].append(run(fp32))
        times["bf16"].append(run(bf16))
    return Timing(statistics.median(times["fp32"]), statistics.median(times["bf16"]))


def measured(cpu: CpuInfo, shapes: DecodeShapes, measure: Callable[[DecodeShapes], Timing] = time_matmuls,
             directory: Path | None = None) -> Timing:
    """The timing of `shapes` on this CPU, measured once and kept in omni's cache directory."""
    import torch

    path = (directory or cache_dir() / "ar-dtype") / f"{cpu.key(torch.__version__, attrs.astuple(shapes))}.json"
    try:
        return Timing(**{k: float(v) for k, v in json.loads(path.read_text())["timing"].items()})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    timing = measure(shapes)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"cpu": cpu.model, "flags": sorted(cpu.flags & {"amx_bf16", *BF16_FLAGS}), "torch": torch.__version__,
              "shapes": attrs.asdict(shapes), "timing": attrs.asdict(timing)}
    tmp = path.with_suffix(f".{time.monotonic_ns()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return timing


def cpu_precision(checkpoint: str, shapes: DecodeShapes, cpu: CpuInfo,
                  timing: Callable[[], Timing]) -> Precision:
    """auto on a CPU: bf16 or fp32 (see the module's docstring). `timing()` measures (or reads) bf16 against fp32."""
    if checkpoint == "fp32":
        return Precision("fp32", "the checkpoint is fp32 (auto does not round weights down; ar_dtype=bf16 asks)")
    if "amx_bf16" in cpu.flags:
        return Precision("bf16", f"the CPU ({cpu.model}) has AMX-BF16")
    native = sorted(cpu.flags & set(BF16_FLAGS))
    if not native:
        return Precision("fp32", f"the CPU ({cpu.model}) has no native bf16 (neither amx_bf16 nor avx512_bf16 "
                                 "in its flags)")
    t = timing()
    if t.bf16_faster:
        return Precision("bf16", f"the CPU ({cpu.model}) has {native[0]} without AMX, and bf16 matmuls measured "
                                 f"{t.fp32_ms / t.bf16_ms:.1f}x faster than fp32 at the model's batch-"
                                 f"{MEASURE_ROWS} decode shapes")
    return Precision("fp32", f"the CPU ({cpu.model}) has {native[0]} without AMX, and bf16 matmuls measured "
                             f"{t.bf16_ms / t.fp32_ms:.1f}x slower than fp32 at the model's batch-{MEASURE_ROWS} "
                             "decode shapes")


def choose(requested: str | None, device: str, config, cpu: CpuInfo | None = None,
           measure: Callable[[DecodeShapes], Timing] = time_matmuls) -> Precision:
    """The AR stage's dtype: `requested` (ar_dtype) unless it is auto/None; then the checkpoint's on a GPU,
    cpu_precision's on a CPU. `cpu` and `measure` are injectable (tests mask flags or fake the timing)."""
    from omni_hf import DTYPES

    checkpoint = short_name(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    if requested not in (None, "auto"):
        return Precision(short_name(DTYPES[requested]), f"ar_dtype={requested}")
    if not device.startswith("cpu"):
        return Precision(checkpoint, f"the checkpoint's dtype on {device}")
    cpu = cpu or CpuInfo.read()
    shapes = DecodeShapes.of(config)
    return cpu_precision(checkpoint, shapes, cpu, lambda: measured(cpu, shapes, measure))
