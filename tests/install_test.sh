#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then builds a tiny
# program against it twice: with pkg-config and with find_package(psclient).
# Usage: install_test.sh BUILD_DIR SOURCE_DIR PSD_BIN
set -euo pipefail
build=$1
src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
for f in include/psclient.h bin/psd; do
  [ -e "$prefix/$f" ] || { echo "FAIL: $f not installed"; exit 1; }
done
libdir=$(dirname "$(find "$prefix" -name psclient.pc | head -1)")/..
[ -e "$libdir/libpsclient.a" ] || { echo "FAIL: static library not installed"; exit 1; }
ls "$libdir"/libpsclient.so* >/dev/null || { echo "FAIL: shared library not installed"; exit 1; }

cat > "$tmp/hello.c" <<'C'
#include <psclient.h>
#include <stdio.h>
#include <string.h>
int main(void) {
  /* Links and calls the library: error table and a seeded initializer. */
  float v[6];
  int64_t shape[2] = {2, 3};
  ps_init init = PS_SIZED(ps_init, PS_INIT_UNIFORM, -1, 1, 7);
  if (ps_init_fill(&init, "w", shape, 2, v, 6) != 0) return 1;
  if (strcmp(ps_strerror(PS_ESTALE), "stale gradient dropped") != 0) return 1;
  ps_client *c = NULL;
  ps_client_destroy(c); /* NULL is a no-op */
  printf("ok %d.%d\n", PS_VERSION_MAJOR, PS_VERSION_MINOR);
  return 0;
}
C

# 1. pkg-config, shared library.
export PKG_CONFIG_PATH=$libdir/pkgconfig
cc -o "$tmp/hello_pc" "$tmp/hello.c" $(pkg-config --cflags --libs psclient)
LD_LIBRARY_PATH=$libdir "$tmp/hello_pc" | grep -q '^ok ' || { echo "FAIL: pkg-config build"; exit 1; }
# 1b. pkg-config, static.
cc -o "$tmp/hello_static" "$tmp/hello.c" $(pkg-config --static --cflags psclient) \
  "$libdir/libpsclient.a" $(pkg-config --static --libs-only-l psclient | sed 's/-lpsclient//')
"$tmp/hello_static" | grep -q '^ok ' || { echo "FAIL: static build"; exit 1; }

# 2. CMake find_package.
mkdir -p "$tmp/proj"
cp "$tmp/hello.c" "$tmp/proj/"
cat > "$tmp/proj/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.20)
project(hello C)
find_package(psclient REQUIRED)
add_executable(hello hello.c)
target_link_libraries(hello PRIVATE psclient::psclient)
CM
cmake -S "$tmp/proj" -B "$tmp/proj/build" -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$tmp/proj/build" >/dev/null
LD_LIBRARY_PATH=$libdir "$tmp/proj/build/hello" | grep -q '^ok ' || { echo "FAIL: find_package build"; exit 1; }
echo "install test: pkg-config (shared, static) and find_package builds OK"
