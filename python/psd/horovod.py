"""Horovod's PyTorch API on psd: a script written for ``horovod.torch``
runs under psrun with its import changed to ``import psd.horovod as hvd``.

Every call is a collective of the torch.distributed backend "psd"
(psd/c10d.py): gradients are averaged by psd's servers (mean variables),
broadcasts and gathers are exact. What differs from Horovod says so at
once: Adasum, process sets, alltoall, reducescatter and the grouped calls
raise NotImplementedError; join() is a barrier (uneven numbers of batches
are not supported: a rank that made fewer calls is named by the group's
timeout). See docs/python.md, "Horovod scripts on psd".
"""
import contextlib
import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.futures import Future

from . import torch as _psd_torch  # noqa: F401  (registers the "psd" backend)

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
           "cross_size", "cross_rank", "Average", "Sum", "Adasum", "Min", "Max", "Product",
           "Compression", "DistributedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "allgather", "allgather_async", "broadcast", "broadcast_",
           "broadcast_async", "broadcast_async_", "broadcast_object", "allgather_object",
           "synchronize", "poll", "barrier", "join"]

# Reduction ops, as Horovod names them.
Average, Sum, Adasum, Min, Max, Product = "Average", "Sum", "Adasum", "Min", "Max", "Product"
_DIST_OPS = {Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX,
             Product: dist.ReduceOp.PRODUCT}
# Gradients are averaged in buckets of about this many bytes (Horovod fuses
# tensors into a 64 MiB buffer; smaller buckets overlap more of backward).
BUCKET_BYTES = 4 << 20


class Compression:
    """Horovod's gradient compression: ``fp16`` sends over psd's 16-bit wire
    (the servers still average in float32)."""
    none = "none"
    fp16 = "fp16"


def _unsupported(what: str, instead: str = ""):
    raise NotImplementedError("psd.horovod: %s is not supported%s" % (what, instead))


# ------------------------------------------------------------------ basics

def init(comm=None, process_sets=None) -> None:
    """Joins the job psrun started (its RANK, WORLD_SIZE, ...)."""
    if comm is not None or process_sets is not None:
        _unsupported("init(comm=, process_sets=)", ": psrun's job is the one communicator")
    if not dist.is_initialized():
        dist.init_process_group("psd")
    elif dist.get_backend() != "psd":
        raise RuntimeError("psd.horovod: torch.distributed is already initialized with %r; "
                           "init_process_group(\"psd\") (or leave it to hvd.init())"
                           % dist.get_backend())


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return dist.is_initialized()


def _need_init() -> None:
    if not dist.is_initialized():
        raise ValueError("psd.horovod has not been initialized; run hvd.init()")


def size() -> int:
    _need_init()
    return dist.get_world_size()


def rank() -> int:
    _need_init()
    return dist.get_rank()


def local_size() -> int:
    _need_init()
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def local_rank() -> int:
    _need_init()
    return int(os.environ.get("LOCAL_RANK", "0"))


def cross_size() -> int:
    """Nodes, if every node runs local_size() workers (as Horovod assumes)."""
    return max(1, size() // max(1, local_size()))


def cross_rank() -> int:
    return rank() // max(1, local_size())


def _group():
    _need_init()
    return dist.distributed_c10d._get_default_group()


# ------------------------------------------------------------- collectives

class _Handle:
    """What the *_async calls return: synchronize(handle) gives the result."""

    def __init__(self, fut: Future, result):
        self.fut, self.result = fut, result


def _op_of(average: Optional[bool], op: Optional[str]) -> str:
    if average is not None and op is not None:
        raise ValueError("psd.horovod: give average or op, not both")
    if average is not None:
        return Average if average else Sum
    return op or Average


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[str] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     compression=Compression.none, process_set=None) -> _Handle:
    """Reduces tensor in place across ranks (Average by default)."""
    if process_set is not None:
        _unsupported("process_set", ": every call spans the whole job")
    op = _op_of(average, op)
    if op == Adasum:
        _unsupported("op=Adasum", "; use Average")
    if prescale_factor != 1.0:
        with torch.no_grad():
            tensor.mul_(prescale_factor)
    if op in (Average, Sum) and tensor.is_floating_point():
        fut = _group().mean_async(tensor, average=op == Average,
                                  wire="fp16" if compression == Compression.fp16 else "")
    elif op == Average:
        raise TypeError("psd.horovod: averaging a %s tensor has no integer result; use "
                        "op=hvd.Sum" % tensor.dtype)
    else:
        fut = dist.all_reduce(tensor, op=_DIST_OPS[op], async_op=True).get_future()
    if postscale_factor != 1.0:
        fut = fut.then(lambda f: [f.value()[0].mul_(postscale_factor)])
    return _Handle(fut, tensor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, compression=Compression.none, process_set=None):
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, compression, process_set))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, compression=Compression.none, process_set=None):
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor,
                            postscale_factor, compression, process_set)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """A new tensor: the reduction of tensor across ranks."""
    return synchronize(allreduce_async(tensor, average, name, op, prescale_factor,
                                       postscale_factor, compression, process_set))


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set=None) -> _Handle:
    """Every rank's tensor concatenated along dimension 0 (the first
    dimension may differ between ranks), exactly."""
    if process_set is not None:
        _unsupported("process_set", ": every call spans the whole job")
    n = size()
    t = tensor.detach().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    rows = torch.tensor([t.shape[0]], dtype=torch.int64)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(counts, rows)
    most = max(int(c) for c in counts)
    padded = torch.zeros((most,) + tuple(t.shape[1:]), dtype=t.dtype)
    padded[:t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(n)]
    fut = dist.all_gather(parts, padded, async_op=True).get_future()
    out = fut.then(lambda f: [torch.cat([p[:int(c)] for p, c in zip(parts, counts)])])
    return _Handle(out, None)


