"""Arrays between the front and a worker process through shared memory: no copy to disk, nothing left behind.

`dumps` pickles a value as ForkingPickler does, except that each numpy array and torch tensor of `MIN_BYTES` or
more is copied once into an anonymous memory file (Linux memfd_create) instead of into the pickle: the pickle
holds a token, and the memory file's descriptor is collected in `fds`. `send` writes a header naming the tokens,
passes the descriptors over the worker's Unix socket (SCM_RIGHTS, multiprocessing.reduction.sendfds) and then the
message; the receiver maps each descriptor (`take_fds`) and the unpickled array is a view of that mapping, no
copy. A memory file has no name anywhere (not in /dev/shm, not in the temp directory), and the kernel frees it
when its last descriptor and mapping are gone, so a process killed at any moment leaves nothing behind.

Smaller arrays, and tensors where no memfd exists, cross inside the pickle by value (their bytes), never through
torch's own ForkingPickler reductions, whose descriptors are fetched from a listener thread of the sender's with
the sender's authkey (a fresh interpreter has another) and a socket file in a temp directory.
"""

from __future__ import annotations

import io
import mmap
import os
import socket
import uuid
from multiprocessing.reduction import ForkingPickler, recvfds, sendfds

from .messages import Fds

MIN_BYTES = 64 * 1024  # smaller arrays cross inside the pickle
NUMERIC = "biufc"  # numpy dtype kinds whose bytes are the whole array (no objects)
_ARRIVED: dict[str, mmap.mmap] = {}  # token -> the mapping of a memory file received, until its array is loaded


class SharedPickler(ForkingPickler):
    """ForkingPickler with arrays and tensors moved out (see the module docstring); `fds` collects
    (token, descriptor) pairs, which the caller sends or closes."""

    def __init__(self, file, fds: list):
        super().__init__(file)
        self.fds = fds

    def reducer_override(self, obj):
        module = type(obj).__module__
        if module == "numpy" and type(obj).__name__ == "ndarray" and obj.dtype.kind in NUMERIC:
            return self._array(obj, False, str(obj.dtype))
        if module.startswith("torch") and type(obj).__name__ in ("Tensor", "Parameter") and not obj.is_sparse:
            return self._tensor(obj)
        return NotImplemented

    def _tensor(self, tensor):
        """A tensor's bytes as a numpy uint8 view (numpy has no bfloat16), rebuilt in its dtype and shape."""
        torch = _torch()
        tensor = tensor.detach().cpu().contiguous()
        flat = tensor.reshape(-1).view(torch.uint8) if tensor.numel() else torch.zeros(0, dtype=torch.uint8)
        return self._array(flat.numpy(), True, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))

    def _array(self, array, torch: bool, dtype: str, shape: tuple | None = None):
        import numpy as np

        shape = tuple(array.shape) if shape is None else shape
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if data.nbytes < MIN_BYTES or not hasattr(os, "memfd_create"):
            return _rebuild, (data.tobytes(), torch, dtype, shape)
        token = uuid.uuid4().hex
        fd = os.memfd_create("omni-array", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, data.nbytes)
            with mmap.mmap(fd, data.nbytes) as target:
                target.write(memoryview(data))  # the one copy
        except BaseException:
            os.close(fd)
            raise
        self.fds.append((token, fd))
        return _attach, (token, data.nbytes, torch, dtype, shape)


def _torch():
    import torch

    return torch


def dumps(value, fds: list) -> bytes:
    """`value` pickled with its large arrays in memory files whose (token, descriptor) pairs go to `fds`; none
    is left open when it raises."""
    buffer = io.BytesIO()
    mark = len(fds)
    try:
        SharedPickler(buffer, fds).dump(value)
    except BaseException:
        close(fds[mark:])
        del fds[mark:]
        raise
    return buffer.getvalue()


def close(fds: list) -> None:
    for _, fd in fds:
        os.close(fd)


def send(conn, data: bytes, fds: list) -> None:
    """`data` down `conn` (a Connection over a Unix socket), after the descriptors it refers to; closes them."""
    try:
        if fds:
            conn.send_bytes(ForkingPickler.dumps(Fds([token for token, _ in fds])))
            with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sendfds(sock, [fd for _, fd in fds])
        conn.send_bytes(data)
    finally:
        close(fds)


def take_fds(conn, tokens: list[str]) -> None:
    """Receive the descriptors announced by an `Fds` message and map them, for the message that follows."""
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        fds = recvfds(sock, len(tokens))
    for token, fd in zip(tokens, fds):
        try:
            _ARRIVED[token] = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)


def forget(tokens: list[str]) -> None:
    """Unmap what a message brought and did not load (an event dropped, or one the front could not read)."""
    for token in tokens:
        mapping = _ARRIVED.pop(token, None)
        if mapping is not None:
            mapping.close()


def _attach(token: str, nbytes: int, torch: bool, dtype: str, shape: tuple):
    try:
        mapping = _ARRIVED.pop(token)
    except KeyError:
        raise LookupError(f"shared array {token} ({nbytes} bytes) did not arrive") from None
    if torch:
        t = _torch()
        return t.frombuffer(mapping, dtype=t.uint8, count=nbytes).view(getattr(t, dtype)).reshape(shape)
    import numpy as np

    return np.frombuffer(mapping, dtype=np.uint8, count=nbytes).view(dtype).reshape(shape)


def _rebuild(data: bytes, torch: bool, dtype: str, shape: tuple):
    if torch:
        t = _torch()
        raw = t.frombuffer(bytearray(data), dtype=t.uint8) if data else t.zeros(0, dtype=t.uint8)
        return raw.view(getattr(t, dtype)).reshape(shape)
    import numpy as np

    return np.frombuffer(bytearray(data), dtype=np.uint8).view(dtype).reshape(shape)
