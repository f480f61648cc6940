"""A rank restarted by ``psrun --restart-workers`` rejoins a DDP job on the
psd backend with the others' state (docs/python.md, "A restarted rank
rejoins").

The other ranks are waiting, inside a training step, for the dead rank's
part of a collective. The restarted rank runs the script from the top;
its DDP start-up collectives are answered locally (its state is replaced
anyway), and psd.torch.Checkpoint's line asks for the state:

1. it pushes a request (its rank) to the variable c10d/rejoin/req;
2. rank 0 (rank 1 when rank 0 is the one restarted) notices it while it
   waits for that rank's part (its collective thread looks once a
   second, only while waiting) and sends what the step it waits in
   started from: the model's state, the optimizer's and the scheduler's,
   the step, the place in the data, how many calls of each kind the
   ranks had made and DDP's bucket layout; or a sentence saying why the
   rank cannot rejoin;
3. the restarted rank loads it and redoes that step with the others: its
   parts the dead process had already pushed are taken as given.

Everything travels through the job's servers, in two "first"-rule
variables (psd.Mean(aggregate="first")): c10d/rejoin/hdr says what was
sent and c10d/rejoin/blob/<n> holds it, as 16-bit pieces in float32.
"""
import collections
import functools
import io
import json
import struct
import sys
import time
from typing import Callable, Optional, Tuple

import numpy as np
import torch

from .config import Mean, Zeros

REQ, HDR = "c10d/rejoin/req", "c10d/rejoin/hdr"
# hdr: status, rank + 1, the request's step and the blob's bytes (each as
# three 16-bit pieces), spares
HDR_N = 12
FORMAT = 1
OK, REFUSED = 1.0, 2.0
# How often a waiting rank looks for a request: it looks only while one of
# its collectives has waited this long, so a job that nobody rejoins pays
# nothing.
POLL_S = 1.0
# How often the restarted rank says whom it still waits for.
TELL_S = 30.0


class RejoinRefused(RuntimeError):
    """The running ranks cannot take this rank back; the message says why
    and what to do."""


def _var(client, name: str, n: int):
    v = client.variable(name, (n,), init=Zeros(), optimizer=Mean(1.0, "first"))
    v.set_wire_dtype("f32", "f32")  # exact whatever the job's wire dtype
    return v


def _step_of(client, v) -> int:
    """The variable's current step (a pull of what is there now)."""
    req = client.pull_async([v], min_step=0)
    try:
        return req.wait()
    finally:
        req.release()


def _push(client, v, step: int) -> None:
    req = client.push_async([v], step=step)
    try:
        req.wait()
    finally:
        req.release()


def _u16(x: int):
    return [float(x & 0xFFFF), float((x >> 16) & 0xFFFF), float((x >> 32) & 0xFFFF)]


def _from_u16(a) -> int:
    return int(a[0]) | int(a[1]) << 16 | int(a[2]) << 32


def _to_floats(b: bytes) -> np.ndarray:
    if len(b) % 2:
        b += b"\0"
    return np.frombuffer(b, dtype="<u2").astype(np.float32)


def _from_floats(f: np.ndarray, nbytes: int) -> bytes:
    return np.rint(f).astype("<u2").tobytes()[:nbytes]


# ------------------------------------------------------- the waiting rank

