"""The ``torch.distributed`` backend named "psd": every collective is a
step of a mean variable (psd.Mean) on the job's servers.

``import psd.torch`` registers it; under psrun (which exports RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT), ``torch.distributed.
init_process_group("psd")`` then works with no other argument, and
unmodified ``DistributedDataParallel`` trains through it: each gradient
bucket it all-reduces is pushed to the servers, which average the
workers' buckets and serve the mean.

How collectives map onto psd (docs/python.md, "The psd backend"):
- all_reduce SUM / AVG: the servers' mean (times WORLD_SIZE for SUM) in
  float32; integer tensors travel as 16-bit pieces and are summed
  exactly. MIN, MAX, PRODUCT, BAND, BOR, BXOR: an all_gather, then the
  reduction on each rank.
- all_gather, broadcast, barrier: exact, through the same mean variables
  (each rank's bytes travel as 16-bit integers in float32, in its own
  part of the vector; the mean times WORLD_SIZE is rounded back).
- Calls are matched by their order, as on every backend: the n-th call of
  one kind and size uses the same variable on every rank.

A background thread owns this worker's psd connection: a call enqueues its
operation and returns a Work whose future completes when the servers'
mean has come back, so DDP's buckets overlap the rest of backward as they
do on gloo.
"""
import collections
import os
import queue
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work, _create_work_from_future
from torch.futures import Future

from .client import Client
from .config import Mean, Zeros
from .errors import DuplicateError, StaleError

__all__ = ["ProcessGroupPsd", "register", "backend_client"]

BACKEND = "psd"
# Variables one kind and size of call rotates through: a call waits for
# the one SLOTS calls before it (same kind and size) to finish, so up to
# SLOTS equal buckets are in flight at once.
SLOTS = 4
# How long the background thread waits on the oldest operation at a time;
# a call enqueued meanwhile ends the wait at once (Client.wake), so this
# only bounds how often it checks the group's timeout.
POLL_S = 1.0
# How long the exit waits for collectives still in flight.
SHUTDOWN_S = 10

_INT16_PIECES = {torch.uint8: 1, torch.int8: 1, torch.bool: 1, torch.int16: 1,
                 torch.int32: 2, torch.int64: 4}


class BackendError(RuntimeError):
    """A collective of the psd backend failed; the message names the rank,
    the call and what to do."""


# ------------------------------------------------------------- exact bytes

