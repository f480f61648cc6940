"""The C library under the package: finding libpsclient, the ctypes
layouts of its sized structs and the prototypes of its functions.

Every struct here mirrors psclient.h field for field; the library reads
only the bytes ``struct_size`` covers, so a library newer than this
package still accepts them (docs/abi.md)."""
import ctypes
import os

from ._version import SONAME

_c = ctypes
size_t, u32, u64, dbl, cint = _c.c_size_t, _c.c_uint32, _c.c_uint64, _c.c_double, _c.c_int


class Config(_c.Structure):
    """ps_config."""
    _fields_ = [("struct_size", size_t), ("hosts", _c.POINTER(_c.c_char_p)),
                ("num_ps", cint), ("worker_index", cint), ("num_workers", cint),
                ("replicas_to_aggregate", cint), ("async_mode", cint),
                ("connect_timeout_ms", cint), ("request_timeout_ms", cint),
                ("split_threshold", u64), ("max_slice_bytes", u64),
                ("credential", _c.c_void_p), ("credential_len", size_t),
                ("munge", cint), ("munge_socket", _c.c_char_p),
                ("job_id", _c.c_longlong), ("step_id", _c.c_longlong),
                ("telemetry", _c.c_char_p), ("no_signal_handlers", cint),
                ("push_dtype", cint), ("pull_dtype", cint), ("transport", cint)]


class Optimizer(_c.Structure):
    """ps_optimizer."""
    _fields_ = [("struct_size", size_t), ("kind", cint), ("lr", dbl), ("momentum", dbl),
                ("nesterov", cint), ("beta1", dbl), ("beta2", dbl), ("epsilon", dbl),
                ("decay", cint), ("decay_rate", dbl), ("decay_steps", u64),
                ("weight_decay", dbl), ("warmup_steps", u64), ("total_steps", u64),
                ("min_lr_factor", dbl), ("mean_scale", dbl), ("lr_scale", dbl),
                ("initial_accumulator", dbl), ("alpha", dbl), ("centered", cint),
                ("decoupled_weight_decay", cint), ("torch_epsilon", cint),
                ("average", cint), ("average_decay", dbl), ("aggregate", cint)]


class Init(_c.Structure):
    """ps_init."""
    _fields_ = [("struct_size", size_t), ("kind", cint), ("a", dbl), ("b", dbl),
                ("seed", u64)]


class TableConfig(_c.Structure):
    """ps_table_config."""
    _fields_ = [("struct_size", size_t), ("dim", u32), ("capacity", u64), ("init", Init),
                ("opt", cint), ("lr", dbl), ("initial_accumulator", dbl), ("beta1", dbl),
                ("beta2", dbl), ("epsilon", dbl), ("l1", dbl), ("l2", dbl),
                ("ftrl_beta", dbl), ("admit_count", u32), ("admit_prob", dbl),
                ("evict_after_steps", u64), ("decay", cint), ("decay_rate", dbl),
                ("decay_steps", u64), ("warmup_steps", u64), ("total_steps", u64),
                ("min_lr_factor", dbl)]


P = _c.c_void_p  # every opaque handle (ps_client *, ps_var *, ps_req *, ps_table *)
PP = _c.POINTER(_c.c_void_p)
FP = _c.POINTER(_c.c_float)
U64P = _c.POINTER(u64)

# name: (restype, argtypes)
_PROTOS = {
    "ps_strerror": (_c.c_char_p, [cint]),
    "ps_err_name": (_c.c_char_p, [cint]),
    "ps_optimizer_default_sized": (None, [_c.POINTER(Optimizer), size_t, dbl]),
    "ps_init_init_sized": (None, [_c.POINTER(Init), size_t]),
    "ps_init_fill": (cint, [_c.POINTER(Init), _c.c_char_p, _c.POINTER(_c.c_int64), cint, FP,
                            size_t]),
    "ps_config_init_sized": (None, [_c.POINTER(Config), size_t]),
    "ps_table_config_init_sized": (None, [_c.POINTER(TableConfig), size_t]),
    "ps_client_create": (cint, [_c.POINTER(Config), PP, _c.c_char_p, size_t]),
    "ps_client_create_from_env": (cint, [PP, _c.c_char_p, size_t]),
    "ps_client_destroy": (None, [P]),
    "ps_client_close": (None, [P]),
    "ps_client_errmsg": (_c.c_char_p, [P]),
    "ps_client_wake": (cint, [P]),
    "ps_client_worker_index": (cint, [P]),
    "ps_client_num_workers": (cint, [P]),
    "ps_client_num_ps": (cint, [P]),
    "ps_client_transport": (_c.c_char_p, [P, cint]),
    "ps_client_var_create": (cint, [P, _c.c_char_p, _c.POINTER(_c.c_int64), cint,
                                    _c.POINTER(Init), _c.POINTER(Optimizer), PP]),
    "ps_client_var_create_values": (cint, [P, _c.c_char_p, _c.POINTER(_c.c_int64), cint, FP,
                                           _c.POINTER(Optimizer), PP]),
    "ps_var_data": (FP, [P]),
    "ps_var_grad": (FP, [P]),
    "ps_var_numel": (size_t, [P]),
    "ps_var_set_wire_dtype": (cint, [P, cint, cint]),
    "ps_var_bind_buffers": (cint, [P, _c.c_void_p, _c.c_void_p]),
    "ps_client_var_assign": (cint, [P, PP, size_t, u64]),
    "ps_client_step_current": (u64, [P]),
    "ps_client_stop_step": (u64, [P]),
    "ps_version": (_c.c_char_p, []),
    "ps_client_push_async": (cint, [P, u64, PP, size_t, PP]),
    "ps_client_pull_async": (cint, [P, u64, PP, size_t, PP]),
    "ps_req_wait": (cint, [P, cint, U64P]),
    "ps_req_destroy": (None, [P]),
    "ps_client_step": (cint, [P, U64P, _c.POINTER(cint)]),
    "ps_client_step_push": (cint, [P, u64, PP, size_t]),
    "ps_client_pull": (cint, [P, u64, U64P]),
    "ps_client_pull_average": (cint, [P, PP, size_t, _c.POINTER(FP), U64P]),
    "ps_client_finish": (cint, [P]),
    "ps_client_request_stop": (None, [P]),
    "ps_client_table_create": (cint, [P, _c.c_char_p, _c.POINTER(TableConfig), PP]),
    "ps_table_pull_async": (cint, [P, u64, U64P, size_t, FP, _c.c_uint, PP]),
    "ps_table_add_grad": (cint, [P, U64P, size_t, FP]),
    "ps_table_push_async": (cint, [P, u64, U64P, size_t, FP, PP]),
}


