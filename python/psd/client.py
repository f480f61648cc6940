"""Client, Variable and Request: the NumPy layer over ps_client, ps_var
and ps_req. Variables' values and gradients are NumPy arrays over the
library's own buffers (no copy). Every call that waits runs in C with the
GIL released (ctypes does that), and each client serializes its calls
with a lock, since a ps_client is used by one thread at a time."""
import ctypes
import threading
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

from . import _lib, config
from ._lib import lib
from .errors import Error, StateError, error_for

_ERRLEN = 1024
_ETIMEDOUT = -10  # PS_ETIMEDOUT: Request.done() says False instead of raising
# ps_wire_dtype's values by position: how gradients and parameters travel
# (servers keep float32; 16-bit only with servers of protocol 2.3).
_WIRE_DTYPES = ("f32", "bf16", "fp16")
_TRANSPORTS = ("default", "auto", "tcp", "shm")  # ps_transport, by value


class _Handle:
    """Owns one ps_client: ps_client_destroy runs when the last holder
    goes. The client, its variables, tables, requests and every array over
    its buffers hold it, so memory a NumPy array (or a tensor made from
    one) still uses is never freed under it."""

    def __init__(self, ptr: int):
        self.ptr = ptr
        self.lock = threading.RLock()

    def __del__(self):
        if self.ptr:
            lib.ps_client_destroy(self.ptr)
            self.ptr = None


def _array(ptr, shape: Tuple[int, ...], holder) -> np.ndarray:
    """A float32 array of ``shape`` over the library's buffer at ptr,
    keeping ``holder`` alive as long as the array (or a view of it)."""
    n = int(np.prod(shape))
    buf = (ctypes.c_float * n).from_address(ctypes.cast(ptr, ctypes.c_void_p).value)
    buf._holder = holder
    return np.ctypeslib.as_array(buf).reshape(shape)


def _cname(what: str, name) -> bytes:
    """``name`` for C: a str without NUL (C would end it there)."""
    if not isinstance(name, str):
        raise TypeError("a %s name must be a str, got %r" % (what, name))
    if "\0" in name:
        raise ValueError("%s name %r contains a NUL character" % (what, name))
    return name.encode()


def _shape(name: str, shape) -> Tuple[int, ...]:
    """``shape`` as a tuple of 1 to 8 integers in [1, 2**63) (ctypes would
    wrap a larger one into int64 silently), or ValueError."""
    dims = [shape] if np.ndim(shape) == 0 else list(shape)
    out = []
    for d in dims:
        try:
            out.append(config.count("shape", d, 2**63 - 1))
        except (TypeError, ValueError):
            break
    if len(out) != len(dims) or not 1 <= len(out) <= 8 or min(out) <= 0:
        raise ValueError("variable %r: shape must have 1 to 8 dimensions, each an integer "
                         "in [1, 2**63), got %r" % (name, shape))
    return tuple(out)


