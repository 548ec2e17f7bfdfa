#!/bin/sh
# Run here (with the package registries), before scripts/device_check.sh goes to a GPU machine of the device tool:
# the py3.12 manylinux wheels of what this project needs and that machine's image lacks or has in another version,
# into .whl/ (git-ignored), which the run carries: run(command="sh scripts/device_check.sh", carry=[".whl"]).
# The image (/work/.library/device/KINDS.md) has torch 2.11, accelerate, safetensors, pillow, numpy, sentencepiece,
# protobuf, tokenizers 0.23.2, huggingface-hub 1.33, imageio, tqdm, click, attrs, pluggy, httpx, and:
# - transformers 5.17, whose models take `past_key_values=` where omni_qwen passes `cache=`: 5.24 travels;
# - no diffusers, imageio-ffmpeg (0.6.0: its ffmpeg is half the size of 0.8's), ftfy (+ wcwidth);
# - no fastapi, starlette, pydantic (+ core, annotated-types, typing-inspection), opentelemetry-api, uvicorn,
#   python-multipart (omni_serve), nor openai (+ httpx2, httpcore2, truststore, jiter, sniffio): the serve check;
# - typing-extensions, anyio, h11, idna and prometheus-client of unknown versions: the ones tested here travel;
# - setuptools of an unknown version builds this tree's distributions there: the one that builds them here travels.
# The tree that travels is at most 64 MiB with carried paths: the total is printed and checked (56 MiB at most).
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl \
    diffusers==0.42.1 imageio-ffmpeg==0.6.0 ftfy==6.3.1 wcwidth==0.2.13 transformers==5.24.0 \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 \
    python-multipart==0.0.34 prometheus-client==0.26.0 anyio==4.16.0 h11==0.16.0 idna==3.20 \
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 \
    setuptools==84.2.1
ls -l .whl
wheels=$(du -sk .whl | cut -f1)
tree=$(git ls-files -z | xargs -0 du -ck | tail -1 | cut -f1)
echo "wheels: $((wheels / 1024)) MiB; tracked tree: $((tree / 1024)) MiB; together $(((wheels + tree) / 1024)) MiB of 64"
[ $((wheels + tree)) -le $((56 * 1024)) ] || { echo "over 56 MiB: the device tool refuses a tree over 64 MiB" >&2; exit 1; }
