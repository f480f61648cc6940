"""The package's version: the C library's (ps/version.h PS_VERSION_*), and
the SONAME it loads (MAJOR.MINOR while the major version is 0, see
docs/abi.md). python/tests/test_package.py checks both against the header."""
VERSION = "0.2.8"
SONAME = "libpsclient.so.0.2"
