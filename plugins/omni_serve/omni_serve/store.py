"""The video job store: one SQLite file (the standard library's sqlite3), by default `jobs.sqlite` in the server's
--output-dir, in WAL mode with synchronous=FULL, so a state change is on disk when its commit returns and a
`kill -9` at any moment leaves either the state before it or the state after it (SQLite's guarantees).

Each write (`write(kind, ...)`) is one transaction, committed before the API reports its state. A job's row holds
its answer (status, progress, error, file) and its request (pipeline, prompt, parameters as JSON, the stored
upload), so a job queued or in progress when the server died can be run again at the next start.

The store is held by one server at a time: an exclusive `flock` on `jobs.sqlite.lock` next to it (and one on the
output directory), released by the kernel when the process ends, however it ends. A store that cannot be opened,
is not a SQLite database or fails its integrity check refuses the start in one line that names the file and what
to do (`StoreUnusable`); nothing is moved or deleted behind the operator's back.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_kernel.core.errors import OmniError

log = logging.getLogger("omni")
SCHEMA_VERSION = 1
ON_RESTART = ("rerun", "fail")  # --on-restart: what becomes of a job in progress when the server died
# The kinds of state write, each its own transaction (the test hook and the docs name them).
KINDS = ("queued", "in_progress", "progress", "completed", "failed", "requeued", "deleted", "purged")
COLUMNS = ("id", "model", "pipeline", "created_at", "prompt", "size", "seconds", "params", "upload", "path",
           "status", "progress", "completed_at", "finished_at", "error", "attempts")
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- creation order (created_at has whole seconds)
    id TEXT UNIQUE NOT NULL,
    model TEXT NOT NULL,                    -- the name the client used
    pipeline TEXT NOT NULL,                 -- the served pipeline it ran on
    created_at INTEGER NOT NULL,
    prompt TEXT,
    size TEXT,
    seconds TEXT,
    params TEXT NOT NULL,                   -- the request's parameters, JSON
    upload TEXT,                            -- the stored input image, kept until the job ends
    path TEXT NOT NULL,                     -- the MP4 it writes
    status TEXT NOT NULL,                   -- queued, in_progress, completed, failed, deleted (files being removed)
    progress INTEGER NOT NULL DEFAULT 0,
    completed_at INTEGER,
    finished_at REAL,                       -- wall-clock time it completed or failed (the TTL runs from it)
    error TEXT,                             -- JSON {{code, message, param}}
    attempts INTEGER NOT NULL DEFAULT 1
);
PRAGMA user_version = {SCHEMA_VERSION};
"""

# A test hook: called as FAULT(kind, phase) at each state write, phase "during" (the row written, the transaction
# not committed) and "after" (committed, not yet reported), and FAULT("upload", "write") at each chunk of an upload
# written to disk. The tests' store_faults plugin sets it to SIGKILL the server or raise ENOSPC; None otherwise.
FAULT: Callable[[str, str], None] | None = None


class StoreUnusable(OmniError):
    """The store cannot be used: the server refuses to start (one line: the file, the reason, what to do)."""


class StoreWriteFailed(Exception):
    """A state write did not commit (the disk is full, the file went away): the request that made it fails alone."""

    def __init__(self, kind: str, cause: BaseException):
        self.kind = kind
        self.full = is_disk_full(cause)
        reason = "the disk is full (ENOSPC)" if self.full else f"{type(cause).__name__}: {cause}"
        super().__init__(f"the job store could not record this job's {kind} state: {reason}")


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL


def _hook(kind: str, phase: str) -> None:
    if FAULT is not None:
        FAULT(kind, phase)


