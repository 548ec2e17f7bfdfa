"""Extract the part of OpenAI's pinned API description that omni serves, for the conformance tests.

    python plugins/omni_serve/tests/openapi/extract.py [PATH-TO/openapi.json]

The source is the official `openai/openai-openapi` document at commit SOURCE_COMMIT (3.4 MB; in a development
checkout at ../shared/openai-openapi/openapi.json). Its sha256 is checked, then the operations in PATHS are kept,
with every `#/components/...` they reach through `$ref` (transitively) and the security scheme; nothing else is
changed. The result is `openai-subset.json` beside this script (about 140 KB), whose own sha256 goes into
SHA256SUMS; `openai_spec.load()` checks both, and a test re-runs this extraction when the source is present.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
DEFAULT_SOURCE = ROOT.parent / "shared" / "openai-openapi" / "openapi.json"
SOURCE_REPOSITORY = "openai/openai-openapi"
SOURCE_COMMIT = "f85dbe223d40e1a31cba812ab2d755c7e98a92a3"
SOURCE_SHA256 = "bbfd19abcde0e7412da99378deb2a959ccdd3a812f97c9e35901921e8e973f9a"
SUBSET = HERE / "openai-subset.json"
# The operations omni serves (OpenAI paths are relative to the /v1 server URL).
PATHS = {"/chat/completions": ["post"], "/completions": ["post"], "/models": ["get"], "/models/{model}": ["get"],
         "/videos": ["post", "get"], "/videos/{video_id}": ["get", "delete"], "/videos/{video_id}/content": ["get"],
         "/audio/speech": ["post"], "/audio/transcriptions": ["post"]}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _node(doc: dict, ref: str):
    node = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _refs(obj, doc: dict, seen: set[str]) -> None:
    if isinstance(obj, dict):
        ref = obj.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/") and ref not in seen:
            seen.add(ref)
            _refs(_node(doc, ref), doc, seen)
        for value in obj.values():
            _refs(value, doc, seen)
    elif isinstance(obj, list):
        for value in obj:
            _refs(value, doc, seen)


def extract(source: bytes) -> bytes:
    """The subset document (deterministic bytes) of the pinned source document."""
    if sha256(source) != SOURCE_SHA256:
        raise SystemExit(f"the source is not the pinned document (sha256 {sha256(source)}, want {SOURCE_SHA256})")
    doc = json.loads(source)
    paths = {path: {m: doc["paths"][path][m] for m in methods} for path, methods in PATHS.items()}
    seen: set[str] = set()
    _refs(paths, doc, seen)
    components: dict = {"securitySchemes": doc["components"]["securitySchemes"]}
    for ref in sorted(seen):
        section, name = ref.removeprefix("#/components/").split("/", 1)
        components.setdefault(section, {})[name] = _node(doc, ref)
    subset = {"openapi": doc["openapi"], "info": doc["info"], "servers": doc["servers"], "security": doc["security"],
              "paths": paths, "components": components,
              "x-omni-source": {"repository": SOURCE_REPOSITORY, "commit": SOURCE_COMMIT, "file": "openapi.json",
                                "sha256": SOURCE_SHA256, "extracted_by": "plugins/omni_serve/tests/openapi/extract.py"}}
    return (json.dumps(subset, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode()


def main(argv: list[str]) -> None:
    source = Path(argv[0]) if argv else DEFAULT_SOURCE
    data = extract(source.read_bytes())
    SUBSET.write_bytes(data)
    (HERE / "SHA256SUMS").write_text(f"{SOURCE_SHA256}  openapi.json (source, {SOURCE_REPOSITORY}@{SOURCE_COMMIT})\n"
                                     f"{sha256(data)}  openai-subset.json\n")
    print(f"{SUBSET.relative_to(ROOT)}: {len(data)} bytes, {len(json.loads(data)['components']['schemas'])} schemas")


if __name__ == "__main__":
    main(sys.argv[1:])
