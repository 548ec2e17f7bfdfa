"""What crosses between a stage's worker (a process or a Ray actor) and the front.

Requests, events and stage outputs, as plain data pickled over a local Pipe between the runtime's own processes
(never anything read from a network socket). The worker pickles each event, and a call's answer, on its own
inside its message (`pack`), so one the front cannot unpickle fails its own request or call. Arrays in
`StageOutput.data` (frames) are written to a `.npy` file in the run's temporary directory and loaded (then
deleted) by the front. Torch-free: numpy and torch are touched only if a stage's output holds their arrays.
"""

from __future__ import annotations

import os
import uuid
from multiprocessing.reduction import ForkingPickler

import attrs

from omni_kernel.events import StageFailed, StageFinished


@attrs.frozen
class Spilled:
    """An array of StageOutput.data written to a .npy file; `torch` says to hand it back as a torch tensor, in
    `torch_dtype` when numpy has no such dtype (bfloat16 crosses as float32, which holds it exactly)."""

    path: str
    torch: bool = False
    torch_dtype: str | None = None


def spill(events: list, spill_dir: str | None) -> list:
    """Arrays in StageFinished outputs' data go to .npy files; everything else crosses as it is."""
    if spill_dir is None:
        return events
    out = []
    for event in events:
        if isinstance(event, StageFinished) and event.output.data is not None:
            event = attrs.evolve(event, output=attrs.evolve(event.output, data=_spill(event.output.data, spill_dir)))
        out.append(event)
    return out


def _spill(value, spill_dir: str):
    if isinstance(value, dict):
        return {k: _spill(v, spill_dir) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_spill(v, spill_dir) for v in value)
    module = type(value).__module__
    if module == "numpy" and hasattr(value, "dtype") and hasattr(value, "shape"):
        return _save(value, spill_dir, False)
    if module.startswith("torch") and hasattr(value, "detach"):
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":  # .numpy() refuses bfloat16 (a GPU stage's usual dtype)
            return _save(tensor.float().numpy(), spill_dir, True, "bfloat16")
        return _save(tensor.numpy(), spill_dir, True)
    return value


def _save(array, spill_dir: str, torch: bool, torch_dtype: str | None = None) -> Spilled:
    import numpy as np

    path = os.path.join(spill_dir, f"{uuid.uuid4().hex}.npy")
    np.save(path, array, allow_pickle=False)
    return Spilled(path, torch, torch_dtype)


def unspill(event):
    """An event with its output's spilled arrays loaded (and their files deleted)."""
    if isinstance(event, StageFinished) and event.output.data is not None:
        event = attrs.evolve(event, output=attrs.evolve(event.output, data=_unspill(event.output.data)))
    return event


def _unspill(value):
    if isinstance(value, dict):
        return {k: _unspill(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unspill(v) for v in value)
    if isinstance(value, Spilled):
        import numpy as np

        try:
            array = np.load(value.path, allow_pickle=False)
        finally:
            try:
                os.unlink(value.path)
            except OSError:
                pass
        if value.torch:
            import torch

            tensor = torch.from_numpy(array)
            return tensor.to(getattr(torch, value.torch_dtype)) if value.torch_dtype else tensor
        return array
    return value


def pack(message, node_id: str):
    """An `events` message is (tag, events, the stage's StageStats or None when unchanged). Each event (with its
    request id) and a call's answer are pickled on their own, so one that cannot be pickled here (an output
    holding a lock) or unpickled in the front (a class only the worker has) fails its own request or call, and
    the message around it always crosses."""
    if message[0] == "reply":
        _, call_id, ok, value = message
        return ("reply", call_id, *pack_answer(ok, value, node_id))
    if message[0] != "events":
        return message
    _, tag, events, stats = message
    return ("events", tag, [(event.request_id, pack_event(event, node_id)) for event in events], stats)


def pack_event(event, node_id: str) -> bytes:
    try:
        return dumps(event)
    except Exception as exc:  # noqa: BLE001 - this request only
        return dumps(StageFailed(event.request_id, node_id, unsendable(node_id, "output", exc), "runtime"))


def pack_answer(ok: bool, value, node_id: str) -> tuple[bool, bytes]:
    """A call's (ok, value or error) with the value pickled; one that cannot be is the call's error instead."""
    try:
        return ok, dumps(value)
    except Exception as exc:  # noqa: BLE001 - the caller gets the error instead of waiting forever
        return False, dumps(("runtime", unsendable(node_id, "processed input", exc), None))


def unsendable(node_id: str, what: str, exc: Exception) -> str:
    return f"stage {node_id!r}: its {what} could not be sent to the front ({type(exc).__name__}: {exc})"


def dumps(value) -> bytes:
    return bytes(ForkingPickler.dumps(value))
