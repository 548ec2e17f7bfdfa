"""Files: atomic outputs (a reader never sees a half-written file, a failure leaves none behind), the checks
an output path passes before any work starts, and the cache directory where omni keeps what it builds."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omni_kernel.core.errors import InvalidParameter

# Room kept in a file name for the temporary name an atomic write uses (".NAME.XXXXXXXX.tmp.mp4") and for
# names derived from it (out.mp4 -> out.trace.json).
NAME_RESERVE = 32
AT_FDCWD, AT_EMPTY_PATH = -100, 0x1000  # linkat(2)


def check_output_path(path: str | Path, field: str = "output") -> Path:
    """The absolute path an output will be written to, or InvalidParameter(field) saying why it cannot be:
    an existing directory or special file (a device, a FIFO, a socket), a name too long for its file system, or
    a parent that is a file, or not a writable directory. Missing parent directories are created at write time,
    so the nearest existing one must be writable. Nothing is left behind by the check."""
    target = Path(os.path.abspath(Path(path).expanduser()))
    try:
        return _check_output_path(target, field)
    except OSError as exc:  # e.g. ENAMETOOLONG, ELOOP, EACCES while looking
        raise InvalidParameter(field, f"cannot use {str(target)[:80]!r}: {exc.strerror or exc}") from None


def _check_output_path(target: Path, field: str) -> Path:
    _check_target(target, field)
    existing, missing = _existing_parent(target, field)
    _check_name_lengths(existing, missing, field)
    _probe_writable(existing, field)
    return target


def _check_target(target: Path, field: str) -> None:
    """The target itself: a file name, and a regular file if it exists."""
    shown = str(target)
    if not target.name:
        raise InvalidParameter(field, f"{shown!r} names no file")
    if target.is_dir():
        raise InvalidParameter(field, f"{shown!r} is a directory; name a file in it")
    if os.path.lexists(target) and target.exists():
        mode = os.stat(target).st_mode
        if not stat.S_ISREG(mode):
            raise InvalidParameter(field, f"{shown!r} is a {_kind(mode)}, not a regular file; omni never writes "
                                          "over one")


def _existing_parent(target: Path, field: str) -> tuple[Path, list[str]]:
    """The nearest folder above the target that exists, and the names to create below it (the target's last)."""
    existing = target.parent
    missing: list[str] = [target.name]
    while not existing.exists():
        if os.path.lexists(existing):  # a dangling symlink
            raise InvalidParameter(field, f"{str(existing)!r} is a broken symbolic link")
        missing.append(existing.name)
        existing = existing.parent
    if not existing.is_dir():
        raise InvalidParameter(field, f"{str(existing)!r} is not a directory, so {str(target)!r} cannot be created")
    return existing, missing


def _check_name_lengths(existing: Path, missing: list[str], field: str) -> None:
    try:
        name_max = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for name in missing:
        size = len(os.fsencode(name))
        if size + NAME_RESERVE > name_max:
            raise InvalidParameter(field, f"the name {name[:40]!r}... is {size} bytes; this file system allows "
                                          f"names of at most {name_max - NAME_RESERVE} bytes here")


def _probe_writable(folder: Path, field: str) -> None:
    """Create and remove a file in `folder`: the one check that also holds for root, read-only mounts and ACLs."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".omni-probe-")
    except OSError as exc:
        raise InvalidParameter(field, f"cannot write in {str(folder)!r}: {exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(name)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"


def refuse_special(path: Path) -> None:
    """Raise OSError when `path` exists and is not a regular file (an atomic rename would replace it)."""
    if path.exists() and not path.is_file():
        raise IsADirectoryError(f"{path} is a directory") if path.is_dir() else OSError(
            f"{path} is a {_kind(path.stat().st_mode)}, not a regular file; not replaced")


@contextmanager
def atomic_path(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path next to `path`; it replaces `path` when the block ends, and is removed on error.
    A `path` that is a directory or a special file (/dev/null, a FIFO) is never replaced.

    Where the file system allows (Linux O_TMPFILE), the temporary file has no name until it replaces `path`: the
    path yielded is this process's descriptor of it (/proc/PID/fd/N, which a child such as ffmpeg may open too),
    so a process killed by any signal, SIGKILL included, leaves nothing behind. Elsewhere it is a hidden file
    (".NAME.XXXXXXXX" + `suffix`) that such a kill leaves (remove_atomic_leftovers)."""
    path = Path(path)
    refuse_special(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _unnamed_file(path.parent)
    if fd is None:
        with _named_temporary(path, suffix) as tmp:
            yield tmp
        return
    try:
        yield Path(f"/proc/{os.getpid()}/fd/{fd}")
        os.fchmod(fd, 0o666 & ~UMASK)
        refuse_special(path)  # it may have appeared while the output was written
        _link(fd, path)
    finally:
        os.close(fd)


def _unnamed_file(folder: Path) -> int | None:
    """A new file in `folder` with no name (O_TMPFILE), or None where the platform or file system has none."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, flag | os.O_RDWR, 0o600)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None
        raise


def _link(fd: int, path: Path) -> None:
    """Give the unnamed file `fd` the name `path`, replacing what is there: named under a fresh hidden name
    first, then renamed over `path` (a link cannot replace a file)."""
    name = path.parent / f".{path.name}.{os.urandom(4).hex()}.tmp"
    if not _linkat(fd, name):
        with open(name, "xb") as copy:  # no way to link it here: its bytes, copied
            os.lseek(fd, 0, os.SEEK_SET)
            while chunk := os.read(fd, 1 << 20):
                copy.write(chunk)
            os.fsync(copy.fileno())
        os.chmod(name, 0o666 & ~UMASK)
    try:
        os.replace(name, path)
    except BaseException:
        name.unlink(missing_ok=True)
        raise


def _linkat(fd: int, name: Path) -> bool:
    """linkat(fd, "", AT_EMPTY_PATH), else through /proc/self/fd; False where neither is allowed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.linkat(fd, b"", AT_FDCWD, os.fsencode(name), AT_EMPTY_PATH) == 0:
            return True
    except (OSError, AttributeError):
        pass
    try:
        os.link(f"/proc/self/fd/{fd}", name, follow_symlinks=True)
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.ENOENT, errno.EACCES):
            return False
        raise
    return True


@contextmanager
def _named_temporary(path: Path, suffix: str) -> Iterator[Path]:
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~UMASK)  # mkstemp makes 0600; outputs get the usual file mode
        refuse_special(path)  # it may have appeared while the output was written
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# What atomic_path names its temporary file: "." + the output's name + "." + mkstemp's 8 characters + the suffix.
_ATOMIC_TMP = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp(\.[A-Za-z0-9]{1,8})?$")


