#!/usr/bin/env bash
# Prepares FlashAttention-3's forward for the GPU machine (no network there): the `fa3-fwd` wheel
# (28 MB; FA3's Hopper forward with key splits, packed GQA and head_dim 256, built for torch 2.10 on
# torch's stable C ABI, CUDA 13). Carry [".fa3"] with the device tool, then there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/fa3 .fa3/*.whl
#   export PYTHONPATH=/tmp/fa3:src
#   python3 bench/flash_probe.py --library fa3
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.fa3/' .git/info/exclude || echo '/.fa3/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_24_x86_64 -d .fa3 fa3-fwd==0.0.3
du -sh .fa3
