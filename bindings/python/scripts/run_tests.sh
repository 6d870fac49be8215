#!/usr/bin/env bash
# Runs the kvferry Python tests (bindings/python/tests) with pytest, for
# `make test-python`. Extra arguments go to pytest.
#
# The library is the one KVFERRY_LIBRARY names (the Makefile passes
# $(BUILD_DIR)/libkvferry.so; tests/conftest.py picks build/ otherwise).
# pytest is installed when missing: into $PYTHON's environment when pip may
# write there (a venv, pyenv), else into a venv of our own that still sees the
# system's packages (Debian's python3 refuses pip installs, PEP 668).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
python=${PYTHON:-python3}
build_dir=${BUILD_DIR:-$repo/build}
case "$build_dir" in /*) ;; *) build_dir="$repo/$build_dir" ;; esac

if ! "$python" -c 'import pytest' 2>/dev/null; then
  echo "test-python: pytest missing for $python; installing it"
  if ! "$python" -m pip install -q --disable-pip-version-check pytest 2>/dev/null; then
    venv="$build_dir/python-test-venv"
    if [ ! -x "$venv/bin/python" ]; then
      "$python" -m venv --system-site-packages "$venv"
    fi
    if ! "$venv/bin/python" -c 'import pytest' 2>/dev/null; then
      "$venv/bin/python" -m pip install -q --disable-pip-version-check pytest
    fi
    python="$venv/bin/python"
  fi
fi

# NumPy arrays are one of the memory kinds the binding registers: install
# NumPy for the tests when it can be (never imported by kvferry itself);
# offline, those tests skip and say why.
if [ "${KVFERRY_TEST_NO_NUMPY:-}" != 1 ] && ! "$python" -c 'import numpy' 2>/dev/null; then
  echo "test-python: installing numpy for the tests that register NumPy arrays"
  timeout 300 "$python" -m pip install -q --disable-pip-version-check numpy >/dev/null 2>&1 ||
    echo "test-python: could not install numpy (offline?); its tests will skip"
fi

# prometheus_client parses the metrics text in the metrics tests and is what
# register_prometheus feeds (kvferry never imports it unless asked); offline,
# those tests skip and say why.
if [ "${KVFERRY_TEST_NO_PROMETHEUS:-}" != 1 ] && ! "$python" -c 'import prometheus_client' 2>/dev/null; then
  echo "test-python: installing prometheus_client for the metrics tests"
  timeout 300 "$python" -m pip install -q --disable-pip-version-check prometheus_client >/dev/null 2>&1 ||
    echo "test-python: could not install prometheus_client (offline?); its tests will skip"
fi

# The Go runtime reads the environment the process was started with, not
# os.environ: a developer's KVFERRY_PROTOCOL or MC_TRANSFER_TIMEOUT must not
# reach pytest's own process (tests/conftest.py cleans it for the children).
if [ "${KVFERRY_TEST_KEEP_ENV:-}" != 1 ]; then
  for v in $(compgen -e); do
    case "$v" in
      KVFERRY_LIBRARY|KVFERRY_TEST_*) ;;
      KVFERRY_*|MC_TRANSFER_TIMEOUT) unset "$v" ;;
    esac
  done
fi

# Side by side with the real thing: the SGLang-style shim script also runs
# against PyPI's mooncake-transfer-engine-non-cuda when it can be installed
# (into a venv of its own, kept in the build folder); offline, that test
# skips and says why. KVFERRY_TEST_NO_MOONCAKE=1 skips the install.
if [ -z "${KVFERRY_TEST_MOONCAKE_PYTHON:-}" ] && [ "${KVFERRY_TEST_NO_MOONCAKE:-}" != 1 ]; then
  mc="$build_dir/mooncake-venv"
  if [ ! -x "$mc/bin/python" ] || ! "$mc/bin/python" -c 'import mooncake.engine' 2>/dev/null; then
    echo "test-python: installing mooncake-transfer-engine-non-cuda into $mc for the side-by-side test"
    rm -rf "$mc"
    if ! { "$python" -m venv "$mc" && timeout 300 "$mc/bin/python" -m pip install -q --disable-pip-version-check \
        mooncake-transfer-engine-non-cuda; } >/dev/null 2>&1; then
      echo "test-python: could not install Mooncake (offline?); its side-by-side test will skip"
      rm -rf "$mc"
    fi
  fi
  if [ -x "$mc/bin/python" ] && "$mc/bin/python" -c 'import mooncake.engine' 2>/dev/null; then
    export KVFERRY_TEST_MOONCAKE_PYTHON="$mc/bin/python"
  fi
fi

cd "$repo/bindings/python"
# -ra: the reason of every skip, xfail and failure in the summary (a skip is
# never a pass); no cache directory in the source tree.
exec "$python" -m pytest -ra -p no:cacheprovider --durations=5 "$@"