def _to_pieces(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as 16-bit unsigned integers in float32 (exact: any sum of
    up to 256 of them stays below 2**24)."""
    b = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 2:
        b = torch.cat([b, b.new_zeros(1)])
    return b.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).to(torch.float32)


def _from_pieces(f: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The tensor of like's dtype and shape whose bytes f holds."""
    nbytes = like.numel() * like.element_size()
    u = f.round().to(torch.int32).to(torch.int16).view(torch.uint8)[:nbytes]
    return u.view(like.dtype).reshape(like.shape)


def _int_sum(total_pieces: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sum of integer tensors from the sums of their 16-bit pieces (as
    int64 with two's-complement wrap, then like's dtype)."""
    # Every dtype was widened to int64 before the split (_int_pieces):
    # four little-endian pieces per value, each summed exactly.
    s = total_pieces.round().to(torch.int64).reshape(like.numel(), 4)
    out = s[:, 0] + (s[:, 1] << 16) + (s[:, 2] << 32) + (s[:, 3] << 48)
    if like.dtype == torch.bool:
        return (out != 0).reshape(like.shape)
    return out.to(like.dtype).reshape(like.shape)


def _int_pieces(t: torch.Tensor) -> torch.Tensor:
    """An integer tensor as int64, then its 16-bit pieces (4 per value)."""
    return _to_pieces(t.detach().to("cpu", torch.int64))


# ------------------------------------------------------------------ engine

def _aggregate(key: str) -> str:
    """Which parts complete a step of the variables of a kind of call (psd
    0.2.8's Mean(aggregate=)), which matters with backup workers: a
    broadcast completes with its root's part alone (the others push
    nothing), exact calls and barriers with every rank's, means (DDP's
    buckets, all_reduce SUM and AVG of floats, the stop vote) with the
    job's N - K."""
    if key.startswith("x/bcast/"):
        return "first"
    if key.startswith(("x/", "barrier/")):
        return "all"
    return "job"


class _Op:
    """One collective: ``fill(var)`` puts what this rank pushes in the
    variable's gradient (var.grad, a float32 array of ``numel``, or memory
    bound with var.bind_buffers); ``done(var)`` turns the mean (var.data,
    or the bound memory) into the call's result."""
    __slots__ = ("what", "key", "numel", "fill", "done", "future", "var", "req", "push",
                 "start", "seq", "name", "pull_only", "taken")

    def __init__(self, what: str, key: str, numel: int, fill: Callable, done: Callable,
                 pull_only: bool = False):
        self.what, self.key, self.numel, self.fill, self.done = what, key, numel, fill, done
        self.pull_only = pull_only  # a broadcast's receiver: it pushes nothing
        self.taken = False  # a rejoining rank's part the dead process had sent
        self.future = Future()
        self.var = self.req = self.push = None
        self.start = 0.0
        self.seq = 0
        self.name = ""


class _Slot:
    """A mean variable and the step its next push is for."""

    def __init__(self, var):
        self.var, self.step, self.busy = var, 0, None


class _Engine(threading.Thread):
    """Owns the client: issues operations in the order they were called
    and completes their futures as the means come back."""

    def __init__(self, client: Client, rank: int, size: int, timeout: timedelta):
        super().__init__(name="psd-c10d-%d" % rank, daemon=True)
        self.client, self.rank, self.size = client, rank, size
        self.timeout_s = timeout.total_seconds()
        self.q: "queue.SimpleQueue[Optional[_Op]]" = queue.SimpleQueue()
        self.slots: Dict[str, _Slot] = {}
        self.calls: Dict[str, int] = collections.Counter()
        self.failed: Optional[BaseException] = None
        self.closed = False
        self.lock = threading.Lock()  # calls: counted in the order they were made
        # Called while the oldest call waits (psd.rejoin.Server.poll).
        self.on_wait: Optional[Callable[[], None]] = None
        # A restarted rank redoing the step it rejoined in: its parts the
        # dead process had pushed are taken as given (psd.rejoin).
        self.catchup = False

    # called from the user's threads
    def submit(self, op: _Op) -> Future:
        """Enqueues op; raises at once if an earlier call failed (a caller
        in C++ may have dropped that error) or the group is gone."""
        if self.failed is not None:
            raise BackendError(
                "psd backend, rank %d: %s cannot run: an earlier collective failed (%s)"
                % (self.rank, op.what, self.failed))
        if self.closed:
            raise BackendError("psd backend, rank %d: %s after the process group was "
                               "destroyed" % (self.rank, op.what))
        with self.lock:
            op.seq = self.calls[op.key]
            self.calls[op.key] += 1
            op.name = "c10d/%s/%d" % (op.key, op.seq % SLOTS)
            self.q.put(op)
        self.client.wake()  # the thread may be in a wait: send this one now
        return op.future

    def counters(self) -> Dict[str, int]:
        """How many calls of each kind were made so far."""
        with self.lock:
            return dict(self.calls)

    def set_counters(self, calls: Dict[str, int]) -> None:
        """A rejoining rank takes the others' count of calls (psd.rejoin)."""
        with self.lock:
            self.calls = collections.Counter(calls)

    def stop(self, timeout: Optional[float] = None) -> bool:
        """Lets the calls in flight finish (up to timeout seconds) and ends
        the thread; whether it ended."""
        self.closed = True
        self.q.put(None)
        self.client.wake()
        self.join(timeout)
        return not self.is_alive()

    # the thread
    def run(self) -> None:
        pending: "collections.deque[_Op]" = collections.deque()
        inflight: "collections.deque[_Op]" = collections.deque()
        stopping = False
        while True:
            try:
                while True:  # everything enqueued so far, without blocking
                    op = self.q.get(block=not (pending or inflight or stopping))
                    if op is None:
                        stopping = True
                    else:
                        pending.append(op)
                    if stopping and not pending and not inflight:
                        return
            except queue.Empty:
                pass
            try:
                while pending and self._can_issue(pending[0]):
                    op = pending.popleft()
                    self._issue(op)
                    inflight.append(op)
                if inflight:
                    self._progress(inflight)
                elif stopping and not pending:
                    return
            except BaseException as e:  # noqa: BLE001 (fails every call)
                self.failed = e
                for op in list(inflight) + list(pending):
                    if not op.future.done():
                        op.future.set_exception(self._wrap(op, e))
                inflight.clear()
                pending.clear()
                while True:  # later calls fail at once (submit)
                    try:
                        op = self.q.get_nowait()
                    except queue.Empty:
                        break
                    if op is not None:
                        op.future.set_exception(self._wrap(op, e))
                if stopping:
                    return

    def _wrap(self, op: _Op, e: BaseException) -> BaseException:
        if isinstance(e, BackendError):
            return e
        return BackendError("psd backend, rank %d of %d: %s (call %d of its kind, variable "
                            "%r) failed: %s" % (self.rank, self.size, op.what, op.seq,
                                                op.name, e))

    def _can_issue(self, op: _Op) -> bool:
        slot = self.slots.get(op.name)
        return slot is None or slot.busy is None

    def _issue(self, op: _Op) -> None:
        slot = self.slots.get(op.name)
        if slot is None:  # the first call of this kind and size: create it
            scale = float(self.size) if op.key.startswith(("sum/", "hsum/")) else 1.0
            v = self.client.variable(op.name, (op.numel,), init=Zeros(),
                                     optimizer=Mean(scale, _aggregate(op.key)))
            if op.key.startswith("x"):  # exact calls: float32 whatever the job's wire dtype
                v.set_wire_dtype("f32", "f32")
            elif op.key.startswith("h"):  # mean_async(wire="fp16"): Horovod's Compression.fp16
                v.set_wire_dtype("fp16", "fp16")
            slot = self.slots[op.name] = _Slot(v)
            # The n-th call on a variable pushes at its step n (a rank that
            # rejoins starts with the others' counts).
            slot.step = op.seq // SLOTS
        op.var, op.start = slot.var, time.monotonic()
        op.fill(slot.var)
        op.push = None if op.pull_only else self.client.push_async([slot.var], step=slot.step)
        op.req = self.client.pull_async([slot.var], min_step=slot.step + 1)
        slot.busy = op

    def _progress(self, inflight) -> None:
        op = inflight[0]
        if not op.req.done(POLL_S):  # timed out or woken: look for new calls
            waited = time.monotonic() - op.start
            if self.on_wait is not None and waited >= POLL_S:
                self.on_wait()
            if waited > self.timeout_s:
                raise BackendError(
                    "psd backend, rank %d of %d: %s (variable %r) waited %.0f s, the "
                    "process group's timeout, for the other ranks' part: a rank is not "
                    "calling it (ranks must make the same collective calls in the same "
                    "order) or is stuck; psd's log names the worker it waits for"
                    % (self.rank, self.size, op.what, op.name, waited)) from None
            return
        # op stays in inflight until its result is set: an error from here
        # on fails it with the others (run()).
        try:
            if op.push is not None:
                op.push.wait()  # done already: each ps answers the push before the pull
        except StaleError:
            # Backup workers: the servers completed the step with the first
            # N - K parts and this rank gets their mean, as psd's own
            # variables do. Exact calls wait for every part (never stale).
            # A rejoining rank's root part of a broadcast the dead process
            # had sent is stale too.
            if _aggregate(op.key) != "job" and not self.catchup:
                raise
            op.taken = self.catchup
        except DuplicateError as e:
            if self.catchup:  # the dead process had pushed this part
                op.taken = True
            else:
                raise BackendError(
                    "psd backend, rank %d of %d: %s (variable %r): this rank's part came "
                    "after the servers completed the step without it (%s); the "
                    "torch.distributed backend needs every rank's part"
                    % (self.rank, self.size, op.what, op.name, type(e).__name__)) from None
        slot = self.slots[op.name]
        slot.step += 1
        slot.busy = None
        op.req.release()
        if op.push is not None:
            op.push.release()
        result = op.done(slot.var)
        inflight.popleft()
        op.future.set_result(result)


# ----------------------------------------------------------- process group

class _PyWork(Work):
    """The Work an async_op=True call from Python gets: its wait() raises
    the call's error (torch 1.13's future-wrapping Work would return)."""

    def __init__(self, fut: Future):
        super().__init__()
        self.fut = fut

    def wait(self, timeout=None):
        self.fut.wait()
        return True

    def is_completed(self):
        return self.fut.done()

    def is_success(self):
        if not self.fut.done():
            return False
        try:
            self.fut.value()
        except Exception:  # noqa: BLE001
            return False
        return True

    def result(self):
        return self.fut.wait()

    def get_future(self):
        return self.fut


_THIS = os.path.abspath(__file__).rstrip("c")


def _caller_mode() -> str:
    """How the collective was called: "sync" or "async" from
    torch.distributed's Python functions (their async_op), else "cpp" (DDP's
    reducer, or other code that takes the Work's future)."""
    f = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).rstrip("c") == _THIS:
        f = f.f_back
    if f is None or not f.f_code.co_filename.endswith("distributed_c10d.py"):
        return "cpp"
    if "async_op" not in f.f_locals:
        return "cpp"
    return "async" if f.f_locals["async_op"] else "sync"


