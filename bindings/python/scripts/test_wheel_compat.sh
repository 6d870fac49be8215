#!/usr/bin/env bash
# Checks the manylinux_2_28 wheel of `make wheel-compat`: runs
# bindings/python/tests_wheel (its maximum GLIBC symbol version, the licence
# texts it ships, auditwheel's verdict and a smoke transfer from a fresh venv).
# Extra arguments go to pytest.
#
# The wheel: $KVFERRY_COMPAT_WHEEL, else the one kvferry-*.whl in
# $KVFERRY_COMPAT_DIR (default dist/compat/). Skips, exit 0 and the reason
# said, when there is nothing to check (no such wheel) or no pytest to run
# the checks with. Builds nothing and downloads nothing.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
python=${PYTHON:-python3}
export KVFERRY_COMPAT_DIR=${KVFERRY_COMPAT_DIR:-$repo/dist/compat}
# Absolute: pytest runs from bindings/python.
[ -z "${KVFERRY_COMPAT_WHEEL:-}" ] || export KVFERRY_COMPAT_WHEEL=$(readlink -f "$KVFERRY_COMPAT_WHEEL")

if [ -z "${KVFERRY_COMPAT_WHEEL:-}" ] && ! compgen -G "$KVFERRY_COMPAT_DIR/kvferry-*.whl" >/dev/null; then
  echo "test-wheel-compat: SKIPPED: no wheel in $KVFERRY_COMPAT_DIR to check; 'make wheel-compat' builds one" \
       "(the first build needs ziglang from PyPI and Debian's zeromq3 source package)"
  exit 0
fi

# pytest: from the wheel-compat tool venv (auditwheel is there too), or the
# python given.
for p in "$repo/build/wheel-compat/venv/bin/python" "$python"; do
  if [ -x "$(command -v "$p" || true)" ] && "$p" -c 'import pytest' 2>/dev/null; then
    cd "$repo/bindings/python"
    exec "$p" -m pytest -ra -v -p no:cacheprovider tests_wheel "$@"
  fi
done
echo "test-wheel-compat: SKIPPED: no pytest for $python nor in build/wheel-compat/venv" \
     "('make wheel-compat' installs it there)"
