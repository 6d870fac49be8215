#!/usr/bin/env bash
# Checks the dynamic symbols and dependencies of libkvferry.so:
#  - it exports kvf_* functions only (no Go runtime, cgo or kvfgo_* symbol),
#    and every function declared in include/kvferry.h;
#  - it needs no libibverbs, libcuda or libnvidia-ml symbol or library, so
#    it loads on a machine without them;
#  - its soname is libkvferry.so.MAJOR and it is stripped.
# Usage: scripts/check-abi.sh path/to/libkvferry.so [path/to/kvferry.h]
set -euo pipefail
lib=$1
hdr=${2:-$(dirname "$0")/../include/kvferry.h}
fail=0
err() { echo "check-abi: $*" >&2; fail=1; }

defined=$(nm -D --defined-only "$lib" | awk '{print $NF}' | sort)
[ -n "$defined" ] || err "no dynamic symbols in $lib"
bad=$(grep -v '^kvf_' <<<"$defined" || true)
[ -z "$bad" ] || err "exports symbols other than kvf_*: $(tr '\n' ' ' <<<"$bad")"

# Every function the header declares is exported, and nothing else is.
declared=$(grep -oE '^[a-z_0-9 ]*[ *](kvf_[a-z_0-9]+)\(' "$hdr" | grep -oE 'kvf_[a-z_0-9]+\($' | tr -d '(' | grep -v '^kvf_engine_options_init$' | sort -u)
missing=$(comm -23 <(echo "$declared") <(echo "$defined"))
extra=$(comm -13 <(echo "$declared") <(echo "$defined"))
[ -z "$missing" ] || err "declared in kvferry.h but not exported: $(tr '\n' ' ' <<<"$missing")"
[ -z "$extra" ] || err "exported but not declared in kvferry.h: $(tr '\n' ' ' <<<"$extra")"

undef=$(nm -D --undefined-only "$lib" | awk '{print $NF}')
hw=$(grep -E '^(ibv_|mlx5|cu[A-Z_]|nvml)' <<<"$undef" || true)
[ -z "$hw" ] || err "needs hardware library symbols: $(tr '\n' ' ' <<<"$hw")"
needed=$(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
hwlib=$(grep -E 'libibverbs|libcuda|libnvidia-ml|libmlx5' <<<"$needed" || true)
[ -z "$hwlib" ] || err "links hardware libraries: $hwlib"

soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
major=$(sed -n 's/^#define KVF_VERSION_MAJOR \([0-9]*\)$/\1/p' "$hdr")
[ "$soname" = "libkvferry.so.$major" ] || err "soname is '$soname', want libkvferry.so.$major"
if readelf -S "$lib" | grep -qE '\.symtab|\.debug_'; then err "not stripped"; fi
readelf -d "$lib" | grep -q NODELETE || err "not linked with -z nodelete"

if [ $fail -eq 0 ]; then
  echo "check-abi: ok: $(wc -l <<<"$defined") kvf_* symbols, soname $soname, needs: $(tr '\n' ' ' <<<"$needed")"
fi
exit $fail