def allgather(tensor, name=None, process_set=None):
    return synchronize(allgather_async(tensor, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set=None) -> _Handle:
    """tensor becomes root_rank's, bit for bit."""
    if process_set is not None:
        _unsupported("process_set", ": every call spans the whole job")
    fut = dist.broadcast(tensor, src=root_rank, async_op=True).get_future()
    return _Handle(fut, tensor)


def broadcast_(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast(tensor, root_rank, name=None, process_set=None):
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def synchronize(handle: _Handle):
    """Waits for an *_async call; its result (raises its error)."""
    value = handle.fut.wait()
    return handle.result if handle.result is not None else value[0]


def poll(handle: _Handle) -> bool:
    return handle.fut.done()


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set=None) -> Any:
    lst = [obj if rank() == root_rank else None]
    dist.broadcast_object_list(lst, src=root_rank)
    return lst[0]


def allgather_object(obj: Any, name: Optional[str] = None, process_set=None) -> List[Any]:
    out = [None] * size()
    dist.all_gather_object(out, obj)
    return out


def barrier(process_set=None) -> None:
    dist.barrier()


def join(device: int = -1) -> int:
    """A barrier: every rank must call it after the same collectives. (In
    Horovod a joined rank contributes zeros to the others' later calls; on
    psd a rank that stops early leaves the others' next call waiting until
    the group's timeout, which names the call.) Returns the last rank."""
    barrier()
    return size() - 1


def alltoall(*a, **k):
    _unsupported("alltoall", "; an allgather can stand in")


def reducescatter(*a, **k):
    _unsupported("reducescatter", "; allreduce and take your part")


def grouped_allreduce(*a, **k):
    _unsupported("grouped_allreduce", "; call allreduce per tensor")


# --------------------------------------------------------------- broadcasts

def broadcast_parameters(params, root_rank: int = 0) -> None:
    """Sets every rank's parameters (a state_dict or named_parameters()) to
    root_rank's, in place, in name order as Horovod does."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    handles = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise ValueError("psd.horovod.broadcast_parameters: %r is a %s, not a tensor"
                             % (name, type(p).__name__))
        handles.append(broadcast_async_(p.data if p.requires_grad else p, root_rank, name))
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Every rank's optimizer state (and hyperparameters) becomes
    root_rank's."""
    state = broadcast_object(optimizer.state_dict() if rank() == root_rank else None, root_rank)
    optimizer.load_state_dict(state)


# ---------------------------------------------------------------- optimizer

class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter]):
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
        self.ready = 0
        self.handle: Optional[_Handle] = None