def _work(fut: Future):
    """The Work a collective returns. torch 1.13's Work over a future
    drops the future's error in wait(), which torch.distributed's
    synchronous calls use; so a synchronous call waits here (and raises
    the error), an async_op=True call gets a Work whose wait() raises, and
    DDP's reducer (which reads the future's value, and so sees the error)
    gets the future-wrapping Work it expects."""
    mode = _caller_mode()
    if mode == "sync":
        return _done_work(fut.wait())
    if mode == "async":
        return _PyWork(fut)
    return _create_work_from_future(fut)


def _all(futs, result):
    """A future of ``result`` once every one of futs is done; the first
    error among them is its error."""
    def check(f):
        for x in f.value():
            x.value()  # raises that future's error
        return result
    return torch.futures.collect_all(futs).then(check)


def _done_work(value):
    f = Future()
    f.set_result(value)
    return _create_work_from_future(f)


_SUM_LIKE = ("SUM", "AVG")


def _op_name(opts) -> str:
    op = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
    for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if hasattr(dist.ReduceOp, n) and op == getattr(dist.ReduceOp, n):
            return n
    return str(op)


class ProcessGroupPsd(dist.ProcessGroup):
    """torch.distributed's process group on psd (see the module's doc)."""

    def __init__(self, client: Client, rank: int, size: int, timeout: timedelta):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.client = client
        self.engine = _Engine(client, rank, size, timeout)
        self.engine.start()
        self._warned_f64 = False
        # A restarted rank before psd.torch.Checkpoint has rejoined it: DDP's
        # start-up calls are answered here (psd.rejoin).
        self.prejoin = False
        self.rebuilt: List[tuple] = []  # DDP's bucket-rebuild broadcasts: (key, seq, value)
        self._last_i32: Optional[tuple] = None
        self.local_bcasts: List[torch.Tensor] = []  # answered here after a rejoin
        self.split: Optional[tuple] = None  # (layout, numels): a rejoin's first bucket

    def getBackendName(self) -> str:
        return BACKEND

    def __del__(self):
        pass

    def shutdown(self, timeout: Optional[float] = None) -> bool:
        """Stops the background thread once the calls in flight have
        finished (up to timeout seconds); whether it stopped."""
        return self.engine.stop(timeout) if self.engine.is_alive() else True

    # -- helpers
    def _submit(self, what, key, numel, fill, done, pull_only=False):
        return self.engine.submit(_Op(what, key, numel, fill, done, pull_only))

    def _before_join(self, what: str) -> None:
        """A restarted rank's collectives before its Checkpoint line has
        rejoined it: only DDP's start-up ones are answered (here, by the
        callers); any other cannot be matched with the others'."""
        raise BackendError(
            "psd backend: rank %d was restarted by psrun --restart-workers and has not rejoined "
            "the others yet, so it cannot make %s: create psd.torch.Checkpoint(ddp, "
            "optimizer, scheduler, loader) right after DDP and the optimizer, before any other "
            "collective; it brings this rank the others' state" % (self._rank, what))

    def _exact_allgather(self, what: str, flat: torch.Tensor) -> Future:
        """Every rank's float32 vector ``flat`` (the same length on every
        rank), exactly: a Future of the (size, n) tensor."""
        n, size, rank = flat.numel(), self._size, self._rank

        def fill(v):
            v.grad[:] = 0
            v.grad[rank * n:(rank + 1) * n] = flat.numpy()

        def done(v):
            return torch.from_numpy(v.data.copy()).mul_(size).reshape(size, n)

        return self._submit(what, "x/gather/%d" % (n * size), n * size, fill, done)

    def vote(self, yes: bool) -> Future:
        """A Future of the ranks' mean of ``yes`` (0 or 1), the same value
        on every rank: psd.torch.Checkpoint's agreement to stop, one per
        optimizer step, on a variable of its own."""
        def fill(v):
            v.grad[0] = 1.0 if yes else 0.0

        def done(v):
            return float(v.data[0])

        return self._submit("psd.torch.Checkpoint's stop vote", "vote/1", 1, fill, done)

    # -- a restarted rank rejoins (psd.rejoin; psd.torch.Checkpoint calls these)
    def serve_rejoins(self, provider) -> None:
        """Rank 0 (and rank 1, for rank 0) answers a restarted rank's
        request while it waits for that rank: provider(rank) gives (ok,
        bytes)."""
        from . import rejoin
        if self._rank in (0, 1) and self._size > 1:
            self.engine.on_wait = rejoin.Server(self.client, self._rank, provider).poll

    def request_rejoin(self) -> bytes:
        """This restarted rank's request for the others' state (its bytes);
        raises psd.rejoin.RejoinRefused with their reason."""
        from . import rejoin
        return rejoin.request(self.client, self._rank, self.engine.timeout_s)

    def join(self, counters, layout, numels, local_bcasts) -> None:
        """Takes the others' count of calls and DDP's bucket layout; the
        step this rank redoes takes its parts the dead process sent as
        given until end_catchup()."""
        self.engine.set_counters(counters)
        self.split = (layout, numels) if layout is not None else None
        self.local_bcasts = list(local_bcasts)
        self.engine.catchup = True
        self.prejoin = False

    def end_catchup(self) -> None:
        self.engine.catchup = False

    # -- collectives
    def allreduce(self, tensors, opts=None):
        op = _op_name(opts)
        if len(tensors) != 1:
            return self.allreduce_coalesced(tensors, opts)
        t = tensors[0]
        what = "all_reduce(%s, %s%s)" % (op, t.dtype, tuple(t.shape))
        if self.prejoin:
            self._before_join(what)
        if self.split is not None and t.is_floating_point() and op == "SUM" and \
                t.numel() == sum(self.split[1]):
            from . import rejoin
            layout, numels = self.split
            self.split = None
            return _work(rejoin.split_sum(self, t, layout, numels))
        if op not in _SUM_LIKE:
            return _work(self._reduce_by_gather(what, t, op))
        if t.is_floating_point():
            return _work(self._float_sum(what, t, op == "AVG"))
        if t.dtype in _INT16_PIECES:
            if op == "AVG":
                raise ValueError("psd backend: all_reduce AVG of an integer tensor (%s) has "
                                 "no integer result; use SUM and divide" % t.dtype)
            return _work(self._int_sum(what, t))
        raise TypeError("psd backend: all_reduce of %s tensors is not supported (floating "
                        "point and integer tensors are)" % t.dtype)

    def mean_async(self, t: torch.Tensor, average: bool = True, wire: str = "") -> Future:
        """The ranks' mean (average) or sum of the floating-point tensor t, in
        place: a Future of [t]. wire "fp16" sends it over psd's 16-bit wire
        (psd.horovod's Compression.fp16); "" takes the job's."""
        what = "%s(%s%s)" % ("average" if average else "sum", t.dtype, tuple(t.shape))
        if self.prejoin:
            self._before_join(what)
        return self._float_sum(what, t, average, "h" if wire == "fp16" else "")

    def _float_sum(self, what: str, t: torch.Tensor, average: bool, kind: str = "") -> Future:
        if t.dtype == torch.float64 and not self._warned_f64:
            self._warned_f64 = True
            import warnings
            warnings.warn("psd backend: float64 tensors are reduced in float32 precision "
                          "(psd's servers average in float32)", stacklevel=3)
        # The push reads and the mean lands in place: t's own memory when t
        # is a contiguous CPU float32 tensor (DDP's buckets), else a copy.
        host = t.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        in_place = t.is_contiguous() and host.data_ptr() == t.data_ptr()
        n = host.numel()

        def fill(v):
            v.bind_buffers(host.data_ptr(), host.data_ptr())

        def done(v):
            v.bind_buffers(None, None)
            if not in_place:
                with torch.no_grad():
                    t.copy_(host.reshape(t.shape))
            return [t]

        # SUM: the servers scale the mean by WORLD_SIZE in the same pass.
        key = kind + ("avg/%d" if average else "sum/%d") % n
        return self._submit(what, key, n, fill, done)

    def _int_sum(self, what: str, t: torch.Tensor) -> Future:
        pieces = _int_pieces(t)
        n, size = pieces.numel(), self._size

        def fill(v):
            v.grad[:] = pieces.numpy()

        def done(v):
            with torch.no_grad():
                t.copy_(_int_sum(torch.from_numpy(v.data.copy()).mul_(size), t))
            return [t]

        return self._submit(what, "x/isum/%d" % n, n, fill, done)

    def _reduce_by_gather(self, what: str, t: torch.Tensor, op: str) -> Future:
        fut = self._exact_allgather(what, _to_pieces(t))

        def reduce(f):
            rows = f.value()
            vals = torch.stack([_from_pieces(rows[r], t) for r in range(self._size)])
            if op == "MIN":
                out = vals.min(dim=0).values
            elif op == "MAX":
                out = vals.max(dim=0).values
            elif op == "PRODUCT":
                out = vals.prod(dim=0)
            elif op in ("BAND", "BOR", "BXOR"):
                out = vals[0].clone()
                for r in range(1, self._size):
                    fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
                          "BXOR": torch.bitwise_xor}[op]
                    out = fn(out, vals[r])
            else:
                raise ValueError("psd backend: all_reduce with %s is not supported" % op)
            with torch.no_grad():
                t.copy_(out.to(t.dtype).reshape(t.shape))
            return [t]

        return fut.then(reduce)

    def allreduce_coalesced(self, tensors, opts=None):
        if not tensors:
            return _done_work([])
        if any(x.dtype != tensors[0].dtype for x in tensors):
            raise TypeError("psd backend: all_reduce_coalesced needs tensors of one dtype")
        flat = torch.cat([x.detach().reshape(-1) for x in tensors])
        w = self.allreduce([flat], opts)

        def unflatten(f):
            off = 0
            for x in tensors:
                with torch.no_grad():
                    x.copy_(flat[off:off + x.numel()].reshape(x.shape))
                off += x.numel()
            return tensors

        return _work(w.get_future().then(unflatten))

    def broadcast(self, tensors, opts=None):
        # The root pushes its bytes (as 16-bit pieces, exact); the step
        # completes with that part alone and the others pull it.
        root = getattr(opts, "rootRank", 0)
        rank = self._rank
        if self.prejoin:  # DDP's start: the rejoin brings the values
            return _done_work(tensors)
        rebuild = _caller_mode() == "cpp" and len(tensors) == 1 and \
            tensors[0].dtype == torch.int32 and tensors[0].dim() == 1
        if rebuild and self.local_bcasts and self.local_bcasts[0].shape == tensors[0].shape:
            # A rejoined rank's DDP rebuilds its buckets: as the others did
            with torch.no_grad():
                tensors[0].copy_(self.local_bcasts.pop(0))
            return _done_work(tensors)
        futs = []
        for t in tensors:
            pieces = _to_pieces(t) if rank == root else None
            n = (t.numel() * t.element_size() + 1) // 2
            box: List[_Op] = []  # the op, for done()

            def fill(v, pieces=pieces):
                if pieces is not None:
                    v.grad[:] = pieces.numpy()

            def done(v, t=t, box=box):
                # A rejoining root whose part the dead process had sent
                # takes that value, as the others did.
                if rank != root or box[0].taken:
                    with torch.no_grad():
                        t.copy_(_from_pieces(torch.from_numpy(v.data.copy()), t))
                return [t]

            what = "broadcast(%s%s, src=%d)" % (t.dtype, tuple(t.shape), root)
            op = _Op(what, "x/bcast/%d" % n, n, fill, done, rank != root)
            box.append(op)
            self.engine.submit(op)
            fut = op.future
            if rebuild:  # kept for a rank that rejoins later (psd.rejoin)
                fut = fut.then(self._record(op.key, op.seq, t))
            futs.append(fut)
        return _work(_all(futs, tensors))

    def _record(self, key: str, seq: int, t: torch.Tensor):
        """Keeps the pair of int32 broadcasts DDP's reducer makes when it
        rebuilds its buckets (once): the parameters' indices with the
        bucket count last, then that many bucket sizes summing to the
        indices'. Other int32 broadcasts (a model's int32 buffers) are not
        such a pair."""
        def record(f):
            out = f.value()
            cur = (key, seq, t.detach().clone())
            prev, self._last_i32 = self._last_i32, cur
            if len(self.rebuilt) < 2 and prev is not None:
                idx, sizes = prev[2], cur[2]
                if idx.numel() > 1 and int(idx[-1]) == sizes.numel() and \
                        int(sizes.sum()) == idx.numel() - 1:
                    self.rebuilt = [prev, cur]
            return out
        return record

    def allgather(self, output_tensors, input_tensors, opts=None):
        if self.prejoin:  # DDP's check of the parameters' shapes: this rank's own
            with torch.no_grad():
                for outs, t in zip(output_tensors, input_tensors):
                    for o in outs:
                        o.copy_(t)
            return _done_work(output_tensors)
        futs = []
        for outs, t in zip(output_tensors, input_tensors):
            what = "all_gather(%s%s)" % (t.dtype, tuple(t.shape))

            def place(f, outs=outs, t=t):
                rows = f.value()
                for r, o in enumerate(outs):
                    with torch.no_grad():
                        o.copy_(_from_pieces(rows[r], t))
                return outs

            futs.append(self._exact_allgather(what, _to_pieces(t)).then(place))
        return _work(_all(futs, output_tensors))

    def _allgather_base(self, output, input, opts=None):
        outs = list(output.reshape(self._size, -1).unbind(0))
        parts = [o.view(input.shape) for o in outs]
        return _work(self.allgather([parts], [input]).get_future().then(lambda _: [output]))

    def barrier(self, opts=None):
        if self.prejoin:
            self._before_join("barrier()")

        def fill(v):
            v.grad[:] = 1.0

        def done(v):
            return []

        return _work(self._submit("barrier()", "barrier/1", 1, fill, done))

    def reduce(self, tensors, opts=None):
        # Every rank gets the result, which reduce allows (the others'
        # tensors are unspecified after it).
        class _O:
            reduceOp = getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        return self.allreduce(tensors, _O())

    def _unsupported(self, name):
        raise NotImplementedError(
            "psd backend: %s is not supported (all_reduce, broadcast, all_gather, barrier, "
            "reduce and the object collectives are); use a gloo group for it: "
            "torch.distributed.new_group(backend='gloo')" % name)

    def reduce_scatter(self, *a, **k):
        self._unsupported("reduce_scatter")

    def _reduce_scatter_base(self, *a, **k):
        self._unsupported("reduce_scatter_tensor")

    def alltoall(self, *a, **k):
        self._unsupported("all_to_all")

    def alltoall_base(self, *a, **k):
        self._unsupported("all_to_all_single")

    def send(self, *a, **k):
        self._unsupported("send")

    def recv(self, *a, **k):
        self._unsupported("recv")

    def recv_anysource(self, *a, **k):
        self._unsupported("recv")

    def gather(self, *a, **k):
        self._unsupported("gather (all_gather works)")

    def scatter(self, *a, **k):
        self._unsupported("scatter (broadcast works)")

    def monitored_barrier(self, *a, **k):
        self._unsupported("monitored_barrier (barrier works, bounded by the group's timeout)")


