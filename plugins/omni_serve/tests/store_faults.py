"""A test plugin that injects faults into the job store of the `omni serve` process it is loaded in, as the
environment variable OMNI_TEST_STORE_FAULT says: `ACTION:KIND:N[:PHASE]` (several, comma-separated), at the Nth
write of KIND (a kind of state write of omni_serve/store.py, or `upload`: a chunk of an upload written to disk),
PHASE `during` (the row written, not committed; the default) or `after` (committed, not reported). ACTION `kill`
SIGKILLs the server (a crash at that very moment), `enospc` raises ENOSPC there (a full disk). It registers no
hooks."""

import errno
import os
import signal
import sys

from omni_serve import store

SPEC = os.environ.get("OMNI_TEST_STORE_FAULT", "")
seen: dict[tuple[str, str], int] = {}


def _fault(kind: str, phase: str) -> None:
    seen[(kind, phase)] = count = seen.get((kind, phase), 0) + 1
    for spec in SPEC.split(","):
        action, want, nth, *rest = spec.split(":")
        if kind == want and phase == (rest[0] if rest else ("write" if kind == "upload" else "during")) \
                and count == int(nth):
            _act(action, kind, nth, phase)


def _act(action: str, kind: str, nth: str, phase: str) -> None:
    if action == "kill":
        sys.stderr.write(f"store_faults: SIGKILL at {kind} #{nth} ({phase})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


if SPEC:
    store.FAULT = _fault


class StoreFaults:
    """Nothing to register: importing this module installed the fault."""
