#!/usr/bin/env bash
# The foundation's GPU check, in one device call on the H100 machine (issue 2, acceptance 7):
# Llama-3-8B layer shapes with 8 layers (flavor 8B_L8), seq_len 8192, local batch 1, bf16 autocast, sdpa,
# 20 steps; prints median tps, TFLOP/s, MFU and peak memory after 5 warm-up steps.
#
#   device run (carry .whl):  bash bench/gpu_foundation.sh
#
# The machine has torch but not datasets/tomli_w: put their wheels in .whl/ first (README of the device tool):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl datasets dill multiprocess tomli_w
set -uo pipefail
source "$(dirname "$0")/common.sh"

run 8b_l8_bf16_sdpa --model.flavor 8B_L8 --training.seq_len 8192 --training.local_batch_size 1
