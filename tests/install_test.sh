#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then builds a small worker
# against it four ways -- pkg-config shared and static (psclient.pc,
# psclient-static.pc), CMake find_package shared and static
# (psclient::psclient, psclient::psclient_static) -- and runs each one
# against the installed psd (PREFIX/bin/psd, no LD_LIBRARY_PATH anywhere):
# it creates a variable, steps, checks the updated values and finishes, and
# psd must exit 0. Also: the installed programs carry RUNPATH $ORIGIN/../lib;
# a shared pkg-config build without docs/build.md's -Wl,-rpath fails to find
# libpsclient.so (the reason for that advice) and with it runs; the example
# programs are installed exactly when PS_INSTALL_EXAMPLES is ON.
# Usage: install_test.sh BUILD_DIR SOURCE_DIR PS_INSTALL_EXAMPLES(ON|OFF)
set -euo pipefail
build=$1 # $2, the source directory, is not needed
examples=${3:-OFF}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/install_test.XXXXXX")
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
unset LD_LIBRARY_PATH

prefix=$tmp/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null
for f in include/psclient.h include/ps/errno.h include/ps/export.h include/ps/types.h \
    include/ps/version.h bin/psd bin/psrun bin/psctl bin/psplot; do
  [ -e "$prefix/$f" ] || fail "$f not installed"
done
pc=$(find "$prefix" -name psclient.pc | head -1)
[ -n "$pc" ] || fail "psclient.pc not installed"
libdir=$(cd "$(dirname "$pc")/.." && pwd)
[ -e "$libdir/libpsclient.a" ] || fail "static library not installed"
ls "$libdir"/libpsclient.so* >/dev/null || fail "shared library not installed"
[ -e "$libdir/pkgconfig/psclient-static.pc" ] || fail "psclient-static.pc not installed"

# Examples only with -DPS_INSTALL_EXAMPLES=ON.
for f in cifar_worker cifar_synth; do
  if [ "$examples" = ON ]; then
    [ -e "$prefix/bin/$f" ] || fail "PS_INSTALL_EXAMPLES=ON but bin/$f was not installed"
  else
    [ ! -e "$prefix/bin/$f" ] || fail "bin/$f installed although PS_INSTALL_EXAMPLES is OFF"
  fi
done