class _DistributedOptimizer:
    """Mixed into the optimizer's own class (as Horovod does): gradients are
    averaged across ranks in buckets as backward finishes them."""

    def _psd_setup(self, named_parameters, compression, backward_passes_per_step, op):
        if op == Adasum:
            _unsupported("op=Adasum", "; use Average")
        if op not in (Average, Sum):
            raise ValueError("psd.horovod.DistributedOptimizer: op must be hvd.Average or "
                             "hvd.Sum, got %r" % (op,))
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if named_parameters is not None:
            named = list(named_parameters)
            ids = {id(p) for _, p in named}
            missing = [p for p in params if id(p) not in ids]
            if missing:
                raise ValueError("psd.horovod.DistributedOptimizer: named_parameters lacks %d "
                                 "of the optimizer's parameters" % len(missing))
        self._psd_op, self._psd_compression = op, compression
        self._psd_passes = backward_passes_per_step
        self._psd_counts: Dict[int, int] = {id(p): 0 for p in params}
        groups: List[List[torch.nn.Parameter]] = []
        size_now = 0
        for p in reversed(params):  # backward produces late layers first
            nbytes = p.numel() * 4
            if not groups or size_now + nbytes > BUCKET_BYTES:
                groups.append([])
                size_now = 0
            groups[-1].append(p)
            size_now += nbytes
        self._psd_buckets = [_Bucket(g) for g in groups]
        self._psd_of: Dict[int, _Bucket] = {id(p): b for b in self._psd_buckets
                                            for p in b.params}
        self._psd_next = 0  # buckets go out in order: the same calls on every rank
        self._psd_skip = False
        self._psd_synced = False  # synchronize() ran since the last backward
        self._psd_hooks = [self._psd_hook(p) for p in params]

    def _psd_hook(self, p):
        acc = p.expand_as(p).grad_fn.next_functions[0][0]

        def ready(*_):
            self._psd_synced = False
            self._psd_counts[id(p)] += 1
            if self._psd_counts[id(p)] == self._psd_passes:
                self._psd_of[id(p)].ready += 1
                self._psd_issue_ready()

        return acc, acc.register_hook(ready)

    def _psd_issue(self, b: _Bucket) -> None:
        off = 0
        for p in b.params:
            n = p.numel()
            if p.grad is None:  # not used in this step's graph: zeros, as Horovod sends
                b.flat[off:off + n].zero_()
            else:
                b.flat[off:off + n].copy_(p.grad.detach().reshape(-1))
            off += n
        b.handle = allreduce_async_(b.flat, op=self._psd_op, compression=self._psd_compression)

    def _psd_issue_ready(self) -> None:
        while (self._psd_next < len(self._psd_buckets) and
               self._psd_buckets[self._psd_next].ready == len(
                   self._psd_buckets[self._psd_next].params)):
            self._psd_issue(self._psd_buckets[self._psd_next])
            self._psd_next += 1

    def synchronize(self) -> None:
        """Waits for every bucket's average (issuing the ones whose
        gradients backward never produced, with zeros, as Horovod does) and
        writes it into the parameters' .grad."""
        for b in self._psd_buckets[self._psd_next:]:
            self._psd_issue(b)
        self._psd_next = len(self._psd_buckets)
        for b in self._psd_buckets:
            synchronize(b.handle)
            off = 0
            for p in b.params:
                n = p.numel()
                avg = b.flat[off:off + n].view(p.shape)
                if p.grad is None:
                    p.grad = avg.to(p.dtype).clone()
                else:
                    with torch.no_grad():
                        p.grad.copy_(avg)
                off += n
            b.handle, b.ready = None, 0
        self._psd_next = 0
        for k in self._psd_counts:
            self._psd_counts[k] = 0
        self._psd_synced = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside does not synchronize (call synchronize() first)."""
        self._psd_skip = True
        try:
            yield
        finally:
            self._psd_skip = False

    def step(self, closure=None):
        if not self._psd_skip and not self._psd_synced:
            self.synchronize()
        return super().step(closure)

    def zero_grad(self, *args, **kwargs):
        if any(b.handle is not None for b in self._psd_buckets) or any(
                c for c in self._psd_counts.values()):
            raise AssertionError(
                "psd.horovod: optimizer.zero_grad() was called after loss.backward() but "
                "before optimizer.step() or optimizer.synchronize(): the averaging of those "
                "gradients is under way")
        return super().zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op=Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups=None, sparse_as_dense: bool = False, process_set=None):
    """Horovod's DistributedOptimizer: an optimizer of the same class over
    the same parameter groups whose step() first averages the gradients
    across ranks (synchronize()). Create it before loading any state, as
    with Horovod (broadcast_optimizer_state then shares rank 0's)."""
    _need_init()
    if process_set is not None:
        _unsupported("process_set", ": every call spans the whole job")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    # gradient_predivide_factor, num_groups, groups: the same average, other
    # numerics or fusion in Horovod; psd buckets gradients itself.
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    opt = cls.__new__(cls)
    optimizer.__class__.__init__(opt, optimizer.param_groups)
    opt._psd_setup(named_parameters, compression, backward_passes_per_step, op)
    return opt
