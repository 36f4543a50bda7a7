#!/usr/bin/env bash
# Issue 77's GPU run from a fresh machine: installs the wheels the image lacks from .whl/ (filled here by
# scripts/gpu_wheels.sh), then runs scripts/gpu_check.py with its results in $OUT and the whole log in $OUT/log.txt.
#
#   device tool:  run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
#   bash scripts/gpu_check.sh --sections=peers,end_to_end     # arguments go on to gpu_check.py
#
# gpu_check.py's sections take 460 s at most (--budget_scale scales them); the install, about 10 s.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  echo "# $(date -u +%FT%TZ); $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    2>/dev/null || echo 'no nvidia-smi'); $(python3 --version)"
  packages="clu ml_collections grain array_record portpicker importlib_resources"
  pip=(python3 -m pip install --quiet --no-index --no-compile --disable-pip-version-check --root-user-action=ignore)
  # With their dependencies checked against the image's packages first; where that fails, the wheels alone.
  if ! "${pip[@]}" --find-links="$WHEELS" $packages; then
    echo "# installing $packages from $WHEELS with their dependencies failed: again without (--no-deps)"
    "${pip[@]}" --no-deps --upgrade --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site
  fi
  # The package from this checkout (it is not installed there).
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  python3 scripts/gpu_check.py --out="$OUT" "$@"
} 2>&1 | tee "$OUT/log.txt"
