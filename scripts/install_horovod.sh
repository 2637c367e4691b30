#!/usr/bin/env bash
# Build (once) and install Horovod 0.28.1 against the torch of the given virtual environment.
#
# Horovod's last release, 0.28.1, sets CMAKE_CXX_STANDARD 14, while torch >= 2.1 headers need C++17
# (horovod#3996; the fix, horovod PR #3998, is on master but in no release). This script downloads the
# sdist, raises the standard to 17 in the two CMake files that set it, builds a wheel with Gloo and MPI
# for the CPU, and caches the wheel outside the repository, keyed by the torch and Python versions, so
# that later installs on the same machine take seconds. It is idempotent.
#
# Usage: scripts/install_horovod.sh [PYTHON]   (default: .venv/bin/python)
# Environment: HETERO_PLUGINS_CACHE (default ~/.cache/hetero_plugins) holds the cached wheels.
set -euo pipefail

PY=${1:-.venv/bin/python}
HVD_VERSION=0.28.1
# sha256 of horovod-0.28.1.tar.gz as served by PyPI; pip refuses any other file (--require-hashes).
HVD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
CACHE=${HETERO_PLUGINS_CACHE:-$HOME/.cache/hetero_plugins}
# The venv's bin holds mpicc/mpicxx (the mpich wheel) and cmake: Horovod's CMake must find them.
PATH="$(cd "$(dirname "$PY")" && pwd):$PATH"
export PATH

if "$PY" -c "import horovod.torch" >/dev/null 2>&1; then
  echo "install_horovod: horovod already importable in $PY"
  exit 0
fi

need() {
  command -v "$1" >/dev/null 2>&1 || {
    echo "install_horovod: '$1' was not found. HINT: $2" >&2
    exit 1
  }
}
need gcc "install a C/C++ compiler (Debian/Ubuntu: apt-get install build-essential)"
need g++ "install a C++ compiler (Debian/Ubuntu: apt-get install g++)"
need make "install make (Debian/Ubuntu: apt-get install make)"
"$PY" -m pip install -q "cmake>=3.13" >/dev/null 2>&1 || need cmake "install CMake >= 3.13 (pip install cmake)"

TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
PY_TAG=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
WHEEL_DIR="$CACHE/wheels/horovod-$HVD_VERSION-torch$TORCH_VERSION-$PY_TAG"
mkdir -p "$WHEEL_DIR"

# The cached wheel is installed only if it matches the hash recorded when it was built here.
if ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  if ! (cd "$WHEEL_DIR" && sha256sum --quiet -c SHA256SUMS) >/dev/null 2>&1; then
    echo "install_horovod: the cached wheel in $WHEEL_DIR does not match the hash recorded at its build" \
      "(or none was recorded); rebuilding it" >&2
    rm -f "$WHEEL_DIR"/horovod-*.whl "$WHEEL_DIR/SHA256SUMS"
  fi
fi

if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
  echo "install_horovod: building Horovod $HVD_VERSION against torch $TORCH_VERSION (about 12 minutes on 2 cores, once)"
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  echo "horovod==$HVD_VERSION --hash=sha256:$HVD_SDIST_SHA256" >"$WORK/requirements.txt"
  "$PY" -m pip download -q --no-deps --no-binary :all: --require-hashes -r "$WORK/requirements.txt" -d "$WORK"
  tar -xzf "$WORK/horovod-$HVD_VERSION.tar.gz" -C "$WORK"
  SRC="$WORK/horovod-$HVD_VERSION"
  for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || { echo "install_horovod: unexpected $f (no C++14 line)" >&2; exit 1; }
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
  done
  "$PY" -m pip install -q wheel setuptools >/dev/null
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
  HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  MAKEFLAGS=${MAKEFLAGS:--j$(nproc)} \
    "$PY" -m pip wheel --no-build-isolation --no-deps --no-cache-dir -w "$WORK/dist" "$SRC"
  cp "$WORK"/dist/horovod-*.whl "$WHEEL_DIR/"
  (cd "$WHEEL_DIR" && sha256sum horovod-*.whl >SHA256SUMS)
fi

"$PY" -m pip install -q --no-deps "$WHEEL_DIR"/horovod-*.whl
# Horovod's own run-time requirements (its wheel was installed without them).
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging
"$PY" -c "import horovod.torch" || { echo "install_horovod: installed, but 'import horovod.torch' fails" >&2; exit 1; }
echo "install_horovod: Horovod $HVD_VERSION installed from $WHEEL_DIR"
