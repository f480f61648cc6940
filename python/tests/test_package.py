"""The package as users get it: its version is the C library's, and
`pip install ./python` works offline in a fresh venv, bundling the built
library, and the installed package talks to a real psd."""
import os
import re
import subprocess
import sys

import pytest

from conftest import BIN, ROOT, hosts

import psd


def header(name):
    with open(os.path.join(ROOT, "libpsclient", "include", "ps", name)) as f:
        return f.read()


def header_version():
    text = header("version.h")
    return ".".join(re.search(r"#define PS_VERSION_%s (\d+)" % k, text).group(1)
                    for k in ("MAJOR", "MINOR", "PATCH"))


def test_version_is_the_library_s():
    assert psd.__version__ == header_version() == psd.library_version  # ps_version()
    stopped = int(re.search(r"#define PS_EXIT_STOPPED (\d+)", header("errno.h")).group(1))
    assert psd.EXIT_STOPPED == stopped == 75
    major, minor, _ = psd.__version__.split(".")
    assert psd._version.SONAME == "libpsclient.so.%s.%s" % (major, minor)


def test_pip_install_offline_in_a_venv(tmpdir_short, start_psd):
    venv = os.path.join(tmpdir_short, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True)
    env = dict(os.environ, PSD_BUILD_DIR=os.path.dirname(BIN), PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PSD_LIBPSCLIENT", None)
    r = subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--no-cache-dir",
                        os.path.join(ROOT, "python")], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    ps = start_psd(1)
    code = ("import psd; c = psd.Client(hosts=%r, telemetry='off'); "
            "v = c.variable('w', 3, init=psd.Constant(2)); print(psd.library_path, v.data.sum()); "
            "c.finish()" % hosts(ps))
    r = subprocess.run([os.path.join(venv, "bin", "python"), "-c", code], env=env,
                       capture_output=True, text=True, cwd=tmpdir_short)
    assert r.returncode == 0, r.stdout + r.stderr
    path, total = r.stdout.split()
    assert path.startswith(venv) and path.endswith("/psd/_lib/" + psd._version.SONAME)
    assert float(total) == 6.0
    assert ps[0].wait() == 0


def test_pip_install_before_a_build_says_what_to_run(tmpdir_short):
    """With no build to bundle and no installed library, pip fails with one
    sentence saying what to run, instead of installing a package that
    cannot load."""
    env = dict(os.environ, PSD_BUILD_DIR=os.path.join(tmpdir_short, "no-build"),
               PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    probe = "import ctypes; ctypes.CDLL(%r)" % psd._version.SONAME  # not in this process:
    if subprocess.run([sys.executable, "-c", probe], env=env,
                      capture_output=True).returncode == 0:  # it has it
        pytest.skip("this system has %s installed" % psd._version.SONAME)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
                        "-w", tmpdir_short, os.path.join(ROOT, "python")], env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0, r.stdout + r.stderr
    assert "bash deploy/build.sh" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not any(f.endswith(".whl") for f in os.listdir(tmpdir_short))


def test_missing_library_names_what_was_tried(tmpdir_short):
    env = dict(os.environ, PSD_LIBPSCLIENT=os.path.join(tmpdir_short, "nope.so"))
    r = subprocess.run([sys.executable, "-c", "import psd"], env=env, capture_output=True,
                       text=True, cwd=os.path.join(ROOT, "python"))
    assert r.returncode != 0 and "nope.so (no such file)" in r.stderr


@pytest.mark.parametrize("name", ["Client", "Stopped", "SGD", "Table"])
def test_help_reads_well(name):
    doc = getattr(psd, name).__doc__
    assert doc and len(doc.split()) > 5


def test_planted_library_is_not_loaded(tmpdir_short):
    """A package installed under PREFIX/lib/python3.X/dist-packages loads
    PREFIX/lib's library only if no one else can have put it there."""
    import shutil
    prefix = os.path.join(tmpdir_short, "prefix")
    pkg = os.path.join(prefix, "lib", "python3.11", "dist-packages", "psd")
    shutil.copytree(os.path.join(ROOT, "python", "psd"), pkg,
                    ignore=shutil.ignore_patterns("_lib", "__pycache__"))
    lib = os.path.join(prefix, "lib", psd._version.SONAME)
    shutil.copy(psd.library_path, lib)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(pkg), PSD_LIBPSCLIENT="",
               LD_LIBRARY_PATH="")
    code = "import psd; print(psd.library_path)"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=tmpdir_short)
    assert r.returncode == 0 and r.stdout.strip() == lib, r.stderr
    os.chmod(lib, 0o666)  # as a planted file would be: writable by others
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=tmpdir_short)
    assert r.returncode != 0 and "is writable by others" in r.stderr, r.stdout + r.stderr


def test_library_under_a_folder_others_can_write_is_not_loaded(tmpdir_short):
    """Only the library's own folder was checked: with a folder above it
    writable by others, another user can swap that subtree (between the
    check and the load, too). Every folder up to / must be safe (sticky
    ones such as /tmp are)."""
    import shutil
    prefix = os.path.join(tmpdir_short, "prefix")
    pkg = os.path.join(prefix, "lib", "python3.11", "dist-packages", "psd")
    shutil.copytree(os.path.join(ROOT, "python", "psd"), pkg,
                    ignore=shutil.ignore_patterns("_lib", "__pycache__"))
    shutil.copy(psd.library_path, os.path.join(prefix, "lib", psd._version.SONAME))
    os.chmod(prefix, 0o777)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(pkg), PSD_LIBPSCLIENT="",
               LD_LIBRARY_PATH="")
    r = subprocess.run([sys.executable, "-c", "import psd; print(psd.library_path)"], env=env,
                       capture_output=True, text=True, cwd=tmpdir_short)
    assert r.returncode != 0 and prefix + " is writable by others" in r.stderr, \
        r.stdout + r.stderr


def test_group_writable_only_by_ones_own_private_group(tmpdir_short):
    """Debian's umask 002 makes one's files writable by one's private
    group: that group is no one else, so the library is loaded; a folder
    writable by another group is refused."""
    import grp
    import pwd
    from psd import _lib
    d = os.path.join(tmpdir_short, "lib")
    os.mkdir(d)
    lib = os.path.join(d, "libx.so")
    open(lib, "w").close()
    me = pwd.getpwuid(os.getuid())
    try:
        private = grp.getgrgid(me.pw_gid).gr_name == me.pw_name
    except KeyError:
        private = False
    if not private:
        pytest.skip("this user has no private group")
    os.chmod(d, 0o775)
    assert _lib._untrusted(lib) is None
    other = next((g.gr_gid for g in grp.getgrall() if g.gr_gid != me.pw_gid), None)
    if other is None or os.getuid() != 0:
        return  # chown to another group needs root
    os.chown(d, -1, other)
    assert "is writable by others" in _lib._untrusted(lib)
