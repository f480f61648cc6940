"""PEP 517 build backend of the psd Python package, standard library only,
so that `pip install ./python` works offline (pip's isolated build
environment would otherwise have to download setuptools).

The wheel holds python/psd and, when a build of libpsclient is found
($PSD_BUILD_DIR/lib, else build/lib of the checkout), a copy of the
library as psd/_lib/<SONAME>, which the package loads first; without one
the wheel is pure Python and uses the system's libpsclient."""
import base64
import hashlib
import io
import os
import sys
import sysconfig
import tarfile
import zipfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # python/
NAME = "psd"


def _version():
    ns = {}
    with open(os.path.join(HERE, "psd", "_version.py")) as f:
        exec(f.read(), ns)
    return ns["VERSION"], ns["SONAME"]


def _metadata(version):
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n"
            "Summary: Python and PyTorch front end of the psd parameter server\n"
            "Requires-Python: >=3.8\nRequires-Dist: numpy\n"
            "License: see the psd repository\n" % (NAME, version))


def _build_dir():
    return os.environ.get("PSD_BUILD_DIR") or os.path.join(HERE, "..", "build")


def _library(soname):
    """The built libpsclient to bundle, or None."""
    path = os.path.join(_build_dir(), "lib", soname)
    return os.path.realpath(path) if os.path.exists(path) else None


def _system_library(soname):
    """Whether the system's loader finds soname (an installed library)."""
    import ctypes
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def _files(lib, soname):
    """(path in the wheel, bytes) of the package."""
    out = []
    pkg = os.path.join(HERE, "psd")
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py"):
            with open(os.path.join(pkg, name), "rb") as f:
                out.append(("psd/" + name, f.read()))
    if lib:
        with open(lib, "rb") as f:
            out.append(("psd/_lib/" + soname, f.read()))
    return out


def _record_line(path, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (path, digest, len(data))


def _write_wheel(wheel_directory, files, pure, version):
    tag = "py3-none-" + ("any" if pure else
                         sysconfig.get_platform().replace("-", "_").replace(".", "_"))
    dist = "%s-%s.dist-info" % (NAME, version)
    wheel_meta = ("Wheel-Version: 1.0\nGenerator: psd_build\nRoot-Is-Purelib: %s\nTag: %s\n"
                  % ("true" if pure else "false", tag))
    files = files + [(dist + "/METADATA", _metadata(version).encode()),
                     (dist + "/WHEEL", wheel_meta.encode())]
    record = [_record_line(p, d) for p, d in files] + [dist + "/RECORD,,"]
    files.append((dist + "/RECORD", ("\n".join(record) + "\n").encode()))
    name = "%s-%s-%s.whl" % (NAME, version, tag)
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w",
                         zipfile.ZIP_DEFLATED) as z:
        for path, data in files:
            info = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if path.endswith(".so") or ".so." in path
                                  else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return name


def get_requires_for_build_wheel(config_settings=None):
    return []


get_requires_for_build_editable = get_requires_for_build_sdist = get_requires_for_build_wheel


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    version, _ = _version()
    dist = "%s-%s.dist-info" % (NAME, version)
    os.makedirs(os.path.join(metadata_directory, dist), exist_ok=True)
    with open(os.path.join(metadata_directory, dist, "METADATA"), "w") as f:
        f.write(_metadata(version))
    return dist


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version, soname = _version()
    lib = _library(soname)
    if lib:
        print("psd_build: bundling %s" % lib, file=sys.stderr)
    elif _system_library(soname):
        print("psd_build: no build of libpsclient found (bash deploy/build.sh, or "
              "PSD_BUILD_DIR): the package will load the system's %s" % soname, file=sys.stderr)
    else:  # a package that cannot load its library must not install
        raise SystemExit(
            "psd_build: there is no libpsclient to bundle (no %s in %s) and none installed: "
            "build it first with `bash deploy/build.sh` in the checkout, then run pip install "
            "./python again (or set PSD_BUILD_DIR to a build directory)"
            % (soname, os.path.join(_build_dir(), "lib")))
    return _write_wheel(wheel_directory, _files(lib, soname), lib is None, version)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """An editable install: a .pth file that puts python/ on sys.path (the
    package then finds the library through PSD_LIBPSCLIENT or the system)."""
    version, _ = _version()
    return _write_wheel(wheel_directory, [("psd-editable.pth", (HERE + "\n").encode())], True,
                        version)


def build_sdist(sdist_directory, config_settings=None):
    version, _ = _version()
    base = "%s-%s" % (NAME, version)
    name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as t:
        for sub in ("pyproject.toml", "_build", "psd"):
            t.add(os.path.join(HERE, sub), arcname=base + "/" + sub,
                  filter=lambda i: None if "__pycache__" in i.name else i)
        meta = _metadata(version).encode()
        info = tarfile.TarInfo(base + "/PKG-INFO")
        info.size = len(meta)
        t.addfile(info, io.BytesIO(meta))
    return name
