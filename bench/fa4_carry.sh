#!/usr/bin/env bash
# On the GPU machine: bash bench/fa4_carry.sh 1, then (the next call) bash bench/fa4_carry.sh 2 (bench/prepare_fa4.sh
# says what each call carries). Part 1 is kept in FA4_PARTS (/tmp/fa4_parts: /tmp outlives calls on a warm machine);
# part 2 completes the wheels, which are unzipped into one folder, FA4_SITE (/tmp/site_fa4; pip --target would
# not merge the wheels that share nvidia_cutlass_dsl/), and FlashAttention 4 is imported from there once.
# bench/gpu_check.py puts FA4_SITE on the runs' path when it exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PARTS=${FA4_PARTS:-/tmp/fa4_parts}
SITE=${FA4_SITE:-/tmp/site_fa4}
case "${1:-}" in
  1|2) ;;
  *) echo "error: give the part: bash bench/fa4_carry.sh 1 (carry .fa4/1), then 2 (carry .fa4/2)" >&2; exit 2 ;;
esac
[ -d ".fa4/$1" ] || { echo "error: .fa4/$1 did not travel: run bash bench/prepare_fa4.sh, and carry .fa4/$1" >&2; exit 2; }
mkdir -p "$PARTS"
cp .fa4/"$1"/* "$PARTS"/
echo "part $1: $(ls .fa4/"$1" | wc -l) file(s) kept in $PARTS"
[ "$1" = 2 ] || exit 0
for first in "$PARTS"/*.part00; do
  [ -e "$first" ] || { echo "error: part 1 is missing from $PARTS: run part 1 first, on the same warm machine" >&2; exit 2; }
  cat "${first%.part00}".part* > "${first%.part00}"
  rm "${first%.part00}".part*
done
rm -rf "$SITE"
mkdir -p "$SITE"
python3 - "$SITE" "$PARTS"/*.whl <<'PY'
import os, sys, zipfile
for wheel in sys.argv[2:]:  # with each file's mode (the wheels' tools and libraries keep their x bits)
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, sys.argv[1])
            if info.external_attr >> 16:
                os.chmod(path, (info.external_attr >> 16) & 0o777)
PY
PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}" \
  python3 -c "import flash_attn.cute; print('FlashAttention 4 imports from', flash_attn.cute.__file__)"