def remove_atomic_leftovers(folder: str | Path, name: str | re.Pattern | None = None) -> list[str]:
    """Remove the temporary files of atomic writes into `folder` (of outputs named `name`, or whose name matches
    the pattern, or any) that were never renamed: what a process killed while it wrote an output leaves behind.
    Returns the paths removed."""
    try:
        entries = [e for e in Path(folder).iterdir() if _ATOMIC_TMP.match(e.name) and e.is_file()]
    except OSError:
        return []
    targets = {e: _ATOMIC_TMP.match(e.name).group("name") for e in entries}
    return remove_outputs(sorted(e for e, t in targets.items() if name is None
                                 or (t == name if isinstance(name, str) else name.fullmatch(t))))


def write_json(path: str | Path, body: Any, indent: int | None = 2) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(body, f, ensure_ascii=False, indent=indent)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def remove_outputs(paths) -> list[str]:
    """Remove files a failed request wrote; returns the ones removed."""
    removed = []
    for p in paths:
        if p and os.path.isfile(p):
            try:
                os.unlink(p)
                removed.append(str(p))
            except OSError:
                pass
    return removed


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _read_umask()  # read once at import: os.umask can only be read by setting it, a race under threads


def cache_dir() -> Path:
    """OMNI_CACHE_DIR, or omni/ under the user's cache directory."""
    explicit = os.environ.get("OMNI_CACHE_DIR")
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(explicit).expanduser() if explicit else Path(base) / "omni"
