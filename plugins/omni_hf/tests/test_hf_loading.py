"""omni_hf with real torch, transformers and diffusers: the pickle ban, quiet logs, dtype names, devices, the pool."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from omni_hf import DTYPE_NAMES, ModelPool, quiet_hf_load, resolve_device, torch_dtype

from omni_kernel.core.errors import InvalidParameter, ModelError

torch.set_num_threads(1)
REAL_LOAD = torch.load


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def omni_records(omni_logger):
    handler = Records()
    omni_logger.handlers[:], omni_logger.propagate = [handler], False
    omni_logger.setLevel(logging.DEBUG)
    return handler.records


@pytest.mark.cli_subprocess
def test_importing_omni_hf_imports_no_torch():
    code = "import sys, omni_hf; assert not {'torch', 'transformers', 'diffusers'} & set(sys.modules), sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.fixture
def pickle_file(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(2)}, path)
    return path


def test_torch_load_of_a_pickle_is_refused_inside_and_allowed_outside(pickle_file):
    with quiet_hf_load(["transformers"]):
        with pytest.raises(ModelError, match=r"unpickle a file \(torch.load\); omni loads safetensors only"):
            torch.load(pickle_file, weights_only=True)
    assert torch.load is REAL_LOAD
    assert torch.equal(torch.load(pickle_file, weights_only=True)["w"], torch.ones(2))
    with pytest.raises(RuntimeError, match="boom"), quiet_hf_load(["transformers"]):
        raise RuntimeError("boom")
    assert torch.load is REAL_LOAD  # restored when the block fails too


def test_a_transformers_load_of_pickled_weights_is_refused(tmp_path):
    """The path a pickled checkpoint takes through transformers ends at the ban, as one ModelError."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    config.save_pretrained(tmp_path)
    torch.save(GPT2LMHeadModel(config).state_dict(), tmp_path / "pytorch_model.bin")  # the pickled layout
    with quiet_hf_load(["transformers"]), pytest.raises(ModelError, match="unpickle"):
        GPT2LMHeadModel.from_pretrained(tmp_path, use_safetensors=False)


def test_blocks_in_two_threads_keep_the_ban_until_the_last_one_ends(pickle_file):
    """Thread A enters, B enters, A leaves first: B's load is still refused, and after B torch.load is back."""
    a_in, b_in, a_out, b_checked = (threading.Event() for _ in range(4))
    seen = {}

    def a():
        with quiet_hf_load(["transformers"]):
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with quiet_hf_load(["transformers", "diffusers"]):
            b_in.set()
            a_out.wait(5)
            seen["banned"] = torch.load is not REAL_LOAD
            b_checked.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert b_checked.is_set() and seen["banned"]
    assert torch.load is REAL_LOAD


def test_library_logs_and_warnings_go_to_the_omni_log_at_debug(omni_records, capsys):
    import diffusers.utils.logging as dlog
    import transformers.utils.logging as tlog

    tlog.enable_progress_bar()
    dlog.enable_progress_bar()
    roots = [tlog.get_logger(), dlog.get_logger()]
    before = [(r.handlers[:], r.level, r.propagate) for r in roots]
    with quiet_hf_load(["transformers", "diffusers"]):
        assert not tlog.is_progress_bar_enabled() and not dlog.is_progress_bar_enabled()
        tlog.get_logger("transformers.modeling_utils").warning("some weights were not used")
        dlog.get_logger("diffusers.models").error("a load report")
        warnings.warn("a deprecation", FutureWarning, stacklevel=1)
    assert tlog.is_progress_bar_enabled() and dlog.is_progress_bar_enabled()
    assert [(r.handlers[:], r.level, r.propagate) for r in roots] == before
    messages = [(r.levelno, r.getMessage()) for r in omni_records]
    assert messages == [(logging.DEBUG, "transformers.modeling_utils: some weights were not used"),
                        (logging.DEBUG, "diffusers.models: a load report"),
                        (logging.DEBUG, "FutureWarning: a deprecation")]
    captured = capsys.readouterr()
    assert "some weights" not in captured.err + captured.out and "a load report" not in captured.err


def test_an_uninstalled_library_is_refused_before_anything_changes():
    with pytest.raises(ModuleNotFoundError), quiet_hf_load(["no_such_library"]):
        pass
    assert torch.load is REAL_LOAD


def test_dtype_names():
    assert DTYPE_NAMES == ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
    expected = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    assert {name: torch_dtype(name) for name in expected} == expected
    assert torch_dtype(None) is None and torch_dtype("auto") is None
    with pytest.raises(InvalidParameter, match="invalid ar_dtype: 'int8' is not one of auto, float32") as info:
        torch_dtype("int8", "ar_dtype")
    assert info.value.field == "ar_dtype"


def test_devices(monkeypatch):
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(InvalidParameter, match="invalid ar_device: 'tpu-9' is not a torch device"):
        resolve_device("tpu-9", "ar_device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == resolve_device("auto") == "cpu"
    with pytest.raises(InvalidParameter, match="invalid device: 'cuda' asks for CUDA but no CUDA device"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device(None) == "cuda" and resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(InvalidParameter, match=r"'cuda:1' asks for a CUDA device that is not there \(torch sees 1"):
        resolve_device("cuda:1")


def test_the_pool_loads_a_key_once_under_concurrent_threads_cold_then_warm():
    calls = []

    def load(key):
        calls.append(key)
        time.sleep(0.05)  # long enough that every thread arrives while the load runs
        return torch.nn.Linear(2, 2)

    pool = ModelPool(load)
    start = threading.Barrier(8)
    results = []

    def acquire():
        start.wait(5)
        results.append(pool.acquire(("dir", "cpu")))

    threads = [threading.Thread(target=acquire) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert calls == [("dir", "cpu")] and len(results) == 8
    cold = [r for r in results if r.cold]
    assert len(cold) == 1 and cold[0].load_ms >= 40
    assert all(r.model is cold[0].model and r.key == ("dir", "cpu") and r.load_ms == 0.0
               for r in results if not r.cold)
    again = pool.acquire(("dir", "cpu"))
    assert not again.cold and again.model is cold[0].model and ("dir", "cpu") in pool and len(pool) == 1
    assert pool.values() == [again.model]
    pool.clear()
    assert pool.acquire(("dir", "cpu")).cold and len(calls) == 2


def test_the_pool_loads_other_keys_meanwhile_and_caches_no_failure():
    """A slow load of one key does not hold up another key's load; a failed load is tried again next time."""
    slow_started, other_loaded = threading.Event(), threading.Event()
    failures = iter([True])

    def load(key):
        if key == "slow":
            slow_started.set()
            assert other_loaded.wait(5), "the other key waited for this load"
        elif key == "flaky" and next(failures, False):
            raise ModelError("broken once")
        else:
            other_loaded.set()
        return key.upper()

    pool = ModelPool(load)
    slow = threading.Thread(target=pool.acquire, args=("slow",))
    slow.start()
    assert slow_started.wait(5)
    assert pool.acquire("fast").model == "FAST"
    slow.join(10)
    assert "slow" in pool
    with pytest.raises(ModelError, match="broken once"):
        pool.acquire("flaky")
    assert "flaky" not in pool
    loaded = pool.acquire("flaky")
    assert loaded.cold and loaded.model == "FLAKY"
