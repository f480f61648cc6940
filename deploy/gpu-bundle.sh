#!/usr/bin/env bash
# gpu-bundle.sh - builds the CUDA programs here and packs what a bare GPU
# machine needs to run them into one tarball (docs/gpu.md):
#
#   bash deploy/gpu-bundle.sh                     # configure + build build/, pack
#   bash deploy/gpu-bundle.sh --from build        # pack what build/ already holds
#   bash deploy/gpu-bundle.sh --out /tmp/b.tar.gz --build-dir build-gpu
#
# The tarball holds one folder, psd-gpu-bundle/:
#   run-gpu.sh   the run (deploy/run-gpu.sh): tests, sanitizers, benchmark,
#                PyTorch comparison, 10-epoch accuracy; one JSON summary
#   bin/         cuda_gpu_tests cnn_bench cifar_worker cifar_synth psd psrun
#   lib/         the shared libraries those need that a GPU machine may lack
#                (OpenBLAS, libgfortran, libquadmath, libevent, protobuf-c,
#                libsodium, munge, slurm...), found with ldd; run-gpu.sh puts
#                lib/ on LD_LIBRARY_PATH. Left out: glibc, libstdc++,
#                libgcc_s (every machine has them) and the CUDA driver and
#                libraries (the GPU machine's own: cuBLAS is opened at run
#                time, the CUDA runtime is linked in statically).
#   examples/    torch_cifar.py and cifar_net.py, the PyTorch comparison
#   README.md    docs/gpu.md; MANIFEST (commit, build, glibc needed);
#                SHA256SUMS (run-gpu.sh checks them before it runs)
#
# Options: --from DIR packs an existing build (no configure, no build);
# --build-dir DIR (default build) is where it configures and builds
# (RelWithDebInfo, -DPS_CUDA=ON); --out FILE (default
# BUILD_DIR/psd-gpu-bundle.tar.gz). JOBS sets the build's parallelism.
# It refuses a build without the CUDA backend or with a build type other
# than Release or RelWithDebInfo, and a bundle over MAX_BYTES.
# Prints the tarball's path and size on stdout; exits 0, or 1 with a sentence.
set -euo pipefail

MAX_BYTES=60000000 # the issue's limit: small enough to copy to any machine
PROGRAMS=(cuda_gpu_tests cnn_bench cifar_worker cifar_synth psd psrun)
# Libraries every Linux machine has (glibc, the C++ runtime) or the GPU
# machine brings (CUDA driver and toolkit): never packed.
SYSTEM_LIBS='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl|libstdc\+\+|libgcc_s|libcuda|libnvidia-|libcudart|libcublas|libcublasLt)([.-]|$)'

die() { echo "gpu-bundle: $*" >&2; exit 1; }
root=$(cd "$(dirname "$0")/.." && pwd)
from="" build_dir=build out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --from) [ $# -ge 2 ] || die "--from needs a build directory"; from=$2; shift 2 ;;
    --build-dir) [ $# -ge 2 ] || die "--build-dir needs a directory"; build_dir=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a file name"; out=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (gpu-bundle.sh --help)" ;;
  esac
done

if [ -n "$from" ]; then
  [ -d "$from" ] || die "--from $from: no such directory"
  build_dir=$from
else
  cd "$root"
  echo "gpu-bundle: building in $build_dir (RelWithDebInfo, CUDA on)" >&2
  cmake -S "$root" -B "$build_dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPS_CUDA=ON \
    -DPS_BUILD_TESTS=ON -DPS_BUILD_EXAMPLES=ON -DPS_BUILD_PSRUN=ON >&2 ||
    die "configuring $build_dir failed (the CUDA toolkit is needed: /usr/local/cuda)"
  cmake --build "$build_dir" -j"${JOBS:-$(nproc)}" --target "${PROGRAMS[@]}" >&2 ||
    die "building in $build_dir failed"
fi
build_dir=$(cd "$build_dir" && pwd)
cache=$build_dir/CMakeCache.txt
[ -f "$cache" ] || die "$build_dir has no CMakeCache.txt: give a cmake build directory"
build_type=$(sed -n 's/^CMAKE_BUILD_TYPE:[A-Z]*=//p' "$cache")
case "$build_type" in
  Release | RelWithDebInfo) ;;
  *) die "$build_dir is a '$build_type' build; the bundle measures speed, so it" \
         "must be Release or RelWithDebInfo" ;;
