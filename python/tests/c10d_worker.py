"""A worker for test_c10d.py, started by psrun: MODE is the first argument.

  collectives      every collective the psd backend offers, checked on
                   every rank against values computed here
  equivalence OUT  DDP with AdamW, two parameter groups, StepLR,
                   clip_grad_norm_, BatchNorm and gradient accumulation;
                   rank 0 saves the final state_dict to OUT
  skip             rank 1 skips an all_reduce: rank 0's call must fail
                   within the group's timeout, naming the call
  preempt OUT N    a DDP script as users write it (DataLoader over a
                   DistributedSampler, dropout, BatchNorm, AdamW, StepLR,
                   epochs) with psd.torch.Checkpoint: N steps, printing
                   "step k" after each; rank 0 saves the final
                   state_dict to OUT; its loop starts at ckpt.epoch
  preempt1 OUT N   the same with the loop as it was before the one added
                   line (epochs from 0, the scheduler stepped per epoch)
  preempt_backup OUT N  preempt's script under --backup-workers 1 with 3
                   ranks; rank 2 dies at step 4 (once: OUT.died marks it)
  backup OUT       under psrun --backup-workers 1 with 3 ranks: means are
                   over the first two parts, exact calls over all three;
                   then DDP trains on, rank 2 dying after step 4; ranks 0
                   and 1 save their state_dicts to OUT.<rank>
  restart MARKER   DDP for 10 steps without psd.torch.Checkpoint; rank 1
                   dies at step 3 unless MARKER exists (it creates it):
                   under --restart-workers the restarted rank must stop,
                   saying what the script needs to rejoin
  rejoin OUT DIE [AT]  the same script with psd.torch.Checkpoint; rank DIE
                   dies in step 8 (AT "before" its optimizer step, the
                   default, or "after") and rejoins (see rejoin())
"""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples", "python"))
import psd_path  # noqa: E402,F401
import psd.torch  # noqa: E402,F401

STEPS, B = 8, 6  # equivalence: steps, samples per rank per step


