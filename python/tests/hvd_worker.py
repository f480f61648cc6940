"""A training script written as Horovod's own PyTorch examples are, with
its import line changed to psd.horovod (test_horovod.py starts it under
psrun --local):

  hvd_worker.py train OUT STEPS [fp16]   DistributedSampler by hvd.size()
      and hvd.rank(), DistributedOptimizer around AdamW (two parameter
      groups, two backward passes per step), broadcast_parameters,
      broadcast_optimizer_state, synchronize + clip_grad_norm_ +
      skip_synchronize, StepLR, an allreduce of the loss; rank 0 saves its
      parameters and the averaged losses to OUT
  hvd_worker.py api                       the other calls against values
      computed here; prints "ok rank R"
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples", "python"))
import psd_path  # noqa: E402,F401
import psd.horovod as hvd  # noqa: E402  # was: import horovod.torch as hvd

N, B, ACCUM = 72, 6, 2  # samples, samples a rank takes per step, backward passes a step


def net():
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4),
        torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))


def data():
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(N, 3, 6, 6, generator=g),
                         torch.randint(0, 5, (N,), generator=g))


def optimizer(model, world):
    decay = [p for p in model.parameters() if p.ndim > 1]
    rest = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=0.005 * world)


def train(out, steps, compression):
    hvd.init()
    torch.set_num_threads(1)
    dataset = data()
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(),
                                 shuffle=False)
    loader = DataLoader(dataset, batch_size=B, sampler=sampler)
    model = net()
    if hvd.rank() != 0:  # broadcast_parameters must give every rank rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    opt = optimizer(model, hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=compression, backward_passes_per_step=ACCUM)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    losses, step = [], 0
    for x, y in loader:
        if step == steps:
            break
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(ACCUM), y.chunk(ACCUM)):
            loss = F.cross_entropy(model(xs), ys) / ACCUM
            loss.backward()
            total += float(loss)
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with opt.skip_synchronize():
            opt.step()
        sched.step()
        losses.append(float(hvd.allreduce(torch.tensor(total), name="avg_loss")))
        step += 1
    if hvd.rank() == 0:
        torch.save({"params": dict(model.named_parameters()), "losses": losses}, out)


def api():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    assert (r, n, hvd.local_rank(), hvd.local_size()) == (
        int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]),
        int(os.environ["LOCAL_WORLD_SIZE"]))
    t = torch.tensor([1.0 + r, 2.0 * r])
    assert torch.allclose(hvd.allreduce(t), torch.tensor([1.0 + (n - 1) / 2, n - 1.0]))
    assert torch.allclose(hvd.allreduce(t, op=hvd.Sum), torch.tensor(
        [sum(1.0 + k for k in range(n)), sum(2.0 * k for k in range(n))]))
    assert t.tolist() == [1.0 + r, 2.0 * r]  # allreduce returns a new tensor
    assert hvd.allreduce(torch.tensor([r]), op=hvd.Max).item() == n - 1
    h = hvd.allreduce_async_(t, average=False)
    assert hvd.synchronize(h) is t and t[0].item() == sum(1.0 + k for k in range(n))
    half = hvd.allreduce(torch.full((5,), 0.25 * (r + 1)), compression=hvd.Compression.fp16)
    assert torch.allclose(half, torch.full((5,), 0.25 * (n + 1) / 2), atol=1e-3), half
    # allgather: the first dimension differs between ranks
    g = hvd.allgather(torch.full((r + 1, 2), float(r)))
    assert g.shape == (n * (n + 1) // 2, 2)
    assert g[:, 0].tolist() == [float(k) for k in range(n) for _ in range(k + 1)]
    b = hvd.broadcast(torch.tensor([3.0 + r, 1e-30]), root_rank=n - 1)
    assert torch.equal(b, torch.tensor([3.0 + n - 1, 1e-30])), b  # bit for bit
    assert hvd.broadcast_object({"from": r} if r == 1 else None, root_rank=1) == {"from": 1}
    assert hvd.allgather_object(("r", r)) == [("r", k) for k in range(n)]
    for call in (lambda: hvd.allreduce(t, op=hvd.Adasum), lambda: hvd.alltoall(t)):
        try:
            call()
        except NotImplementedError as e:
            assert "psd.horovod" in str(e)
        else:
            raise AssertionError("an unsupported call did not raise")
    hvd.barrier()
    assert hvd.join() == n - 1
    print("ok rank %d" % r, flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2], int(sys.argv[3]),
              hvd.Compression.fp16 if sys.argv[4:] == ["fp16"] else hvd.Compression.none)
    elif sys.argv[1] == "api":
        api()
    else:
        sys.exit("unknown mode " + sys.argv[1])