def _candidates():
    """Where the library is looked for, in order: $PSD_LIBPSCLIENT, a copy
    inside the package (pip install ./python after a build), build/lib of
    the checkout the package is in (python/psd), PREFIX/lib when the package
    sits in PREFIX/lib/pythonX.Y/{dist,site}-packages (cmake --install),
    then the system's loader by its SONAME."""
    env = os.environ.get("PSD_LIBPSCLIENT")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    out = [os.path.join(here, "_lib", SONAME)]
    parent = os.path.dirname(here)
    if os.path.basename(parent) == "python":  # a checkout: python/psd
        out.append(os.path.join(os.path.dirname(parent), "build", "lib", SONAME))
    if os.path.basename(parent) in ("dist-packages", "site-packages") and \
            os.path.basename(os.path.dirname(parent)).startswith("python"):
        out.append(os.path.join(os.path.dirname(os.path.dirname(parent)), SONAME))
    return out + [SONAME]


def _untrusted(path):
    """Why a library file found by a relative path (resolved: no links)
    must not be loaded, or None: on a shared node another user could plant
    one (a checkout in /tmp), so the file and every folder above it up to
    / must belong to root or to us and be writable by no one else (sticky
    folders such as /tmp excepted): a folder others can write anywhere
    above lets them swap the subtree, even between this check and the
    load."""
    chain, p = [path], os.path.dirname(path)
    while True:
        chain.append(p)
        if os.path.dirname(p) == p:
            break
        p = os.path.dirname(p)
    for p in chain:
        st = os.stat(p)
        if st.st_uid not in (0, os.getuid()):
            return "%s belongs to uid %d" % (p, st.st_uid)
        others = st.st_mode & 0o002 or (st.st_mode & 0o020 and not _own_group(st.st_gid))
        if others and not (os.path.isdir(p) and st.st_mode & 0o1000):
            return "%s is writable by others" % p
    return None


def _own_group(gid):
    """Whether gid is the user's private group (Debian's umask 002 makes
    one's own files group-writable): named as the user, no other member."""
    import grp
    import pwd
    try:
        g, me = grp.getgrgid(gid), pwd.getpwuid(os.getuid())
    except KeyError:
        return False
    return gid == me.pw_gid and g.gr_name == me.pw_name and set(g.gr_mem) <= {me.pw_name}


def _load():
    tried = []
    explicit = bool(os.environ.get("PSD_LIBPSCLIENT"))
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(path + " (no such file)")
            continue
        load = path
        if not explicit and os.sep in path:
            load = os.path.realpath(path)  # the file checked is the file loaded
            why = _untrusted(load)
            if why:
                tried.append("%s (not loaded: %s)" % (path, why))
                continue
        try:
            lib = ctypes.CDLL(load)
        except OSError as e:
            tried.append("%s (%s)" % (path, e))
            continue
        missing = [n for n in _PROTOS if not hasattr(lib, n)]
        if missing:
            raise ImportError("psd: %s is too old for this package: it lacks %s "
                              "(rebuild libpsclient, or set PSD_LIBPSCLIENT)"
                              % (path, ", ".join(missing)))
        for name, (res, args) in _PROTOS.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        lib.path = path
        return lib
    raise ImportError("psd: cannot load libpsclient; tried " + "; ".join(tried) +
                      ". Build it (bash deploy/build.sh) and pip install ./python again, "
                      "install it (cmake --install), or set PSD_LIBPSCLIENT to its path")


lib = _load()


def sized(struct_type, init_fn, *args):
    """A sized struct filled with the library's own defaults."""
    s = struct_type()
    init_fn(ctypes.byref(s), ctypes.sizeof(s), *args)
    return s


def handles(items):
    """A C array of the handles of items (objects with ._h), or None."""
    if items is None:
        return None, 0
    items = list(items)
    arr = (ctypes.c_void_p * max(1, len(items)))(*[i._h for i in items])
    return arr, len(items)