# ---------------------------------------------------------------- backend

_client: Optional[Client] = None
_groups: List[ProcessGroupPsd] = []


def backend_client() -> Optional[Client]:
    """The psd client the backend uses (None before init_process_group):
    a script may create variables and tables on it too. It is driven by
    the backend's thread: call it only while no collective is in flight."""
    return _client


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else None


def _create(store, rank: int, size: int, timeout: timedelta) -> ProcessGroupPsd:
    global _client
    if not os.environ.get("PS_HOSTS"):
        raise RuntimeError(
            "the psd backend runs under psrun, which starts the servers: launch with "
            "`psrun --local --ps=1 -n N python3 script.py` (one machine) or `srun ... psrun "
            "--ps=1 python3 script.py` (PS_HOSTS is not set)")
    w, nw = _env_int("PS_WORKER_INDEX"), _env_int("PS_NUM_WORKERS")
    if (w, nw) != (rank, size):
        raise ValueError(
            "psd backend: init_process_group gave rank %d of %d, but psrun started this "
            "worker as %s of %s; leave rank and world_size out (psrun sets RANK and "
            "WORLD_SIZE) or pass the same" % (rank, size, w, nw))
    restarts = _env_int("PS_WORKER_RESTARTS")
    replicas = _env_int("PS_REPLICAS_TO_AGGREGATE") or size
    if restarts and replicas < size:
        raise RuntimeError(
            "psd backend: rank %d was restarted by psrun --restart-workers, but with "
            "--backup-workers the other ranks went on without it and a restarted rank cannot "
            "rejoin them (it rejoins a job without backup workers, through "
            "psd.torch.Checkpoint). The job goes on without this rank" % rank)
    if os.environ.get("PS_ASYNC", "0") not in ("", "0"):
        raise RuntimeError("psd backend: asynchronous training (PS_ASYNC) applies each "
                           "rank's part alone, which no collective means; run without it")
    if _client is None:
        # SIGTERM keeps its default action, as under torchrun: nothing
        # in this backend would notice the library's stop flag.
        saved = os.environ.get("PS_SIGNALS")
        os.environ["PS_SIGNALS"] = "0"
        try:
            _client = Client.from_env()
        finally:
            if saved is None:
                del os.environ["PS_SIGNALS"]
            else:
                os.environ["PS_SIGNALS"] = saved
    if len(_groups) > 0:
        raise RuntimeError("psd backend: only the default process group is supported; "
                           "new_group(backend='psd') is not (a gloo group works beside it)")
    if rank == 0 and size > 1:
        from . import rejoin
        rejoin.create(_client)
    pg = ProcessGroupPsd(_client, rank, size, timeout)
    if restarts:
        # This rank answers DDP's start-up calls itself until
        # psd.torch.Checkpoint rejoins it (psd.rejoin).
        pg.prejoin = True
    _groups.append(pg)
    return pg


def register() -> None:
    """Registers the backend under the name "psd" (once)."""
    if not hasattr(dist.Backend, "PSD"):
        dist.Backend.register_backend(BACKEND, _create)
        if _env_int("PS_WORKER_RESTARTS"):
            from . import rejoin
            rejoin.patch_torch_start()


def _shutdown() -> None:
    """At exit: drain the background threads and tell the servers this
    worker is done (they exit when every worker is)."""
    global _client
    drained = True
    for pg in _groups:
        # Bounded: after an exception in the script, a call in flight may
        # wait for ranks that wait for this one; the process then exits
        # without finish() and the servers see it leave.
        drained = pg.shutdown(timeout=SHUTDOWN_S) and drained
    _groups.clear()
    if _client is not None and not drained:
        print("psd backend: rank %s exits with a collective still in flight (its other ranks "
              "did not make it within %d s); the servers see this worker leave"
              % (os.environ.get("RANK", "?"), SHUTDOWN_S), file=sys.stderr)
        _client = None
        return
    if _client is not None:
        try:
            _client.finish()
        except Exception:  # noqa: BLE001
            pass
        _client.close()
        _client = None


import atexit  # noqa: E402

atexit.register(_shutdown)
