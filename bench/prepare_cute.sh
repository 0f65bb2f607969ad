#!/usr/bin/env bash
# Packs the `cute` extra for the GPU machine (no network there), for `bench_gpu.py --gemm-library quack`,
# `--attention-library fa4` and `bf16_error.py --fa4`: FlashAttention-4,
# quack-kernels and NVIDIA's CUTLASS Python DSL for CUDA 13, for the device's Python 3.12. Their
# wheels are 100 MB; unpacked and xz-compressed they are 72 MB, and one device call carries 64 MiB
# with the tracked tree (~32 MB) in it, so the archive is cut in 30 MB parts in .cute/ (git-ignored)
# that travel in three back-to-back calls (a carried path replaces .cute/ there, /tmp survives
# while the machine stays warm, and it is released after 30 s idle):
#   carry [".cute/site.tar.xz.part-aa"]: mkdir -p /tmp/parts && cp .cute/site.tar.xz.part-* /tmp/parts/
#   carry [".cute/site.tar.xz.part-ab"]: the same
#   carry [".cute/site.tar.xz.part-ac", ".whl"]:
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#     cp .cute/site.tar.xz.part-* /tmp/parts/ && mkdir -p /tmp/cute
#     cat /tmp/parts/site.tar.xz.part-* | tar -C /tmp/cute -xJf -
#     export PYTHONPATH=/tmp/site:/tmp/cute:/tmp/cute/nvidia_cutlass_dsl/dsl_packages:src  # the DSL's .pth
#     python3 bench/bench_gpu.py --lerobot --gemm-library quack   # or bf16_error.py --fa4
# cuda-bindings, einops and protobuf, which they also need, are in the device's image.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxs '/.cute/' .git/info/exclude || echo '/.cute/' >> .git/info/exclude
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$work/wheels" \
  flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
  torch-c-dlpack-ext==0.1.5
mkdir -p "$work/site" .cute
for wheel in "$work"/wheels/*.whl; do  # pure and platform wheels alike unpack into site-packages
  python3 -m zipfile -e "$wheel" "$work/site"
done
rm -f .cute/site.tar.xz.part-*
tar -C "$work/site" -cf - . | xz -T2 -6 | split -b 30M - .cute/site.tar.xz.part-
du -sh .cute/site.tar.xz.part-*
