"""The front's temporary directories (`omni-cores-PID-*`: the shared-cores board; `omni-run-PID-*`: an older
version's spilled arrays, now in shared memory, shared.py), named after the front's pid, and the sweep of those
whose front is gone.

A front removes its own at `close()` and at exit, but one killed by a signal's default action (SIGTERM, SIGKILL)
cannot: its workers die with it (PR_SET_PDEATHSIG) and the directories stay. The library installs no signal
handlers (that is the application's business), so instead the first directory a front makes sweeps the others:
one whose pid no longer exists is removed. A directory of a live front, of another user (which this one may not
even look at), or without a pid in its name (an older version's) is left alone; an error while removing one is
ignored.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

NAME = re.compile(r"omni-(run|cores)-(\d+)-")
_swept: list[int] = []  # the pid that swept (a forked child sweeps again)


def make_dir(kind: str) -> str:
    """A new temporary directory of this front (`kind`: "run" or "cores"), after sweeping the stale ones once."""
    if os.getpid() not in _swept:
        _swept.append(os.getpid())
        sweep()
    return tempfile.mkdtemp(prefix=f"omni-{kind}-{os.getpid()}-")


def sweep(root: str | None = None) -> list[str]:
    """Remove the directories under `root` (the temporary directory) whose front is gone; returns their paths."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = NAME.match(entry.name)
        try:
            if not match or not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not _alive(int(match.group(2))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): it exists
        return True
    return True
