#!/usr/bin/env bash
# The Python package's pytest suites (python/tests) with Debian's python3:
#   python_test.sh BIN_DIR core    the NumPy layer and packaging
#   python_test.sh BIN_DIR torch   psd.torch and the PyTorch examples
#   python_test.sh BIN_DIR c10d    the torch.distributed backend "psd" and
#                                  Horovod's API on it (psd.horovod)
# Exits 77 (skipped) when python3, NumPy, pytest or (torch) PyTorch is not
# installed; an installed one that fails to import is a failure.
set -euo pipefail
bin=$1
what=$2
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PSD_PYTHON:-/usr/bin/python3}
[ -x "$py" ] || { echo "SKIP: $py is not installed"; exit 77; }
need() { # need MODULE PACKAGE
  if ! "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; then
    echo "SKIP: $py has no $1 (apt-get install $2)"
    exit 77
  fi
}
need numpy python3-numpy
need pytest python3-pytest
case "$what" in
  core) files=(test_client.py test_package.py) ;;
  torch) need torch python3-torch
    files=(test_torch.py test_server_rules.py test_average.py test_readme.py test_ctr_example.py
           test_examples.py) ;;
  c10d) need torch python3-torch
    files=(test_c10d.py test_horovod.py) ;;
  *) echo "python_test.sh: unknown suite '$what'" >&2; exit 2 ;;
esac
export PSD_BIN_DIR=$bin
cd "$root/python/tests"
exec "$py" -m pytest -q -p no:cacheprovider "${files[@]}"