class Server:
    """Runs in a waiting rank's collective thread (it owns the client):
    ``poll()`` answers a new request with ``provider()``'s state."""

    def __init__(self, client, rank: int, provider: Callable[[int], Tuple[bool, bytes]]):
        self.client, self.rank, self.provider = client, rank, provider
        self.req = self.hdr = None
        self.last = 0.0

    def poll(self) -> None:
        """A request is pending when the req variable's step is past the
        one the last answer (in hdr) was for: no state kept here, so a
        rank that was itself restarted answers too."""
        now = time.monotonic()
        if now - self.last < POLL_S:
            return
        self.last = now
        if self.req is None:
            self.req, self.hdr = _var(self.client, REQ, 2), _var(self.client, HDR, HDR_N)
        step = _step_of(self.client, self.req)  # and its data: who asks
        if step == 0:
            return
        _step_of(self.client, self.hdr)
        if step <= _from_u16(self.hdr.data[2:5]):
            return
        who = int(round(float(self.req.data[0]))) - 1
        if who < 0 or (who == 0) != (self.rank == 1):
            return  # rank 0 answers every rank but itself, rank 1 answers rank 0
        ok, blob = self.provider(who)
        self._send(who, step, ok, blob)

    def _send(self, who: int, req_step: int, ok: bool, blob: bytes) -> None:
        # hdr first: a restarted chief (rank 0) creates the blob's variable
        # once it knows its size, and this rank attaches to it then.
        h = _step_of(self.client, self.hdr)
        self.hdr.grad[:] = [OK if ok else REFUSED, who + 1] + _u16(req_step) + \
            _u16(len(blob)) + [0.0] * 4
        _push(self.client, self.hdr, h)
        f = _to_floats(blob)
        v = _var(self.client, _blob_name(req_step, f.size), int(f.size))
        v.grad[:] = f
        _push(self.client, v, 0)
        print("psd backend: rank %d sent %s to restarted rank %d (%d bytes)"
              % (self.rank, "its state" if ok else "a refusal", who, len(blob)),
              file=sys.stderr, flush=True)


def _blob_name(req_step: int, n: int) -> str:
    """A variable of its own for each request: its first step is the blob."""
    return "c10d/rejoin/blob/%d/%d" % (req_step, n)


def create(client) -> None:
    """The chief creates the request's and the answer's variables at the
    start (a worker only attaches to what the chief created, and the chief
    may be the rank that dies)."""
    _var(client, REQ, 2)
    _var(client, HDR, HDR_N)


# ------------------------------------------------------- the restarted rank

def request(client, rank: int, timeout_s: float) -> bytes:
    """Asks the running ranks for their state and returns it (bytes of a
    torch.save), waiting up to timeout_s; raises RejoinRefused with their
    reason."""
    req, hdr = _var(client, REQ, 2), _var(client, HDR, HDR_N)
    answerer = 1 if rank == 0 else 0
    h0 = _step_of(client, hdr)
    k = _step_of(client, req)
    req.grad[:] = [rank + 1, 0]
    _push(client, req, k)
    start = told = time.monotonic()
    while True:
        pull = client.pull_async([hdr], min_step=h0 + 1)
        try:
            while not pull.done(POLL_S):
                now = time.monotonic()
                if now - start > timeout_s:
                    raise RejoinRefused(
                        "psd backend: restarted rank %d waited %.0f s (the process group's "
                        "timeout) for rank %d's state; rank %d answers while it waits in a "
                        "collective for this rank, which it is not doing (is the script "
                        "the same on every rank, with psd.torch.Checkpoint?)"
                        % (rank, now - start, answerer, answerer))
                if now - told > TELL_S:
                    told = now
                    print("psd backend: restarted rank %d still waits for rank %d's state "
                          "(%.0f s)" % (rank, answerer, now - start), flush=True,
                          file=sys.stderr)
            got = pull.step
        finally:
            pull.release()
        d = hdr.data.copy()
        if int(d[1]) == rank + 1 and _from_u16(d[2:5]) == k + 1:
            break
        h0 = got  # another rank's answer: wait for the next
    nbytes = _from_u16(d[5:8])
    n = (nbytes + 1) // 2
    v = _var(client, _blob_name(k + 1, n), n)
    pull = client.pull_async([v], min_step=1)
    try:
        pull.wait(timeout_s)
    finally:
        pull.release()
    blob = _from_floats(v.data, nbytes)
    if d[0] != OK:
        raise RejoinRefused(blob.decode("utf-8", "replace"))
    return blob


# The state travels as JSON of plain values, tagged so that tuples, ordered
# dicts and non-string keys come back as they were, beside a torch.save of
# its tensors alone: nothing in it can import or call anything (torch
# 1.13's weights_only loader cannot read floats, and its torch.load
# ignores a restricted pickle_module).