# Relative RPATH: the installed programs find PREFIX/lib from PREFIX/bin.
for f in psd psrun psctl; do
  rp=$(readelf -d "$prefix/bin/$f" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
  [ "$rp" = "\$ORIGIN/../$(basename "$libdir")" ] ||
    fail "bin/$f has RUNPATH '$rp', expected \$ORIGIN/../lib"
done
"$prefix/bin/psd" --help >/dev/null || fail "PREFIX/bin/psd does not run without LD_LIBRARY_PATH"

cat > "$tmp/hello.c" <<'C'
/* A worker of one variable: create, one step, check, finish. */
#include <psclient.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
int main(void) {
  if (strcmp(ps_strerror(PS_ESTALE), "stale gradient dropped") != 0) return 10;
  ps_client *c;
  char err[256];
  if (ps_client_create_from_env(&c, err, sizeof err) != 0) {
    fprintf(stderr, "create: %s\n", err);
    return 11;
  }
  int64_t shape[2] = {2, 3};
  ps_init init = PS_SIZED(ps_init, .kind = PS_INIT_CONSTANT, .a = 1.0);
  ps_optimizer opt;
  ps_optimizer_default(&opt, 0.5);
  ps_var *w;
  if (ps_client_var_create(c, "w", shape, 2, &init, &opt, &w) != 0) {
    fprintf(stderr, "var_create: %s\n", ps_client_errmsg(c));
    return 12;
  }
  uint64_t step = 0;
  if (ps_client_pull(c, 0, &step) != 0) {
    fprintf(stderr, "pull: %s\n", ps_client_errmsg(c));
    return 13;
  }
  for (size_t i = 0; i < ps_var_numel(w); i++) ps_var_grad(w)[i] = 1.0f;
  if (ps_client_step(c, &step, NULL) != 0) {
    fprintf(stderr, "step: %s\n", ps_client_errmsg(c));
    return 14;
  }
  for (size_t i = 0; i < ps_var_numel(w); i++)
    if (fabsf(ps_var_data(w)[i] - 0.5f) > 1e-6f) {
      fprintf(stderr, "w[%zu] = %g after one step, expected 0.5\n", i, ps_var_data(w)[i]);
      return 15;
    }
  if (ps_client_finish(c) != 0) {
    fprintf(stderr, "finish: %s\n", ps_client_errmsg(c));
    return 16;
  }
  ps_client_destroy(c);
  printf("ok %d.%d step %llu\n", PS_VERSION_MAJOR, PS_VERSION_MINOR, (unsigned long long)step);
  return 0;
}
C

# run_worker NAME PROGRAM: PROGRAM against a fresh installed psd; both exit 0.
run_worker() {
  local name=$1 prog=$2 pf=$tmp/$1.port waited=0
  "$prefix/bin/psd" --port 0 --port-file "$pf" --workers 1 --startup-timeout 60 \
    > "$tmp/$name.psd.log" 2>&1 &
  local psd=$!
  pids+=("$psd")
  while [ ! -s "$pf" ]; do
    kill -0 "$psd" 2>/dev/null || { cat "$tmp/$name.psd.log"; fail "$name: psd exited at start"; }
    [ "$waited" -lt 100 ] || fail "$name: psd wrote no port file in 10 s"
    sleep 0.1
    waited=$((waited + 1))
  done
  local out rc=0
  out=$(PS_HOSTS=$(cat "$pf") PS_WORKER_INDEX=0 PS_NUM_WORKERS=1 PS_CONNECT_TIMEOUT_MS=10000 \
        timeout 60 "$prog" 2>&1) || rc=$?
  [ "$rc" -eq 0 ] && grep -q '^ok .* step 1$' <<<"$out" ||
    { cat "$tmp/$name.psd.log"; fail "$name: the worker exited $rc: $out"; }
  rc=0
  timeout 30 tail --pid="$psd" -f /dev/null || fail "$name: psd did not exit after the worker finished"
  wait "$psd" || rc=$?
  [ "$rc" -eq 0 ] || { cat "$tmp/$name.psd.log"; fail "$name: psd exited $rc"; }
  echo "ok: $name: worker and installed psd exited 0 ($out)"
}
needs_shared() { # PROGRAM YES|NO: whether it links libpsclient.so
  if readelf -d "$1" | grep -q 'NEEDED.*libpsclient\.so'; then
    [ "$2" = YES ] || fail "$1 links libpsclient.so but should be static"
  else
    [ "$2" = NO ] || fail "$1 does not link libpsclient.so"
  fi
}

export PKG_CONFIG_PATH=$libdir/pkgconfig
# 1. pkg-config, shared library: without an RPATH the loader does not find
#    libpsclient.so in a non-system prefix (what psclient.pc and docs/build.md
#    warn about); with the advised -Wl,-rpath it runs.
# shellcheck disable=SC2046 # pkg-config's output is a list of flags
cc -o "$tmp/hello_norpath" "$tmp/hello.c" $(pkg-config --cflags --libs psclient) -lm
out=$("$tmp/hello_norpath" 2>&1) && fail "a pkg-config build without -rpath ran: $out"
grep -q 'libpsclient\.so.*cannot open' <<<"$out" ||
  fail "without -rpath the program failed otherwise than with 'libpsclient.so...: cannot open': $out"
# shellcheck disable=SC2046
cc -o "$tmp/hello_pc" "$tmp/hello.c" $(pkg-config --cflags --libs psclient) -lm \
  -Wl,-rpath,"$(pkg-config --variable=libdir psclient)"
needs_shared "$tmp/hello_pc" YES
run_worker pkg-config-shared "$tmp/hello_pc"
# 2. pkg-config, static library (psclient-static.pc).
# shellcheck disable=SC2046
cc -o "$tmp/hello_pc_static" "$tmp/hello.c" $(pkg-config --static --cflags --libs psclient-static)
needs_shared "$tmp/hello_pc_static" NO
run_worker pkg-config-static "$tmp/hello_pc_static"

# 3, 4. CMake find_package: psclient::psclient and psclient::psclient_static.
mkdir -p "$tmp/proj"
cp "$tmp/hello.c" "$tmp/proj/"
cat > "$tmp/proj/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.20)
project(hello C)
find_package(psclient 0.2 REQUIRED)
add_executable(hello hello.c)
target_link_libraries(hello PRIVATE psclient::psclient m)
add_executable(hello_static hello.c)
target_link_libraries(hello_static PRIVATE psclient::psclient_static m)
CM
cmake -S "$tmp/proj" -B "$tmp/proj/build" -DCMAKE_PREFIX_PATH="$prefix" > "$tmp/cmake.log" 2>&1 ||
  { cat "$tmp/cmake.log"; fail "find_package(psclient) project did not configure"; }
cmake --build "$tmp/proj/build" > "$tmp/build.log" 2>&1 ||
  { cat "$tmp/build.log"; fail "find_package(psclient) project did not build"; }
needs_shared "$tmp/proj/build/hello" YES
needs_shared "$tmp/proj/build/hello_static" NO
run_worker cmake-shared "$tmp/proj/build/hello"
run_worker cmake-static "$tmp/proj/build/hello_static"

# The Python package cmake --install put beside the library: it loads
# PREFIX/lib's libpsclient (no LD_LIBRARY_PATH, no PSD_LIBPSCLIENT).
if /usr/bin/python3 -c 'import numpy' 2>/dev/null; then
  pydir=$(find "$prefix" -path '*dist-packages/psd/__init__.py' | head -1)
  [ -n "$pydir" ] || fail "the psd Python package was not installed"
  cat > "$tmp/hello.py" <<'PY'
import psd
assert psd.library_path.startswith(__import__("os").environ["PREFIX"] + "/lib/"), psd.library_path
with psd.Client.from_env() as c:
    w = c.variable("w", 4, init=psd.Constant(1.0), optimizer=psd.SGD(lr=0.5))
    w.grad[:] = 1
    step = c.step()
    assert (w.data == 0.5).all(), w.data
    print("ok %s step %d" % (".".join(psd.__version__.split(".")[:2]), step))
PY
  printf '#!/bin/sh\nPREFIX=%s PYTHONPATH=%s PSD_LIBPSCLIENT= exec /usr/bin/python3 %s\n' \
    "$prefix" "$(dirname "$(dirname "$pydir")")" "$tmp/hello.py" > "$tmp/hello_py"
  chmod +x "$tmp/hello_py"
  run_worker python "$tmp/hello_py"
  # The installed psrun puts the installed import hook on its workers'
  # PYTHONPATH (found beside it: the prefix moved is still found).
  hook=$(find "$prefix" -path '*/psd/python-hook/sitecustomize.py' | head -1)
  [ -n "$hook" ] || fail "psrun's Python import hook was not installed"
  out=$("$prefix/bin/psrun" --local -n 2 --ps 1 -- /bin/sh -c \
    'echo "path=$PYTHONPATH"; exec "$0"' "$tmp/hello_py" 2>&1) ||
    fail "the installed psrun failed: $out"
  case "$out" in
    *"path=$(dirname "$hook")"*) ;;
    *) fail "the installed psrun's worker did not get $(dirname "$hook") first on PYTHONPATH: $out" ;;
  esac
else
  echo "install test: /usr/bin/python3 has no numpy: the Python package's run is skipped"
fi

# A client of a psd that is not there fails cleanly, with a sentence.
out=$(PS_HOSTS=127.0.0.1:1 PS_WORKER_INDEX=0 PS_NUM_WORKERS=1 PS_CONNECT_TIMEOUT_MS=500 \
      timeout 30 "$tmp/hello_pc_static" 2>&1) && fail "a worker without psd succeeded: $out"
grep -q '127.0.0.1:1' <<<"$out" || fail "a failed connection does not name the address: $out"
echo "install test: pkg-config (shared, static), find_package (shared, static) and Python workers ran against the installed psd"