class _Lock:
    """An exclusive flock on `path` (a file, created, holding the owner's pid; or a directory), or StoreUnusable."""

    def __init__(self, path: Path, what: str, directory: bool = False):
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY if directory else os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreUnusable(f"cannot open {path} ({exc.strerror or exc}): make it writable, or name another "
                                f"with {what}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = "" if directory else os.pread(self.fd, 32, 0).decode(errors="replace").strip()
            os.close(self.fd)
            by = f" (pid {owner})" if owner.isdigit() else ""
            raise StoreUnusable(f"{path} is in use by another omni serve{by}: two servers never share a job store "
                                f"or an output directory; stop that one, or give this one another {what}") from None
        if not directory:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = -1


def _refuse(path: Path, reason: str) -> StoreUnusable:
    return StoreUnusable(f"cannot use the job store {path}: {reason}; move it aside with its -wal and -shm files "
                         f"(e.g. mv {path} {path}.broken) to start with an empty store, or name another with "
                         f"--jobs-db")


class JobStore:
    """The open, locked store. Every method may be called from any thread (one connection, one lock)."""

    def __init__(self, path: Path, output_dir: Path | None = None):
        self.path = path
        self._locks: list[_Lock] = []
        self._mutex = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if output_dir is not None:
                output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnusable(f"cannot create {exc.filename or path.parent} ({exc.strerror or exc}): make its "
                                "parent writable, or name another with --output-dir / --jobs-db") from None
        if path.is_dir():
            raise _refuse(path, "it is a directory")
        self._locks.append(_Lock(path.with_name(path.name + ".lock"), "--jobs-db"))
        try:
            if output_dir is not None:
                self._locks.append(_Lock(output_dir, "--output-dir", directory=True))
            self.db = self._open()
        except BaseException:
            self.release()
            raise

    def _open(self) -> sqlite3.Connection:
        path = self.path
        try:
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=5)
        except sqlite3.Error as exc:
            raise _refuse(path, str(exc)) from None
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode != "wal":
                raise _refuse(path, f"its journal cannot be switched to WAL (it stays {mode!r})")
            db.execute("PRAGMA synchronous=FULL")
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise _refuse(path, f"it fails SQLite's integrity check ({check})")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise _refuse(path, f"it was written by a newer omni serve (schema {version}, this one reads "
                                    f"{SCHEMA_VERSION})")
            db.executescript(SCHEMA)
            found = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
            if missing := [c for c in COLUMNS if c not in found]:
                raise _refuse(path, f"its jobs table lacks {', '.join(missing)} (not an omni serve job store)")
        except sqlite3.Error as exc:  # "file is not a database", "database disk image is malformed", ...
            db.close()
            raise _refuse(path, str(exc)) from None
        except BaseException:
            db.close()
            raise
        return db

    def release(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks.clear()

    def close(self) -> None:
        with self._mutex:
            try:
                self.db.close()
            except sqlite3.Error:
                log.warning("closing the job store %s failed", self.path, exc_info=True)
        self.release()

    # Reads.

    def rows(self) -> list[dict[str, Any]]:
        """Every job, in creation order; params and error decoded."""
        with self._mutex:
            cursor = self.db.execute(f"SELECT {', '.join(COLUMNS)} FROM jobs ORDER BY seq")
            rows = [dict(zip(COLUMNS, r, strict=True)) for r in cursor.fetchall()]
        for row in rows:
            row["params"] = _params(row["params"])
            row["error"] = json.loads(row["error"]) if row["error"] else None
        return rows

    # Writes: each one transaction, committed when it returns (or StoreWriteFailed, and nothing changed).

    def insert(self, row: dict[str, Any]) -> None:
        values = {**row, "params": json.dumps(row["params"], default=str), "status": "queued",
                  "error": None}
        names = [c for c in COLUMNS if c in values]
        self._write("queued", f"INSERT INTO jobs ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                    [values[c] for c in names])

    def update(self, kind: str, job_id: str, **fields: Any) -> None:
        if "error" in fields:
            fields["error"] = None if fields["error"] is None else json.dumps(fields["error"])
        sets = ", ".join(f"{name} = ?" for name in fields)
        self._write(kind, f"UPDATE jobs SET {sets} WHERE id = ?", [*fields.values(), job_id])

    def purge(self, job_id: str) -> None:
        """The row of a job whose files are gone."""
        self._write("purged", "DELETE FROM jobs WHERE id = ?", [job_id])

    def _write(self, kind: str, sql: str, args: list[Any]) -> None:
        with self._mutex:
            try:
                self.db.execute("BEGIN IMMEDIATE")
                try:
                    self.db.execute(sql, args)
                    _hook(kind, "during")
                    self.db.execute("COMMIT")
                except BaseException:
                    if self.db.in_transaction:
                        self.db.execute("ROLLBACK")
                    raise
            except (sqlite3.Error, OSError) as exc:
                raise StoreWriteFailed(kind, exc) from exc
        _hook(kind, "after")


def _params(text: str) -> dict[str, Any]:
    """The request's parameters as they were given: a JSON list back to the tuple of a repeated option."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text or "{}").items()}
