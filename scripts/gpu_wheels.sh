#!/usr/bin/env bash
# Fills .whl/ (git-ignored: .gitignore's /.whl/) with the wheels that the GPU machines' image lacks, for
# scripts/gpu_check.sh to install there, where nothing can be downloaded. Run it here, where PyPI is reachable:
#
#   bash scripts/gpu_wheels.sh [FOLDER]     # default .whl; 4.7 MB of wheels
#
# The image (the device tool's KINDS.md) has Python 3.12 with JAX, Flax, optax, orbax, TensorBoard and PyTorch, and
# every dependency of these wheels but importlib_resources (etils' epath extra): --no-deps keeps JAX, Flax and the
# rest out of the folder, which travels with each device call (64 MiB at most). The versions are the ones this
# checkout is tested with.
set -euo pipefail
cd "$(dirname "$0")/.."
folder=${1:-.whl}
packages=(clu==0.0.12 ml_collections==1.1.0 grain==0.2.18 array_record==0.8.6 portpicker==1.6.0
          importlib_resources==7.1.0)
mkdir -p "$folder"
for package in "${packages[@]}"; do  # one version of each in the folder
  rm -f "$folder/${package%%==*}"-*.whl
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$folder" "${packages[@]}"
ls -l "$folder"
git check-ignore -q "$folder" 2>/dev/null || echo "warning: $folder is not git-ignored: it must not be committed" >&2