class Variable:
    """A dense variable (ps_var): ``data`` holds the parameters the last
    pull received, ``grad`` the gradient the next push sends; both are
    float32 arrays of ``shape`` sharing the library's memory. Owned by its
    client."""

    def __init__(self, client: "Client", h: int, name: str, shape: Tuple[int, ...],
                 trainable: bool):
        self._h, self.name, self.shape, self.trainable = h, name, shape, trainable
        self.client = client
        self._data = _array(lib.ps_var_data(h), shape, client._hd)
        self._grad = _array(lib.ps_var_grad(h), shape, client._hd)
        self.numel = int(self._data.size)

    # Read-only attributes: `v.grad = g` would only rebind the name, and the
    # push would send the library's buffer, not g. Fill them: v.grad[:] = g.
    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, _):
        raise AttributeError("%s.data is a view of the library's buffer: fill it "
                             "(%s.data[:] = values) instead of replacing it" % (self.name,
                                                                               self.name))

    @property
    def grad(self) -> np.ndarray:
        return self._grad

    @grad.setter
    def grad(self, _):
        raise AttributeError("%s.grad is a view of the library's buffer, which the push "
                             "sends: fill it (%s.grad[:] = gradient) instead of replacing "
                             "it" % (self.name, self.name))

    def bind_buffers(self, data_ptr: Optional[int], grad_ptr: Optional[int]) -> None:
        """Pulls land at address data_ptr and pushes send from grad_ptr
        (numel float32 each, the caller's memory; None: the library's own
        buffers again), from the next push or pull (ps_var_bind_buffers).
        The caller keeps that memory alive and the gradient unchanged
        until the pushes and pulls using it are done. ``data`` and
        ``grad`` (the arrays) keep showing the library's own buffers."""
        self.client._call(lib.ps_var_bind_buffers, data_ptr, grad_ptr, on=self._h)

    def set_wire_dtype(self, push: Optional[str] = None, pull: Optional[str] = None) -> None:
        """This variable's wire dtypes ("f32", "bf16", "fp16"; None keeps
        the client's), from the next push or pull (ps_var_set_wire_dtype)."""
        codes = []
        for what, d in (("push", push), ("pull", pull)):
            if d is not None and d not in _WIRE_DTYPES:
                raise ValueError(f"{what}={d!r}: must be one of {', '.join(_WIRE_DTYPES)}")
            codes.append(-1 if d is None else _WIRE_DTYPES.index(d))
        self.client._call(lib.ps_var_set_wire_dtype, *codes, on=self._h)

    def __repr__(self):
        return "<psd.Variable %r shape=%s%s>" % (self.name, self.shape,
                                                 "" if self.trainable else " not trainable")


def _ms(timeout) -> int:
    """``timeout`` seconds as C's int of milliseconds, clamped to [0,
    2**31 - 1] (ctypes would wrap a larger one silently)."""
    t = float(timeout)
    if t != t:
        raise ValueError("timeout must be a number of seconds or None, got %r" % (timeout,))
    return int(min(max(t, 0.0) * 1000, 2**31 - 1))


class Request:
    """An in-flight push or pull (ps_req). ``wait`` drives the client's I/O
    until it completes; the request is released when this object goes."""

    def __init__(self, client: "Client", h: int, keep=()):
        self._client, self._h, self._keep = client, h, keep
        self._hd = client._hd
        self.step = None  # what a completed pull received

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        """Waits up to ``timeout`` seconds (None: the client's request
        timeout). Returns the step received (a pull), or None (a push);
        raises the request's error (psd.StaleError for a push that came too
        late, psd.Timeout). A timeout is capped at 2**31 - 1 ms (24.8 days):
        C takes an int."""
        self.done(timeout, _raise_timeout=True)
        return self.step

    def done(self, timeout: float = 0.0, _raise_timeout: bool = False) -> bool:
        """Waits up to ``timeout`` seconds: True once the request has
        completed (``step`` is then set), False if it is still in flight;
        raises the request's error as wait() does, but not psd.Timeout.
        For loops that look for other work between short waits."""
        ms = -1 if timeout is None else _ms(timeout)
        step = ctypes.c_uint64(0)
        with self._hd.lock:
            self._client._live()
            if not self._h:
                raise StateError("the request was released")
            rc = lib.ps_req_wait(self._h, ms, ctypes.byref(step))
            if rc == _ETIMEDOUT and not _raise_timeout:
                return False
            self._client._check(rc)
        self.step = step.value
        return True

    def release(self) -> None:
        """Releases the request now (waiting first if it is in flight)."""
        if self._h and self._hd.ptr:
            with self._hd.lock:
                lib.ps_req_destroy(self._h)
        self._h, self._keep = None, ()

    def __del__(self):
        self.release()