def _enc(x, tensors: list):
    if isinstance(x, torch.Tensor):
        tensors.append(x.detach().cpu())
        return {"T": len(tensors) - 1}
    if isinstance(x, dict):
        tag = "O" if isinstance(x, collections.OrderedDict) else "D"
        return {tag: [[_enc(k, tensors), _enc(v, tensors)] for k, v in x.items()]}
    if isinstance(x, (list, tuple)):
        return {"L" if isinstance(x, list) else "U": [_enc(v, tensors) for v in x]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError("psd.rejoin: cannot send a %s in a rank's state (tensors and plain "
                    "Python values can be sent)" % type(x).__name__)


def _dec(x, tensors: list):
    if not isinstance(x, dict):
        return x
    (tag, v), = x.items()
    if tag == "T":
        return tensors[v]
    if tag in ("D", "O"):
        d = collections.OrderedDict() if tag == "O" else {}
        for k, val in v:
            d[_dec(k, tensors)] = _dec(val, tensors)
        return d
    items = [_dec(e, tensors) for e in v]
    return items if tag == "L" else tuple(items)


def dumps(state: dict) -> bytes:
    tensors: list = []
    head = json.dumps(_enc(state, tensors)).encode()
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return struct.pack("<Q", len(head)) + head + buf.getvalue()


def loads(blob: bytes) -> dict:
    """The state a running rank sent (tensors and plain values only,
    whatever the bytes)."""
    n = struct.unpack_from("<Q", blob)[0]
    tensors = torch.load(io.BytesIO(blob[8 + n:]), map_location="cpu", weights_only=True)
    return _dec(json.loads(blob[8:8 + n]), tensors)


# ------------------------------------------------- DDP's bucket layout

def rebuilt_layout(recorded, numels) -> Optional[list]:
    """DDP's buckets after its rebuild, from the two int32 broadcasts its
    reducer made for it (the parameters' indices with the bucket count
    last, then each bucket's size): a list of index lists, or None when
    they do not describe a layout of these parameters."""
    if len(recorded) < 2:
        return None
    idx, sizes = recorded[-2][2].tolist(), recorded[-1][2].tolist()
    if not idx or idx[-1] != len(sizes) or sum(sizes) != len(idx) - 1 or \
            sorted(idx[:-1]) != list(range(len(numels))):
        return None
    out, at = [], 0
    for s in sizes:
        out.append(idx[at:at + s])
        at += s
    return out


def split_sum(pg, t: torch.Tensor, layout: list, numels: list):
    """A rejoined rank's first DDP bucket (every parameter, in their order,
    as DDP's first iteration has it) summed as the others' rebuilt
    buckets, one call each in their order: a Future of [t]."""
    offs = [0]
    for n in numels:
        offs.append(offs[-1] + n)
    flat = t.detach().reshape(-1)
    parts = []
    for idx in layout:
        b = torch.cat([flat[offs[i]:offs[i + 1]] for i in idx]).to(torch.float32)
        parts.append((idx, b, pg._float_sum("all_reduce(SUM, bucket of %d)" % b.numel(), b,
                                            False)))

    def gather(_):
        with torch.no_grad():
            for idx, b, _f in parts:
                at = 0
                for i in idx:
                    flat[offs[i]:offs[i + 1]].copy_(b[at:at + numels[i]])
                    at += numels[i]
        return [t]

    return torch.futures.collect_all([f for _i, _b, f in parts]).then(_raise_first).then(gather)


def _raise_first(f):
    for x in f.value():
        x.value()  # raises that part's error
    return None


# ------------------------------------------- torch's start for a restarted rank

_skip_store_barrier = False


def patch_torch_start() -> None:
    """In a restarted rank (before init_process_group): init's start-up
    barrier is skipped (the others passed it long ago and will not count
    again), and a restarted rank 0's store server does not wait for the
    others to connect (they did, to the dead process's)."""
    global _skip_store_barrier
    import importlib
    import torch.distributed as dist
    _skip_store_barrier = True
    c10d = dist.distributed_c10d
    inner_barrier = c10d._store_based_barrier

    @functools.wraps(inner_barrier)
    def barrier(*args, **kwargs):
        global _skip_store_barrier
        if _skip_store_barrier:
            _skip_store_barrier = False
            return None
        return inner_barrier(*args, **kwargs)

    c10d._store_based_barrier = barrier
    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # not the function
    inner_store = rendezvous._create_c10d_store

    @functools.wraps(inner_store)
    def create(hostname, port, rank, world_size, timeout):
        if rank != 0:
            return inner_store(hostname, port, rank, world_size, timeout)
        return dist.TCPStore(hostname, port, world_size, True, timeout,
                             wait_for_workers=False, multi_tenant=True)

    rendezvous._create_c10d_store = create
