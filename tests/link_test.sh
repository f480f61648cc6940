#!/usr/bin/env bash
# What the build links and exports:
#  - libpsclient.so defines and exports only the public ps_ API (the wire
#    layer, protobuf code and helpers inside it stay hidden);
#  - psd links neither BLAS nor Slurm/PMI-2 (it makes no call into them).
# Usage: link_test.sh LIBPSCLIENT_SO PSD_BIN
set -euo pipefail
so=$1 psd=$2
fail=0
exported=$(nm -D --defined-only "$so" | awk '$2 ~ /^[TDBRVW]$/ {print $3}')
[ -n "$exported" ] || { echo "FAIL: $so exports nothing"; exit 1; }
others=$(printf '%s\n' "$exported" | grep -v '^ps_' || true)
if [ -n "$others" ]; then
  echo "FAIL: $so exports symbols outside the ps_ API:"
  printf '  %s\n' $others | head -20
  fail=1
fi
internal=$(printf '%s\n' "$exported" | grep '^ps__' || true)
if [ -n "$internal" ]; then
  echo "FAIL: $so exports internal ps__ symbols:"
  printf '  %s\n' $internal | head -20
  fail=1
fi
echo "$so exports $(printf '%s\n' "$exported" | wc -l) symbols, all ps_"
for lib in openblas blas slurm pmi2 gfortran; do
  if ldd "$psd" | grep -q "lib$lib"; then
    echo "FAIL: $psd links lib$lib:"; ldd "$psd" | grep "lib$lib"; fail=1
  fi
done
[ $fail -eq 0 ] && echo "psd links: $(ldd "$psd" | awk '{print $1}' | tr '\n' ' ')"
exit $fail
