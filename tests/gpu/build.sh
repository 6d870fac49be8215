#!/usr/bin/env bash
# Builds, here, what tests/gpu/run.sh runs on a GPU machine that has no
# network and no Go toolchain: the engine's test binary and the shared
# libraries it needs beyond glibc (libzmq and its dependencies), in
# build/gpu. Carry build/gpu to the GPU machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=build/gpu
rm -rf "$out"
mkdir -p "$out/lib"
go test -c -o "$out/engine.test" ./engine
go test -c -o "$out/cuda.test" ./cuda
# Every library the binary needs except the C runtime's own.
ldd "$out/engine.test" | awk '/=> \//{print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|libresolv.so*|ld-linux*|libgcc_s.so*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
echo "tests/gpu/build.sh: $(du -sh "$out" | cut -f1) in $out: engine.test, cuda.test and $(ls "$out/lib" | wc -l) libraries"
