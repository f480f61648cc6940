"""Fixtures: real psd processes on 127.0.0.1 (never mocks).

The binaries come from $PSD_BIN_DIR (ctest sets it) or build/bin of the
checkout; the package imports from python/ of the checkout unless
$PSD_TEST_INSTALLED says to use the installed one."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.environ.get("PSD_BIN_DIR", os.path.join(ROOT, "build", "bin"))
if not os.environ.get("PSD_TEST_INSTALLED"):
    sys.path.insert(0, os.path.join(ROOT, "python"))
    os.environ.setdefault("PSD_LIBPSCLIENT",
                          os.path.join(os.path.dirname(BIN), "lib", "libpsclient.so.0.2"))


class Psd:
    """One psd task; ``addr`` is its host:port once started."""

    def __init__(self, args, tmp):
        self.port_file = os.path.join(tmp, "psd.%d.port" % id(self))
        self.log = open(os.path.join(tmp, "psd.%d.log" % id(self)), "w+")
        cmd = [os.path.join(BIN, "psd"), "--port-file", self.port_file,
               "--log-level", "warn"] + list(args)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("psd did not start: " + self.logtext())
            time.sleep(0.01)
        with open(self.port_file) as f:
            self.addr = f.read().strip()

    def logtext(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def wait(self, timeout=30):
        """psd's exit status (it exits once every worker finished)."""
        return self.proc.wait(timeout)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture
def tmpdir_short():
    d = tempfile.mkdtemp(prefix="psdpy.")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start_psd(tmpdir_short):
    """start_psd(n=1, *args) -> list of Psd (one job of n ps tasks)."""
    started = []

    def start(n=1, *args):
        tasks = [Psd(["--ps-index", str(i), "--num-ps", str(n)] + list(args), tmpdir_short)
                 for i in range(n)]
        started.extend(tasks)
        return tasks

    yield start
    for p in started:
        p.kill()


def hosts(tasks):
    return [t.addr for t in tasks]
