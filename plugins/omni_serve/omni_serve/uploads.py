"""Uploaded input images, under `<output-dir>/.uploads`: a multipart file part is streamed to a temporary file
there as it arrives (chunk by chunk, written off the event loop), never held whole in memory, then renamed to
`<job id><suffix>` once complete and fsynced (atomic: a job's upload is either whole or absent). A data URL (a
text field, at most 1 MB as every form field, or a JSON body's) is decoded and written the same way.

A disk that fills while an upload is written fails that request alone (507 insufficient_storage); what it had
written is removed."""

from __future__ import annotations

import base64
import binascii
import errno
import io
import logging
import os
import re
import tempfile
from pathlib import Path

from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from . import store
from .protocol import APIError

log = logging.getLogger("omni")
DATA_URL = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,(.*)$", re.S)
TEMP_PREFIX = ".part-"


def disk_full(exc: OSError) -> APIError:
    return APIError(507, f"the server's disk is full ({os.strerror(exc.errno or errno.ENOSPC)}) while it stored "
                         "the upload; nothing was kept: free space on the server and retry", "input_reference",
                    "insufficient_storage", "server_error")


class _Spool(io.FileIO):
    """A temporary upload file; every chunk written passes the store's test hook (ENOSPC injection)."""

    def write(self, data) -> int:
        store._hook("upload", "write")
        return super().write(data)


class StoredFile(UploadFile):
    """A file part of the form, on disk in the uploads folder (`path`, temporary until adopted)."""

    path: Path


class _DiskParser(MultiPartParser):
    """Starlette's multipart parser, its file parts written to temporary files in `folder` instead of spooled in
    memory (up to 1 MB) and then in the system's temporary directory."""

    def __init__(self, *args, folder: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.folder = folder
        self.paths: list[Path] = []

    def on_headers_finished(self) -> None:
        super().on_headers_finished()
        part = self._current_part
        if part.file is None:
            return
        spooled = self._files_to_close_on_error.pop()
        spooled.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.folder, prefix=TEMP_PREFIX)
        os.close(fd)
        path = Path(name)
        self.paths.append(path)
        spool = _Spool(path, "w+b")
        self._files_to_close_on_error.append(spool)
        stored = StoredFile(file=spool, size=0, filename=part.file.filename, headers=part.file.headers)
        stored.path = path
        part.file = stored


class StreamedForm:
    """`async with StreamedForm(request, folder) as form:` the request's form, its file parts on disk; every
    temporary file not adopted is removed at the end."""

    def __init__(self, request: Request, folder: Path):
        self.request = request
        self.folder = folder
        self.parser: _DiskParser | None = None

    async def __aenter__(self) -> FormData:
        kind = self.request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "multipart/form-data":
            return await self.request.form()
        self.parser = _DiskParser(self.request.headers, self.request.stream(), folder=self.folder)
        try:
            form = await self.parser.parse()
        except MultiPartException as exc:
            self._remove()
            raise APIError(400, f"invalid request: {exc.message}", None, "invalid_value") from None
        except OSError as exc:
            self._remove()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full(exc) from None
            raise
        except BaseException:
            self._remove()
            raise
        for value in form.values():
            if isinstance(value, StoredFile):
                value.file.flush()
                os.fsync(value.file.fileno())
                value.file.close()
        return form

    async def __aexit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        if self.parser is None:
            return
        for path in self.parser.paths:
            path.unlink(missing_ok=True)
        for file in self.parser._files_to_close_on_error:
            file.close()


class Uploads:
    """The uploads folder of one output directory."""

    def __init__(self, folder: Path):
        self.folder = folder

    def target(self, job_id: str, filename: str | None) -> Path:
        suffix = Path(filename or "").suffix.lower()
        suffix = suffix if re.fullmatch(r"\.[a-z0-9]{1,5}", suffix) else ".img"
        return self.folder / f"{job_id}{suffix}"

    def adopt(self, job_id: str, stored: StoredFile) -> Path:
        """A streamed file part becomes the job's upload (a rename: atomic)."""
        path = self.target(job_id, stored.filename)
        os.replace(stored.path, path)
        return path

    def save(self, job_id: str, data: bytes, filename: str | None) -> Path:
        """Bytes (a decoded data URL) written as the job's upload: to a temporary file, fsynced, renamed."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.target(job_id, filename)
        fd, name = tempfile.mkstemp(dir=self.folder, prefix=TEMP_PREFIX)
        os.close(fd)
        try:
            with _Spool(name, "wb") as f:
                f.write(data)
                os.fsync(f.fileno())
            os.replace(name, path)
        except OSError as exc:
            Path(name).unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full(exc) from None
            raise
        return path

    @staticmethod
    def decode_data_url(text: str) -> bytes:
        match = DATA_URL.match(text.strip())
        if not match:
            raise APIError(400, "invalid input_reference: upload an image file or send a data:image/...;base64 URL "
                                "(the server fetches no URLs)", "input_reference")
        try:
            return base64.b64decode(match.group(1), validate=False)
        except (binascii.Error, ValueError):
            raise APIError(400, "invalid input_reference: the data URL is not valid base64",
                           "input_reference") from None

    def clean(self, keep: set[Path | None]) -> list[Path]:
        """Remove every file here but `keep` (the uploads of jobs that may still run); the folder too when it is
        left empty. Returns what was removed."""
        try:
            entries = list(self.folder.iterdir())
        except OSError:
            return []
        removed = []
        for entry in entries:
            if entry not in keep and entry.is_file():
                entry.unlink(missing_ok=True)
                removed.append(entry)
        try:
            self.folder.rmdir()
        except OSError:
            pass  # not empty: a queued job's upload
        return removed
