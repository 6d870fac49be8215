#!/usr/bin/env bash
# Proves a repaired kvferry wheel loads and works without the system's libzmq.
#
#   check_wheel.sh WHEEL [UNBUNDLED_LIBRARY [WORK_DIR]]
#
# WHEEL              the repaired wheel (dist/kvferry-*.whl from `make wheel`)
# UNBUNDLED_LIBRARY  a libkvferry.so linked against the system libzmq
#                    (default build/libkvferry.so): the negative control
# WORK_DIR           scratch for a fresh venv (default build/python-wheel)
#
# 1. Installs the wheel into a fresh venv (no index, no dependencies).
# 2. Static: libkvferry.so's NEEDED names only the hashed libzmq copy and its
#    RPATH is $ORIGIN/../kvferry.libs, and ldd resolves libzmq (and every
#    other library auditwheel bundled) inside the installed package.
# 3. Dynamic, with the system libzmq hidden: in a private mount namespace
#    (unshare -m; nothing outside the namespace changes) every file the
#    system loader knows of libzmq and of each other library the wheel
#    bundles is covered by a bind mount of /dev/null. Control: the
#    unbundled library must then fail to load, naming libzmq. Test: the
#    wheel's smoke test (two engines, 1 MiB over ZMQ + TCP, byte-checked, and
#    /proc/self/maps shows libzmq mapped only from the wheel) must pass.
# 4. With CHECK_WHEEL_SUITE=1, also the whole pytest suite (tests/) against
#    the installed wheel (KVFERRY_TEST_INSTALLED=1), with the same libraries
#    hidden; pytest is installed into the venv for it (PyPI).
# Without the privilege for a mount namespace, steps 3 and 4 run with the
# system libraries present (the maps check still shows which copy was
# loaded) and the script says the hiding was skipped.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
wheel=$(readlink -f "${1:?usage: check_wheel.sh WHEEL [UNBUNDLED_LIBRARY [WORK_DIR]]}")
control=$(readlink -f "${2:-$repo/build/libkvferry.so}")
work=$(mkdir -p "${3:-$repo/build/python-wheel}" && cd "${3:-$repo/build/python-wheel}" && pwd) # absolute: the checks run from /
python=${PYTHON:-python3}
smoke="$repo/bindings/python/scripts/wheel_smoke.py"

venv="$work/check-venv"
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps "$wheel"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
so="$site/kvferry/libkvferry.so"
echo "check_wheel: installed $(basename "$wheel") into $site"

# --- 2. static ---------------------------------------------------------------
dyn=$(readelf -d "$so")
echo "$dyn" | grep -E 'NEEDED|RPATH|RUNPATH'
if echo "$dyn" | grep -q 'Shared library: \[libzmq\.so'; then
  echo "check_wheel: FAIL: libkvferry.so still needs the system's libzmq.so" >&2; exit 1
fi
echo "$dyn" | grep -q 'R.*PATH.*\$ORIGIN/\.\./kvferry\.libs' ||
  { echo "check_wheel: FAIL: no \$ORIGIN/../kvferry.libs RPATH" >&2; exit 1; }
deps=$(ldd "$so")
if echo "$deps" | grep -q 'not found'; then
  echo "$deps" >&2; echo "check_wheel: FAIL: unresolved libraries" >&2; exit 1
fi
zmq_path=$(echo "$deps" | awk '$1 ~ /^libzmq/ {print $3}')
if [ -z "$zmq_path" ] || [ "$(dirname "$(readlink -f "$zmq_path")")" != "$(readlink -f "$site/kvferry.libs")" ]; then
  echo "$deps" >&2; echo "check_wheel: FAIL: libzmq does not resolve inside the wheel" >&2; exit 1
fi
echo "check_wheel: ldd resolves libzmq inside the wheel:"
echo "$deps" | grep 'kvferry.libs' | sed 's/ (0x.*//'

# --- 3. dynamic, system libzmq hidden ---------------------------------------
# Every system file of every library the wheel bundles (libzmq, libsodium,
# libpgm, libnorm, Kerberos, libbsd, ...), as the system loader knows them,
# symlinks resolved: the stem of kvferry.libs/libfoo-<hash>.so.N is libfoo.
zmq_files=()
for f in "$site"/kvferry.libs/*; do
  stem=$(basename "$f"); stem=${stem%%-*}
  while IFS= read -r p; do zmq_files+=("$(readlink -f "$p")"); done < <(
    ldconfig -p | awk -v s="$stem" '$1 ~ ("^" s "[.-]") {print $NF}')
done
mapfile -t zmq_files < <(printf '%s\n' "${zmq_files[@]}" | sort -u)
printf '%s\n' "${zmq_files[@]}" | grep -q libzmq ||
  { echo "check_wheel: FAIL: the system loader knows no libzmq to hide" >&2; exit 1; }
inner=$(cat <<'EOF'
set -euo pipefail
for f in "$@"; do mount --bind /dev/null "$f"; done
echo "check_wheel: [namespace] hid (bind-mounted /dev/null over) $*"
if python3 -c 'import ctypes, sys; ctypes.CDLL(sys.argv[1])' "$CONTROL" 2>/tmp/check_wheel_control.$$; then
  echo "check_wheel: FAIL: the unbundled control library still loads: libzmq was not hidden" >&2; exit 1
fi
grep -q libzmq /tmp/check_wheel_control.$$ ||
  { cat /tmp/check_wheel_control.$$ >&2; echo "check_wheel: FAIL: control failed for another reason" >&2; exit 1; }
echo "check_wheel: [namespace] control: $CONTROL fails to load: $(tail -1 /tmp/check_wheel_control.$$)"
rm -f /tmp/check_wheel_control.$$
cd / && env -u KVFERRY_LIBRARY "$VENV_PY" "$SMOKE"
if [ "$SUITE" = 1 ]; then
  cd "$PY_ROOT" && env -u KVFERRY_LIBRARY KVFERRY_TEST_INSTALLED=1 "$VENV_PY" -m pytest -p no:cacheprovider -q -ra tests
fi
EOF
)
suite=${CHECK_WHEEL_SUITE:-0}
if [ "$suite" = 1 ]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check pytest
fi
if unshare -m --propagation private true 2>/dev/null; then
  CONTROL="$control" VENV_PY="$venv/bin/python" SMOKE="$smoke" SUITE="$suite" PY_ROOT="$repo/bindings/python" \
    unshare -m --propagation private bash -c "$inner" check_wheel "${zmq_files[@]}"
  echo "check_wheel: OK: the wheel works with the system's copies of every bundled library hidden"
else
  echo "check_wheel: SKIPPED hiding the system libraries (no mount namespace here); running with them present"
  (cd / && env -u KVFERRY_LIBRARY "$venv/bin/python" "$smoke")
  if [ "$suite" = 1 ]; then
    (cd "$repo/bindings/python" && env -u KVFERRY_LIBRARY KVFERRY_TEST_INSTALLED=1 \
       "$venv/bin/python" -m pytest -p no:cacheprovider -q -ra tests)
  fi
  echo "check_wheel: OK (static checks and load; hiding skipped)"
fi
