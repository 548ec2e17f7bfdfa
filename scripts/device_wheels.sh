#!/bin/sh
# Run here (with the package registries), before scripts/device_check.sh goes to a GPU machine of the device tool:
# the wheels of what the Wan stage needs and that machine's image lacks (its python3 is 3.12 with torch,
# transformers, accelerate, safetensors, pillow, numpy, sentencepiece and protobuf), into .whl/ (git-ignored).
# imageio-ffmpeg 0.6.0: its ffmpeg is half the size of 0.8's, and the tree that travels is limited to 64 MiB.
set -eu
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl diffusers==0.42.1 imageio-ffmpeg==0.6.0 ftfy==6.3.1 wcwidth==0.2.13
ls -l .whl
