#!/usr/bin/env bash
# On the development machine, before a device call that checks model.attn = flash_attn: FlashAttention 4
# (flash-attn-4, CuTe DSL kernels) and the packages it needs, for the GPU machine's Python 3.12, into .fa4/
# (git-ignored) in two parts: its nvidia-cutlass-dsl-libs-cu13 wheel (92 MB) is cut in two, since a device call
# carries at most 64 MiB, the working tree included. On the device, two calls in a row (a machine stays warm 30 s
# after a call and keeps /tmp):
#   carry .fa4/1:          bash bench/fa4_carry.sh 1
#   carry .fa4/2 and .whl: bash bench/fa4_carry.sh 2 && python3 bench/gpu_check.py
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .fa4
mkdir -p .fa4/all .fa4/1 .fa4/2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .fa4/all flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
  torch-c-dlpack-ext==0.1.5 quack-kernels==0.6.5
big=$(ls .fa4/all/nvidia_cutlass_dsl_libs_cu13-*.whl)
split -b 48M -d "$big" ".fa4/1/$(basename "$big").part"  # .part00 (48 MiB), .part01 (the rest)
mv .fa4/1/*.part01 .fa4/2/
rm "$big"
mv .fa4/all/*.whl .fa4/2/
rmdir .fa4/all
du -sh .fa4/1 .fa4/2   # each call: its part, plus the working tree (and .whl with part 2)
