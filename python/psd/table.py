"""Table: a sparse embedding table (ps_table). Rows live only on the
servers; a step moves the rows a batch touches. Keys are any 64-bit
integers (NumPy arrays, lists, or torch tensors through .numpy())."""
import ctypes
from typing import Optional

import numpy as np

from . import config
from ._lib import lib

READ_ONLY = 1  # PS_TABLE_READ_ONLY: unknown keys read as the initializer's values


def keys_array(keys) -> np.ndarray:
    """``keys`` as a contiguous uint64 array (signed keys keep their bits)."""
    if hasattr(keys, "detach"):  # a torch tensor
        keys = keys.detach().cpu().numpy()
    k = np.asarray(keys)
    if k.dtype.kind == "i":
        k = k.astype(np.int64, copy=False).view(np.uint64)
    elif k.dtype.kind == "u":
        k = k.astype(np.uint64, copy=False)
    elif k.size == 0:
        k = k.astype(np.uint64)
    else:
        raise TypeError("table keys must be integers, got an array of %s" % k.dtype)
    return np.ascontiguousarray(k.reshape(-1))


def _ptr(a: np.ndarray, ctype):
    return a.ctypes.data_as(ctypes.POINTER(ctype)) if a.size else None


class Table:
    """A sparse table created by Client.table(): rows of ``dim`` float32
    values keyed by uint64, initialized on first use from (seed, name,
    key), updated per row on the servers by the table's optimizer."""

    def __init__(self, client, h: int, name: str, dim: int):
        self.client, self._h, self.name, self.dim = client, h, name, dim

    def _grads(self, keys: np.ndarray, grads) -> np.ndarray:
        g = np.ascontiguousarray(grads, dtype=np.float32)
        if g.size != keys.size * self.dim:
            raise ValueError("table %r: %d keys need %d x %d gradient values, got shape %s"
                             % (self.name, keys.size, keys.size, self.dim, g.shape))
        return g

    def pull_async(self, keys, min_step: int = 0, read_only: bool = False,
                   out: Optional[np.ndarray] = None):
        """Asks for the rows of ``keys`` at a step >= min_step (0: the
        latest; after step() returns, the table has reached that step).
        Returns a Request whose ``rows`` (shape
        (len(keys), dim)) holds them once ``wait()`` returns."""
        from .client import Request
        k = keys_array(keys)
        if out is None:
            out = np.empty((k.size, self.dim), dtype=np.float32)
        elif (not isinstance(out, np.ndarray) or out.dtype != np.float32 or
              not out.flags.c_contiguous or not out.flags.writeable or
              out.size != k.size * self.dim):
            raise ValueError("table %r: out must be a writable C-contiguous float32 array "
                             "of %d x %d" % (self.name, k.size, self.dim))
        ms = config.count("min_step", min_step)
        req = ctypes.c_void_p()
        self.client._call(lib.ps_table_pull_async, ms, _ptr(k, ctypes.c_uint64),
                          k.size, _ptr(out, ctypes.c_float), READ_ONLY if read_only else 0,
                          ctypes.byref(req), on=self._h)
        r = Request(self.client, req.value, keep=(out,))
        r.rows = out
        return r

    def pull(self, keys, min_step: int = 0, read_only: bool = False,
             out: Optional[np.ndarray] = None) -> np.ndarray:
        """The rows of ``keys`` (any order, duplicates allowed) as a
        (len(keys), dim) float32 array; waits for the table's step in sync
        mode. ``read_only``: keys with no stored row read as their
        initializer's values and are not created (evaluation)."""
        r = self.pull_async(keys, min_step, read_only, out)
        r.wait()
        return r.rows

    def add_grad(self, keys, grads) -> None:
        """Stages gradients (len(keys) x dim) for the next Client.step();
        duplicate keys are summed. Copies what it is given."""
        k = keys_array(keys)
        g = self._grads(k, grads)
        self.client._call(lib.ps_table_add_grad, _ptr(k, ctypes.c_uint64), k.size,
                          _ptr(g, ctypes.c_float), on=self._h)

    def push_async(self, keys, grads, step: Optional[int] = None):
        """Pushes gradients computed at ``step`` (None: the current step)
        now, outside Client.step(); returns a Request."""
        from .client import Request
        k = keys_array(keys)
        g = self._grads(k, grads)
        s = self.client.current_step if step is None else config.count("step", step)
        req = ctypes.c_void_p()
        self.client._call(lib.ps_table_push_async, s, _ptr(k, ctypes.c_uint64),
                          k.size, _ptr(g, ctypes.c_float), ctypes.byref(req), on=self._h)
        return Request(self.client, req.value)

    def __repr__(self):
        return "<psd.Table %r dim=%d>" % (self.name, self.dim)
