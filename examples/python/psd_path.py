"""Imported first by the examples: when the psd package is not installed
(pip install ./python), the examples use the package of the checkout they
are in (python/), which finds the checkout's build/lib/libpsclient."""
import importlib.util
import os
import sys

if importlib.util.find_spec("psd") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "python"))