def collectives():
    dist.init_process_group("psd")
    r, n = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "psd"
    assert (r, n) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    # float sum and average; the mean of ranks' values, times n
    t = torch.tensor([1.5 + r, -2.0 * r, 1e-3])
    dist.all_reduce(t)
    want = torch.tensor([sum(1.5 + k for k in range(n)), sum(-2.0 * k for k in range(n)), n * 1e-3])
    assert torch.allclose(t, want, rtol=1e-6), (t, want)
    t = torch.full((3, 5), float(r))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.allclose(t, torch.full((3, 5), (n - 1) / 2.0)), t
    # integers, exactly, far beyond float32's 24 bits
    t = torch.tensor([2**40 + r, -7, r * 3], dtype=torch.int64)
    dist.all_reduce(t)
    assert t.tolist() == [n * 2**40 + n * (n - 1) // 2, -7 * n, 3 * n * (n - 1) // 2], t
    t = torch.tensor([r + 1], dtype=torch.int32)
    dist.all_reduce(t)
    assert t.dtype == torch.int32 and t.item() == n * (n + 1) // 2
    # min, max, product
    t = torch.tensor([float(r), -float(r)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.tolist() == [n - 1, 0.0], t
    t = torch.tensor([float(r), -float(r)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    assert t.tolist() == [0.0, -(n - 1)], t
    t = torch.tensor([r + 2], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    prod = 1
    for k in range(n):
        prod *= k + 2
    assert t.item() == prod, t
    # broadcast from a rank other than 0, bit for bit
    g = torch.Generator().manual_seed(99)
    src_vals = torch.randn(7, dtype=torch.float64, generator=g)
    t = src_vals.clone() if r == n - 1 else torch.zeros(7, dtype=torch.float64)
    dist.broadcast(t, src=n - 1)
    assert torch.equal(t, src_vals), (t, src_vals)
    # all_gather of floats, bit for bit (values no float sum would keep)
    mine = torch.tensor([1.0 / 3.0 + r, 1e-30 * (r + 1), float(r) * 1e30])
    outs = [torch.empty(3) for _ in range(n)]
    dist.all_gather(outs, mine)
    for k in range(n):
        assert torch.equal(outs[k], torch.tensor([1.0 / 3.0 + k, 1e-30 * (k + 1), float(k) * 1e30]))
    # objects
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "pad": "x" * (10 * r + 1)})
    assert objs == [{"rank": k, "pad": "x" * (10 * k + 1)} for k in range(n)], objs
    lst = [("hello", 42) if r == 0 else None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst[0] == ("hello", 42), lst
    # coalesced, equal sizes in flight at once (more than the slots)
    ts = [torch.full((4,), float(r + i)) for i in range(9)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    for i, (w, x) in enumerate(zip(works, ts)):
        w.wait()
        assert torch.allclose(x, torch.full((4,), float(sum(k + i for k in range(n))))), (i, x)
    # the sampler every DDP script uses: the ranks' shards partition the set
    data = list(range(23))
    s = torch.utils.data.DistributedSampler(data, shuffle=True, seed=5)
    s.set_epoch(1)
    got = [None] * n
    dist.all_gather_object(got, list(s))
    seen = sorted(i for part in got for i in part)
    assert len(got[0]) == (23 + n - 1) // n and set(seen) == set(data), got
    dist.barrier()
    # what psd cannot do says so
    try:
        dist.reduce_scatter(torch.zeros(1), [torch.zeros(1)] * n)
    except NotImplementedError as e:
        assert "gloo" in str(e), e
    else:
        raise AssertionError("reduce_scatter did not raise")
    dist.barrier()
    print("ok rank %d" % r, flush=True)
    dist.destroy_process_group()


def small_net():
    return torch.nn.Sequential(
        # no bias before BatchNorm: its gradient is rounding noise, which
        # Adam would scale up to full steps
        torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))


def groups(net):
    return [{"params": [p for p in net.parameters() if p.ndim > 1], "weight_decay": 0.1},
            {"params": [p for p in net.parameters() if p.ndim <= 1], "weight_decay": 0.0,
             "lr": 0.02}]


def batches(step, world):
    """The global batch of a step (world * B samples), the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * B, 3, 6, 6, generator=g)
    y = torch.randint(0, 5, (world * B,), generator=g)
    return x, y


def equivalence(out):
    dist.init_process_group("psd")
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(7)
    net = small_net()
    if r == 1:  # DDP's start must give every rank rank 0's values
        with torch.no_grad():
            for p in net.parameters():
                p.add_(1.0)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(groups(net), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for step in range(STEPS):
        x, y = batches(step, n)
        x, y = x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]
        opt.zero_grad()
        half = B // 2  # two micro-batches: accumulation through no_sync
        with ddp.no_sync():
            (F.cross_entropy(ddp(x[:half]), y[:half]) / 2).backward()
        (F.cross_entropy(ddp(x[half:]), y[half:]) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.5)
        opt.step()
        sched.step()
    if r == 0:
        torch.save(net.state_dict(), out)
    dist.destroy_process_group()


def preempt(out, steps, from_zero=False, backup=False):
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    dist.init_process_group("psd")
    r = dist.get_rank()
    torch.manual_seed(7)
    net = torch.nn.Sequential(small_net(), torch.nn.Dropout(0.3), torch.nn.Linear(5, 5))
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(groups(net), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2 if from_zero else 7, gamma=0.5)
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(44, 3, 6, 6, generator=g), torch.randint(0, 5, (44,), generator=g))
    sampler = DistributedSampler(data, seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler)  # 6 batches a rank: 4,4,4,4,4,2
    ckpt = psd.torch.Checkpoint(ddp, opt, sched, loader)
    if from_zero:  # the script's own loop, unchanged: `steps` counts epochs here
        n = 0
        for epoch in range(steps):
            sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                F.cross_entropy(ddp(x), y).backward()
                opt.step()
                n += 1
                print("step %d" % n, flush=True)  # this process's steps
                time.sleep(0.02)
            sched.step()
        if r == 0:
            torch.save(net.state_dict(), out)
        dist.destroy_process_group()
        return
    step, epoch = ckpt.step, ckpt.epoch
    marker = out + ".died"
    while step < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if backup and r == 2 and step == 4 and not os.path.exists(marker):
                open(marker, "w").close()
                print("rank 2 dies", flush=True)
                os._exit(1)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            sched.step()
            step += 1
            print("step %d" % step, flush=True)
            time.sleep(0.02)  # long enough a run for a signal to land in it
            if step == steps:
                break
        epoch += 1
    if r == 0:
        torch.save(net.state_dict(), out)
    dist.destroy_process_group()


def backup(out):
    dist.init_process_group("psd")
    r, n = dist.get_rank(), dist.get_world_size()
    assert n == 3
    # A mean of floats is over the first two parts to arrive, the same on
    # every rank; exact calls wait for all three.
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.item() in (1.5, 2.0, 2.5), t
    got = [torch.zeros(1) for _ in range(n)]
    dist.all_gather(got, t)
    assert all(g.item() == t.item() for g in got), (got, t)
    got = [torch.zeros(2, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(got, torch.tensor([r, 2**40 + r]))
    assert [g.tolist() for g in got] == [[k, 2**40 + k] for k in range(n)], got
    b = torch.tensor([7 * r, -r], dtype=torch.int32)
    dist.broadcast(b, src=1)
    assert b.tolist() == [7, -1], b
    dist.barrier()
    torch.manual_seed(7)
    net = small_net()
    start = [p.detach().clone() for p in net.parameters()]
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for step in range(12):
        if r == 2 and step == 4:
            print("rank 2 dies", flush=True)
            os._exit(1)
        x, y = batches(step, n)
        x, y = x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(start, net.parameters()))
    torch.save(net.state_dict(), "%s.%d" % (out, r))
    print("rank %d trained 12 steps" % r, flush=True)
    dist.destroy_process_group()


def restart(marker):
    dist.init_process_group("psd")
    r = dist.get_rank()
    ddp = torch.nn.parallel.DistributedDataParallel(small_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(10):
        if r == 1 and step == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            print("rank 1 dies", flush=True)
            os._exit(1)
        x, y = batches(step, 2)
        opt.zero_grad()
        F.cross_entropy(ddp(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]).backward()
        opt.step()
    dist.destroy_process_group()


def rejoin(out, die, at="before"):
    """rejoin OUT DIE: a DDP script with psd.torch.Checkpoint (DataLoader
    over a DistributedSampler, BatchNorm, AdamW, StepLR, small buckets, an
    all_reduce of the loss after each step); rank DIE (-1: none) dies in
    the middle of step 8's backward (once: OUT.died marks it), after some
    of its buckets have gone, or with AT "after" between that step's
    optimizer step and the all_reduce; psrun --restart-workers starts it
    again.
    Every rank saves its final state_dict to OUT.<rank>."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    dist._DEFAULT_FIRST_BUCKET_BYTES = 256  # several buckets, rebuilt after step 1
    dist.init_process_group("psd")
    r = dist.get_rank()
    torch.manual_seed(7)
    net = small_net()
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(groups(net), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(44, 3, 6, 6, generator=g),
                         torch.randint(0, 5, (44,), generator=g))
    sampler = DistributedSampler(data, seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler)  # 6 batches a rank
    ckpt = psd.torch.Checkpoint(ddp, opt, sched, loader)
    marker = out + ".died"
    step = ckpt.step
    first = net[0].weight  # its gradient comes last: the other buckets have gone

    def dies(where):
        if r == die and step == 7 and where == at and not os.path.exists(marker):
            open(marker, "w").close()
            print("rank %d dies %s step 8's optimizer step" % (r, where), flush=True)
            os._exit(1)

    first.register_hook(lambda g: dies("before"))
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            dies("after")
            step += 1
            dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        sched.step()
    torch.save(net.state_dict(), "%s.%d" % (out, r))
    print("rank %d trained %d steps" % (r, step), flush=True)
    dist.destroy_process_group()


def skip():
    # The timeout bounds init's start-up barrier too: 12 s leaves room for
    # a loaded machine to start both ranks (importing torch takes seconds).
    dist.init_process_group("psd", timeout=timedelta(seconds=12))
    r = dist.get_rank()
    if r == 0:
        try:
            dist.all_reduce(torch.ones(3))
        except RuntimeError as e:
            print("rank 0 failed: %s" % e, flush=True)
            sys.exit(3)
        sys.exit("rank 0: the all_reduce rank 1 skipped returned")
    time.sleep(20)  # rank 1 makes no call while rank 0 waits for it


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "collectives":
        collectives()
    elif mode == "equivalence":
        equivalence(sys.argv[2])
    elif mode == "backup":
        backup(sys.argv[2])
    elif mode == "restart":
        restart(sys.argv[2])
    elif mode == "skip":
        skip()
    elif mode == "rejoin":
        rejoin(sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
    elif mode in ("preempt", "preempt1"):
        preempt(sys.argv[2], int(sys.argv[3]), mode == "preempt1")
    elif mode == "preempt_backup":
        preempt(sys.argv[2], int(sys.argv[3]), backup=True)
    else:
        sys.exit("unknown mode " + mode)
