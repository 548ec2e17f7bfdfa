"""ar_dtype=auto: the dtype chosen from the CPU's flags (injected here, never this machine's) and, where the flags
prove nothing, from a measurement (faked here) cached under the CPU's model and flags."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from omni_qwen import precision
from omni_qwen.precision import CpuInfo, DecodeShapes, Timing

BF16_CONFIG = SimpleNamespace(dtype="bfloat16", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=128, num_hidden_layers=2)
FP32_CONFIG = SimpleNamespace(**{**vars(BF16_CONFIG), "dtype": "float32"})
BASE_FLAGS = frozenset("fpu sse sse2 avx avx2 fma avx512f avx512bw".split())
PLAIN = CpuInfo("Plain CPU", BASE_FLAGS)
AMX = CpuInfo("Xeon with AMX", BASE_FLAGS | {"avx512_bf16", "amx_bf16", "amx_tile"})
EPYC = CpuInfo("AMD EPYC", BASE_FLAGS | {"avx512_bf16"})


def never(shapes):
    raise AssertionError("the flags decide: nothing is measured")


def timing(fp32_ms: float, bf16_ms: float):
    calls = []

    def measure(shapes):
        calls.append(shapes)
        return Timing(fp32_ms, bf16_ms)

    return measure, calls


def test_without_native_bf16_auto_is_fp32_and_says_why():
    chosen = precision.choose("auto", "cpu", BF16_CONFIG, cpu=PLAIN, measure=never)
    assert chosen.dtype == "fp32"
    assert "no native bf16" in chosen.reason and "Plain CPU" in chosen.reason
    assert precision.choose(None, "cpu", BF16_CONFIG, cpu=PLAIN, measure=never) == chosen


def test_with_amx_bf16_auto_is_bf16():
    chosen = precision.choose("auto", "cpu", BF16_CONFIG, cpu=AMX, measure=never)
    assert chosen.dtype == "bf16" and "AMX-BF16" in chosen.reason


def test_an_fp32_checkpoint_stays_fp32_even_with_amx():
    chosen = precision.choose("auto", "cpu", FP32_CONFIG, cpu=AMX, measure=never)
    assert chosen.dtype == "fp32" and "checkpoint is fp32" in chosen.reason


@pytest.mark.parametrize(("fp32_ms", "bf16_ms", "dtype", "words"), [(1.0, 4.0, "fp32", "4.0x slower"),
                                                                    (2.0, 1.0, "bf16", "2.0x faster")])
def test_avx512_bf16_alone_is_decided_by_the_measurement(tmp_path, monkeypatch, fp32_ms, bf16_ms, dtype, words):
    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    measure, calls = timing(fp32_ms, bf16_ms)
    chosen = precision.choose("auto", "cpu", BF16_CONFIG, cpu=EPYC, measure=measure)
    assert chosen.dtype == dtype
    assert words in chosen.reason and "avx512_bf16 without AMX" in chosen.reason
    assert calls == [DecodeShapes(64, 64, 32, 128, 2)]


def test_the_measurement_is_cached_per_cpu_model_and_flags(tmp_path):
    shapes = DecodeShapes.of(BF16_CONFIG)
    measure, calls = timing(1.0, 3.0)
    assert precision.measured(EPYC, shapes, measure, tmp_path) == Timing(1.0, 3.0)
    assert precision.measured(EPYC, shapes, measure, tmp_path) == Timing(1.0, 3.0)
    assert len(calls) == 1 and len(list(tmp_path.glob("*.json"))) == 1
    other_flags = CpuInfo(EPYC.model, EPYC.flags | {"avx512_fp16"})
    other_model = CpuInfo("AMD EPYC 9654", EPYC.flags)
    assert len({EPYC.key(), other_flags.key(), other_model.key()}) == 3
    precision.measured(other_flags, shapes, measure, tmp_path)
    precision.measured(other_model, shapes, measure, tmp_path)
    assert len(calls) == 3 and len(list(tmp_path.glob("*.json"))) == 3


def test_an_explicit_dtype_and_a_gpu_keep_their_dtype():
    assert precision.choose("fp32", "cpu", BF16_CONFIG, cpu=AMX, measure=never).dtype == "fp32"
    assert precision.choose("bfloat16", "cpu", FP32_CONFIG, cpu=PLAIN, measure=never).dtype == "bf16"
    on_gpu = precision.choose("auto", "cuda:0", BF16_CONFIG, cpu=PLAIN, measure=never)
    assert on_gpu.dtype == "bf16" and "checkpoint's dtype on cuda:0" in on_gpu.reason


def test_cpuinfo_reads_model_and_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx512_bf16 avx2\n\n"
                    "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    assert CpuInfo.read(path) == CpuInfo("AMD EPYC", frozenset({"fpu", "avx512_bf16", "avx2"}))
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert "bf16" in CpuInfo.read(tmp_path / "arm").flags


def test_the_load_line_and_trace_say_what_auto_chose(qwen25_dir, monkeypatch, caplog):
    """A bf16 checkpoint on a CPU whose flags are masked: loaded in fp32, and the log line and trace say why (a
    host of its own: the session's may hold the model loaded under this machine's flags)."""
    from omni_kernel import Omni
    from omni_kernel.plugins import load_host

    monkeypatch.setattr(CpuInfo, "read", classmethod(lambda cls, path=None: PLAIN))
    with caplog.at_level(logging.INFO, logger="omni"):
        omni = Omni("ar_text", host=load_host(), ar_model=str(qwen25_dir), ar_device="cpu")
        result = omni.generate("hi", max_tokens=2)
    assert result.trace["ar.dtype"] == "fp32"
    assert "no native bf16" in result.trace["ar.precision_reason"]
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("AR model "))
    assert " in fp32: " in line and "no native bf16" in line
