#!/usr/bin/env bash
# Downloads the official CIFAR-10 binary version, checks its md5 and unpacks
# it. Usage: download.sh [DIR]   (default: ./data)
#
# Afterwards the .bin files (data_batch_1.bin .. data_batch_5.bin,
# test_batch.bin, batches.meta.txt) are in DIR/cifar-10-batches-bin, the
# directory to give the CIFAR-10 worker. A tarball already in DIR with the
# right md5 is not downloaded again. Needs curl or wget, md5sum and tar.
# Without network access, build/bin/cifar_synth writes a synthetic data set
# in the same format instead.
set -euo pipefail

URL=https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz
MD5=c32a1d4ab5d03f1284b67883e8d87530
TARBALL=cifar-10-binary.tar.gz
SUBDIR=cifar-10-batches-bin
FILES=(data_batch_1.bin data_batch_2.bin data_batch_3.bin data_batch_4.bin
       data_batch_5.bin test_batch.bin)

die() {
  echo "download.sh: error: $*" >&2
  exit 1
}

case "${1:-}" in
  -h | --help)
    sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
esac
[ $# -le 1 ] || die "too many arguments (usage: download.sh [DIR])"
dir=${1:-./data}

command -v md5sum >/dev/null || die "md5sum not found"
command -v tar >/dev/null || die "tar not found"
mkdir -p -- "$dir" || die "cannot create directory $dir"

md5_of() {
  md5sum -- "$1" | cut -d' ' -f1
}

tarball=$dir/$TARBALL
if [ -f "$tarball" ] && [ "$(md5_of "$tarball")" = "$MD5" ]; then
  echo "download.sh: $tarball already present, md5 OK"
else
  part=$tarball.part
  trap 'rm -f -- "$part"' EXIT
  echo "download.sh: downloading $URL (about 170 MB)"
  if command -v curl >/dev/null; then
    curl -fL --retry 3 -o "$part" -- "$URL" || die "download failed: $URL"
  elif command -v wget >/dev/null; then
    wget -O "$part" -- "$URL" || die "download failed: $URL"
  else
    die "neither curl nor wget found"
  fi
  got=$(md5_of "$part")
  if [ "$got" != "$MD5" ]; then
    die "md5 mismatch for $URL: got $got, expected $MD5 (corrupt or wrong download; nothing was extracted)"
  fi
  mv -f -- "$part" "$tarball"
  trap - EXIT
  echo "download.sh: md5 OK ($MD5)"
fi

tar -xzf "$tarball" -C "$dir" || die "cannot extract $tarball into $dir"
for f in "${FILES[@]}"; do
  [ -s "$dir/$SUBDIR/$f" ] || die "$dir/$SUBDIR/$f missing after extraction"
done
bindir=$(cd -- "$dir/$SUBDIR" && pwd)
echo "download.sh: CIFAR-10 binary files are in $bindir"