esac
bin=$build_dir/bin
for p in "${PROGRAMS[@]}"; do
  [ -x "$bin/$p" ] || die "$bin/$p is missing (build it: cmake --build $build_dir --target $p)"
done
# The CUDA backend names the cuBLAS it opens; the stub of a build without
# CUDA does not.
for p in cuda_gpu_tests cnn_bench cifar_worker; do
  grep -a -q -F 'libcublas.so.' "$bin/$p" ||
    die "$bin/$p has no CUDA backend ($build_dir was configured without the CUDA" \
        "toolkit or with -DPS_CUDA=OFF); reconfigure with -DPS_CUDA=ON"
done

stage=$(mktemp -d "${TMPDIR:-/tmp}/gpu-bundle.XXXXXX")
trap 'rm -rf "$stage"' EXIT
b=$stage/psd-gpu-bundle
mkdir -p "$b/bin" "$b/lib" "$b/examples/cifar10/bench" "$b/examples/python"
for p in "${PROGRAMS[@]}"; do cp "$bin/$p" "$b/bin/"; done

# Every library ldd resolves for a program (ldd lists the indirect ones
# too), except the system's: copied under its soname.
for p in "${PROGRAMS[@]}"; do
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    [[ $name =~ $SYSTEM_LIBS ]] && continue
    [ "$path" != not ] || die "$bin/$p needs $name, which is not found here"
    [ -e "$b/lib/$name" ] || cp -L "$path" "$b/lib/$name"
  done < <(ldd "$bin/$p")
done
chmod 0644 "$b/lib/"*

cp "$root/deploy/run-gpu.sh" "$b/run-gpu.sh"
chmod 0755 "$b/run-gpu.sh"
cp "$root/examples/cifar10/bench/torch_cifar.py" "$b/examples/cifar10/bench/"
cp "$root/examples/python/cifar_net.py" "$b/examples/python/"
cp "$root/docs/gpu.md" "$b/README.md"

# The newest glibc symbol version any file asks for: run-gpu.sh compares
# it with the machine's before running anything.
glibc=$(cat "$b/bin/"* "$b/lib/"* | grep -a -o 'GLIBC_2\.[0-9]*' | sort -u -V | tail -n1)
commit=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo yes || echo no)
cuda=$(sed -n 's/^CMAKE_CUDA_COMPILER:[A-Z]*=//p' "$cache")
cuda_version=$("$cuda" --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
{
  echo "commit=$commit"
  echo "dirty=$dirty"
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "build_host=$(hostname)"
  echo "build_type=$build_type"
  echo "cuda=${cuda_version:-unknown}"
  echo "glibc_needed=${glibc#GLIBC_}"
  echo "built_on=$(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
} > "$b/MANIFEST"
(cd "$b" && find . -type f ! -name SHA256SUMS -printf '%P\n' | sort | xargs sha256sum > SHA256SUMS)

out=${out:-$build_dir/psd-gpu-bundle.tar.gz}
tar -C "$stage" -czf "$out.tmp" --owner=0 --group=0 psd-gpu-bundle
size=$(stat -c %s "$out.tmp")
if [ "$size" -ge "$MAX_BYTES" ]; then
  rm -f "$out.tmp"
  die "the bundle is $size bytes, over the $MAX_BYTES limit"
fi
mv "$out.tmp" "$out"
echo "gpu-bundle: $(ls "$b/lib" | tr '\n' ' ')" >&2
echo "$out $size"