class Client:
    """Connections to every parameter server of a job (ps_client).

    ``Client(hosts=["h:p", ...], worker_index=0, num_workers=1, ...)`` takes
    the fields of ps_config as keywords (push_dtype and pull_dtype by name:
    "f32", "bf16" or "fp16"; transport: "default" ($PS_TRANSPORT, else
    auto), "auto", "tcp" or "shm"); ``Client.from_env()`` reads what
    psrun sets (PS_HOSTS, PS_WORKER_INDEX, ...). Use it as a context
    manager: leaving the block normally (or by psd.Stopped) calls
    ``finish()``, then the connections close."""

    def __init__(self, hosts: Sequence[str], worker_index: int = 0, num_workers: int = 1,
                 replicas_to_aggregate: int = 0, async_mode: bool = False,
                 connect_timeout_ms: int = 0, request_timeout_ms: int = 0,
                 split_threshold: int = 0, max_slice_bytes: int = 0,
                 credential: Optional[bytes] = None, munge: bool = False,
                 munge_socket: Optional[str] = None, job_id: int = 0, step_id: int = 0,
                 telemetry: Optional[str] = None, signal_handlers: bool = True,
                 push_dtype: str = "f32", pull_dtype: str = "f32",
                 transport: str = "default", _ptr=None):
        self._vars: Dict[str, Variable] = {}
        self._tables: Dict[str, "Table"] = {}
        self._finished = False
        self._deferred: Optional[BaseException] = None  # raised by the next step()
        self.stale = False  # the last step() skipped ahead past a stale push
        self.average_step = 0  # the step the last pull_average()'s averages include
        if _ptr is None:
            _ptr = self._create(hosts, locals())
        self._hd = _Handle(_ptr)
        self._h = _ptr

    @staticmethod
    def _create(hosts, kw):
        hosts = hosts.split(",") if isinstance(hosts, str) else list(hosts)
        cfg = _lib.sized(_lib.Config, lib.ps_config_init_sized)
        arr = (ctypes.c_char_p * max(1, len(hosts)))(*[h.encode() for h in hosts])
        cfg.hosts, cfg.num_ps = arr, len(hosts)
        for f in ("worker_index", "num_workers", "replicas_to_aggregate", "connect_timeout_ms",
                  "request_timeout_ms"):
            setattr(cfg, f, config.count(f, kw[f], 2**31 - 1))
        cfg.split_threshold = config.count("split_threshold", kw["split_threshold"])
        cfg.max_slice_bytes = config.count("max_slice_bytes", kw["max_slice_bytes"])
        cfg.async_mode, cfg.munge = int(bool(kw["async_mode"])), int(bool(kw["munge"]))
        cred = kw["credential"]
        if cred is not None:
            cred = bytes(cred)
            cfg.credential = ctypes.cast(ctypes.c_char_p(cred), ctypes.c_void_p)
            cfg.credential_len = len(cred)
        cfg.munge_socket = kw["munge_socket"].encode() if kw["munge_socket"] else None
        cfg.job_id, cfg.step_id = int(kw["job_id"]), int(kw["step_id"])
        cfg.telemetry = kw["telemetry"].encode() if kw["telemetry"] is not None else None
        cfg.no_signal_handlers = 0 if kw["signal_handlers"] else 1
        for f in ("push_dtype", "pull_dtype"):  # ps_wire_dtype, by name
            if kw[f] not in _WIRE_DTYPES:
                raise ValueError(f"{f}={kw[f]!r}: must be one of {', '.join(_WIRE_DTYPES)}")
            setattr(cfg, f, _WIRE_DTYPES.index(kw[f]))
        if kw["transport"] not in _TRANSPORTS:
            raise ValueError(f"transport={kw['transport']!r}: must be one of {', '.join(_TRANSPORTS)}")
        cfg.transport = _TRANSPORTS.index(kw["transport"])
        out, err = ctypes.c_void_p(), ctypes.create_string_buffer(_ERRLEN)
        rc = lib.ps_client_create(ctypes.byref(cfg), ctypes.byref(out), err, _ERRLEN)
        if rc:
            raise error_for(rc, err.value.decode(errors="replace"))
        return out.value

    @classmethod
    def from_env(cls) -> "Client":
        """A client configured from the environment psrun sets (see
        ps_client_create_from_env in psclient.h for every variable)."""
        out, err = ctypes.c_void_p(), ctypes.create_string_buffer(_ERRLEN)
        rc = lib.ps_client_create_from_env(ctypes.byref(out), err, _ERRLEN)
        if rc:
            raise error_for(rc, err.value.decode(errors="replace"))
        return cls(hosts=(), _ptr=out.value)

    # ------------------------------------------------------------ plumbing

    def _live(self):
        if not self._hd.ptr or self._h is None:
            raise StateError("the client is closed")

    def _check(self, rc: int) -> None:
        if rc < 0:
            raise error_for(rc, lib.ps_client_errmsg(self._h).decode(errors="replace"))

    def _defer(self, exc: BaseException) -> None:
        """Keeps the first error of a callback that must not raise (an
        autograd hook) for the next step() to raise."""
        if self._deferred is None:
            self._deferred = exc

    def _raise_deferred(self) -> None:
        if self._deferred is not None:
            exc, self._deferred = self._deferred, None
            raise exc

    def _call(self, fn, *args, on=None) -> None:
        """fn(handle, *args) under the lock; handle: the client's, or
        ``on`` (a table's). A negative return raises its exception."""
        with self._hd.lock:
            self._live()
            self._check(fn(self._h if on is None else on, *args))

    # ---------------------------------------------------------- properties

    @property
    def worker_index(self) -> int:
        """This worker's index; 0 is the chief."""
        self._live()
        return lib.ps_client_worker_index(self._h)

    @property
    def is_chief(self) -> bool:
        return self.worker_index == 0

    @property
    def num_workers(self) -> int:
        self._live()
        return lib.ps_client_num_workers(self._h)

    @property
    def num_ps(self) -> int:
        self._live()
        return lib.ps_client_num_ps(self._h)

    def transport(self, ps: int) -> str:
        """How tensors travel to ps task `ps`: "shm" or "tcp"."""
        self._live()
        if not 0 <= ps < self.num_ps:
            raise IndexError(f"ps {ps}: this client has {self.num_ps} ps tasks")
        return lib.ps_client_transport(self._h, ps).decode()

    @property
    def current_step(self) -> int:
        """The step the last step() or pull() returned (0 before)."""
        return lib.ps_client_step_current(self._h) if self._hd.ptr else 0

    @property
    def stop_step(self) -> int:
        """After psd.Stopped: the step of the stop checkpoint, the step the
        next run resumes from, the same in every worker (current_step can be
        one less in a worker whose last pull raced the stop). 0 before."""
        return lib.ps_client_stop_step(self._h) if self._hd.ptr else 0

    @property
    def variables(self) -> Dict[str, Variable]:
        """The variables this client created, by name, in creation order."""
        return dict(self._vars)

    # ----------------------------------------------------------- variables

    def variable(self, name: str, shape, init: Optional[config.Init] = None,
                 optimizer: Optional[config.Optimizer] = None,
                 values: Optional[np.ndarray] = None,
                 from_chief: bool = False) -> Variable:
        """Creates variable ``name`` on the servers or attaches to it
        (ps_client_var_create): the chief initializes it with ``init``, the
        others wait for its values. ``optimizer`` None is SGD at lr 0.01.
        ``values`` (an array of ``shape``): the chief's initial values
        instead of an initializer (ps_client_var_create_values; pretrained
        weights); the other workers pass ``from_chief=True`` (or their own
        values, ignored) to receive them. Creating a name again with the
        same settings returns the same Variable; different ones raise
        ShapeError or ConfigMismatch."""
        cname = _cname("variable", name)
        shape = _shape(name, shape)
        dims = (ctypes.c_int64 * len(shape))(*shape)
        opt = config.optimizer_struct(optimizer)
        out = ctypes.c_void_p()
        if values is not None or from_chief:
            if init is not None:
                raise ValueError("variable %r: give init or values, not both" % name)
            vals = None
            if values is not None:
                vals = np.ascontiguousarray(values, dtype=np.float32)
                if vals.size != int(np.prod(shape)):
                    raise ValueError("variable %r: values have %d elements, shape %r needs %d"
                                     % (name, vals.size, shape, int(np.prod(shape))))
            self._call(lib.ps_client_var_create_values, cname, dims, len(shape),
                       None if vals is None else vals.ctypes.data_as(_lib.FP),
                       ctypes.byref(opt), ctypes.byref(out))
        else:
            ini = config.init_struct(init)
            self._call(lib.ps_client_var_create, cname, dims, len(shape),
                       ctypes.byref(ini), ctypes.byref(opt), ctypes.byref(out))
        if name in self._vars:
            return self._vars[name]
        v = Variable(self, out.value, name, shape, opt.kind != config._OPT_NONE)
        self._vars[name] = v
        return v

    def table(self, name: str, dim: int, capacity: int,
              optimizer: Optional[config.TableOptimizer] = None,
              init: Optional[config.Init] = None, admit_count: int = 0,
              admit_prob: float = 0.0, evict_after_steps: int = 0) -> "Table":
        """Creates sparse table ``name`` (rows of ``dim`` floats, at most
        ``capacity`` rows) or attaches to it; see psd.Table."""
        from .table import Table
        cname = _cname("table", name)
        cfg = config.table_struct(dim, capacity, optimizer, init, admit_count, admit_prob,
                                  evict_after_steps)
        out = ctypes.c_void_p()
        self._call(lib.ps_client_table_create, cname, ctypes.byref(cfg),
                   ctypes.byref(out))
        if name not in self._tables:
            self._tables[name] = Table(self, out.value, name, int(dim))
        return self._tables[name]

    def _list(self, vars: Optional[Iterable[Variable]]):
        if vars is None:
            return None, 0
        vars = list(vars)
        for v in vars:
            if not isinstance(v, Variable) or v.client is not self:
                raise ValueError("%r is not a variable of this client" % (v,))
        return _lib.handles(vars)

    # ---------------------------------------------------------------- steps

    def pull(self, min_step: int = 0) -> int:
        """Pulls every variable at a step >= min_step (and waits for every
        table there); returns the step received. A resumed job starts
        with ``step = client.pull()``."""
        got = ctypes.c_uint64(0)
        self._call(lib.ps_client_pull, config.count("min_step", min_step), ctypes.byref(got))
        return got.value

    def pull_average(self, vars: Iterable[Variable]) -> Dict[str, np.ndarray]:
        """The moving averages the servers keep of ``vars`` (each created
        with an optimizer's ``average``), as new float32 arrays by variable
        name, for evaluation (ps_client_pull_average): the variables'
        ``data`` is left alone, so training goes on from the parameters.
        ``average_step`` becomes the step the averages include. Needs psd
        0.2.7; a variable without an average is psd.InvalidArgument naming it;
        another request of this client in flight is psd.StateError."""
        vars = list(vars)
        arr, n = self._list(vars)
        outs = [np.empty(v.shape, dtype=np.float32) for v in vars]
        ptrs = (ctypes.POINTER(ctypes.c_float) * max(1, n))(
            *[o.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) for o in outs])
        got = ctypes.c_uint64(0)
        self._call(lib.ps_client_pull_average, arr, n, ptrs, ctypes.byref(got))
        self.average_step = got.value
        return {v.name: o for v, o in zip(vars, outs)}

    def step(self) -> int:
        """One synchronous step (ps_client_step) from ``current_step``:
        pushes every trainable variable's ``grad`` and the tables' staged
        gradients, pulls the next step's parameters into ``data``, and
        returns the new step. ``stale`` tells whether the push came too
        late (the client skipped ahead). Raises psd.Stopped when the job
        stops on request, and first of all an error a backward hook kept
        (psd.torch), without pushing."""
        self._raise_deferred()
        step, stale = ctypes.c_uint64(self.current_step), ctypes.c_int(0)
        self._call(lib.ps_client_step, ctypes.byref(step), ctypes.byref(stale))
        self.stale = bool(stale.value)
        return step.value

    def step_push(self, vars: Iterable[Variable]) -> None:
        """Sends these variables' gradients now, as part of the coming
        step() (ps_client_step_push): for pushes that overlap the rest of
        a backward pass. Their ``grad`` must not change until step()."""
        arr, n = self._list(vars)
        self._call(lib.ps_client_step_push, self.current_step, arr, n)

    def push_async(self, vars: Optional[Iterable[Variable]] = None,
                   step: Optional[int] = None) -> Request:
        """Pushes the gradients of ``vars`` (None: every trainable one)
        computed at ``step`` (None: current_step)."""
        arr, n = self._list(vars)
        s = self.current_step if step is None else config.count("step", step)
        out = ctypes.c_void_p()
        self._call(lib.ps_client_push_async, s, arr, n, ctypes.byref(out))
        return Request(self, out.value)

    def pull_async(self, vars: Optional[Iterable[Variable]] = None,
                   min_step: int = 0) -> Request:
        """Asks for the parameters of ``vars`` (None: all) at a step >=
        min_step; they land in ``data`` as they arrive."""
        arr, n = self._list(vars)
        out = ctypes.c_void_p()
        self._call(lib.ps_client_pull_async, config.count("min_step", min_step), arr, n,
                   ctypes.byref(out))
        return Request(self, out.value)

    def assign(self, vars: Optional[Iterable[Variable]] = None,
               step: Optional[int] = None) -> None:
        """The chief sets the values of ``vars`` (None: all) to what their
        ``data`` holds (ps_client_var_assign), at ``step`` (None:
        current_step): every worker's next step pulls them."""
        arr, n = self._list(vars)
        s = self.current_step if step is None else config.count("step", step)
        self._call(lib.ps_client_var_assign, arr, n, s)

    def wake(self) -> None:
        """Ends a Request.wait or done with a timeout that another thread
        is in (or the next one) at once, the request still in flight
        (ps_client_wake): the one call that may come from another thread
        while the client is in use."""
        ptr = self._hd.ptr
        if ptr:
            lib.ps_client_wake(ptr)

    def request_stop(self) -> None:
        """Asks the job to stop after a checkpoint; the next step() raises
        psd.Stopped once every server has written it."""
        if self._hd.ptr:
            lib.ps_client_request_stop(self._h)

    def finish(self) -> None:
        """Tells every server this worker is done (once)."""
        if not self._finished:
            self._call(lib.ps_client_finish)
            self._finished = True

    def close(self) -> None:
        """Closes the connections now (without finish: the servers see the
        worker leave). Arrays over the variables' buffers (and a
        DistributedModule's parameters) stay valid: that memory is freed
        with the last of them. A call another thread has in flight
        finishes first (the lock: a ps_client is used by one thread at a
        time)."""
        with self._hd.lock:
            if self._hd.ptr:
                lib.ps_client_close(self._hd.ptr)
            self._vars.clear()
            self._tables.clear()
            self._h = None
            self._hd = _Handle(0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            stopped = isinstance(exc, Error) and exc.name == "PS_ESTOPPED"
            if (exc_type is None or stopped) and self._h is not None:
                self.finish()  # (unless the block closed the client itself)
        finally:
            self.close()

    def __repr__(self):
        if self._h is None:
            return "<psd.Client closed>"
        return "<psd.Client worker %d of %d, %d ps, step %d>" % (
            self.worker_index, self.num_workers, self.num_ps, self.current_step)
