#!/usr/bin/env bash
# Once per checkout, on the development machine (it needs PyPI), before the first device call: puts in the
# repository root what the calls carry (bench/README.md), both folders git-ignored:
#   .anchor/  the reference trainer's kit and its wheels (../shared/bench/anchor/prepare.sh)
#   .whl/     the packages Tessera needs that the GPU machine's image lacks, for its Python 3.12
# bench/common.sh installs .whl there; the reference kit installs its own wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${ANCHOR_KIT:-../shared/bench/anchor}
[ -f "$KIT/prepare.sh" ] || { echo "error: no reference kit at $KIT/prepare.sh (set ANCHOR_KIT)" >&2; exit 1; }
bash "$KIT/prepare.sh" > /dev/null
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl torchao==0.17.0 tomli_w==1.2.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
du -sh .anchor .whl   # a call carries at most 64 MiB in all, the working tree included
