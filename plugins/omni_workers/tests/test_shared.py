"""Arrays between the front and a worker process through shared memory (shared.py): over a real socketpair they
come back equal, in their dtype (bfloat16 included) and shape, the large ones as views of the received memory
file (no copy), the small ones inside the pickle; nothing is left in /dev/shm or the temp directory; an event whose
array cannot be put in shared memory fails its own request only."""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import socket
import sys
import tempfile
from pathlib import Path

import pytest

from omni_kernel import Omni
from omni_kernel.core.request import StageOutput
from omni_kernel.events import StageFailed, StageFinished
from omni_workers import shared
from omni_workers.messages import Events, Fds
from omni_workers.transport import pack

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from worker_fakes import in_memory_file, make_host  # noqa: E402 - the fakes module lives next to this one


def in_shared_memory(array) -> bool:
    """`array`'s memory (numpy, or a tensor's storage) lies in a mapping of one of omni's memory files."""
    return in_memory_file(array.data_ptr() if isinstance(array, torch.Tensor) else array.ctypes.data)


def entries(path: str) -> set[str]:
    return set(os.listdir(path)) if os.path.isdir(path) else set()


def segments() -> set[str]:
    """The /dev/shm segments that shared memory from Python or torch would leave (other programs' aside)."""
    return {name for name in entries("/dev/shm") if name.startswith(("psm_", "torch_", "omni", "pymp"))}


@pytest.fixture
def pipe():
    a, b = socket.socketpair()
    front = multiprocessing.connection.Connection(a.detach())
    back = multiprocessing.connection.Connection(b.detach())
    yield front, back
    front.close()
    back.close()


def cross(value, pipe):
    """`value` sent down one end as a worker sends, and read at the other as the front reads."""
    front, back = pipe
    fds: list = []
    data = shared.dumps(value, fds)
    shared.send(back, data, fds)
    header = front.recv()
    if isinstance(header, Fds):
        shared.take_fds(front, header.names)
        header = front.recv()
    return header


def test_arrays_cross_in_their_dtype_and_the_large_ones_without_a_copy(pipe, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = segments()
    value = {"latents": torch.randn(16, 21, 32, 32).to(torch.bfloat16), "ids": [torch.arange(4)],
             "frames": np.random.default_rng(0).integers(0, 255, (17, 64, 64, 3), dtype=np.uint8),
             "small": np.arange(6, dtype=np.float32).reshape(2, 3), "embeds": torch.randn(1, 512, 256)}
    back = cross(value, pipe)
    assert back["latents"].dtype == torch.bfloat16 and torch.equal(back["latents"], value["latents"])
    assert back["ids"][0].dtype == torch.int64 and torch.equal(back["ids"][0], value["ids"][0])
    assert back["embeds"].shape == (1, 512, 256) and torch.equal(back["embeds"], value["embeds"])
    assert back["frames"].dtype == np.uint8 and np.array_equal(back["frames"], value["frames"])
    assert np.array_equal(back["small"], value["small"])
    for name in ("latents", "embeds", "frames"):
        assert in_shared_memory(back[name]), name
    assert not in_shared_memory(back["small"])
    back["frames"][0, 0, 0, 0] ^= 1  # writable, as a pickled array is
    assert segments() == before and list(tmp_path.iterdir()) == []
    assert not shared._ARRIVED


def test_an_event_whose_array_cannot_be_shared_fails_its_own_request(monkeypatch):
    def no_memory(*args):
        raise OSError(12, "Cannot allocate memory")

    big = StageFinished("big", "wan", StageOutput("big", "wan", data={"frames": np.zeros(2 ** 20, dtype=np.uint8)}))
    fine = StageFinished("fine", "wan", StageOutput("fine", "wan", data={"frames": np.ones(4)}))
    monkeypatch.setattr(shared.os, "memfd_create", no_memory)
    fds: list = []
    message = pack(Events(0, (big, fine)), "wan", fds)
    (rid_big, data_big), (rid_fine, data_fine) = ((e.request_id, e.data) for e in message.events)
    failed = pickle.loads(data_big)
    assert rid_big == "big" and isinstance(failed, StageFailed) and "Cannot allocate memory" in failed.error
    assert failed.error.startswith("stage 'wan': its output could not be sent to the front")
    assert rid_fine == "fine" and np.array_equal(pickle.loads(data_fine).output.data["frames"],
                                                   np.ones(4))
    assert fds == []


def test_a_processed_input_and_a_hand_off_cross_through_shared_memory():
    """A big processed input stays in its worker; a big hand-off crosses to the next stage's worker in shared
    memory."""
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        assert o.generate("a big_input please").text == "rendered 3 words"
        trace = o.generate("a big_handoff please").trace
        assert trace["render.embeds_sum"] == float(np.arange(2 ** 18, dtype=np.float32).sum())
        assert trace["render.embeds_mapped"] is True


def test_a_worker_output_crosses_through_shared_memory_and_leaves_nothing():
    before = segments()
    with Omni("fake_slow", host=make_host(), placement="process") as o:
        frames = o.generate("big frames please").output.data["frames"]
        assert frames.shape == (2, 2 ** 15, 4) and frames.sum() == sum(range(2 ** 18))
        assert in_shared_memory(frames)
    assert segments() == before
