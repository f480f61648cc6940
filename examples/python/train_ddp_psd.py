#!/usr/bin/python3
"""train_ddp_psd.py - train_ddp.py trained through psd: a plain PyTorch
DistributedDataParallel script that differs from its gloo twin
train_ddp.py only in the line marked "# psd:" (and this paragraph): psrun
puts an import hook on its workers' PYTHONPATH (python/hook) that registers
the "psd" backend when the script imports torch.distributed.

  torchrun --standalone --nproc_per_node=2 train_ddp.py --data DIR
  psrun --local --ps=1 -n 2 /usr/bin/python3 train_ddp_psd.py --data DIR

Both read torchrun's contract (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), which psrun exports too. What it shows: DistributedSampler,
DDP around the CIFAR-10 tutorial network (--model cifar) or torchvision's
resnet18 (--model resnet18, 32x32 inputs), AdamW or SGD with two parameter
groups (no weight decay on biases and norms), a StepLR schedule,
clip_grad_norm_, gradient accumulation (--accum, with DDP's no_sync), CPU
bfloat16 autocast (--amp), an all_reduce of the loss for logging, and the
chief evaluating and saving after the last step.

--data DIR reads CIFAR-10's binary files; --synthetic N makes N random
images whose label is a fixed function of the pixels (tests). Prints one
JSON line per logged step on rank 0 and a closing JSON line per rank
(images/s after the warm-up steps, the final parameters' checksum).
"""
import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
BACKEND = "psd"  # psd: was "gloo"; psrun's workers find the backend with no import


def options():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    opt = ap.add_argument
    opt("--data", help="CIFAR-10 binary files")
    opt("--synthetic", type=int, default=0, help="N random images instead of --data")
    opt("--model", choices=("cifar", "resnet18", "small"), default="cifar")
    opt("--optimizer", choices=("adamw", "sgd"), default="sgd")
    opt("--lr", type=float, default=0.05)
    opt("--weight-decay", type=float, default=5e-4)
    opt("--batch", type=int, default=64, help="images per rank per step [64]")
    opt("--steps", type=int, default=100)
    opt("--accum", type=int, default=1, help="micro-batches per step [1]")
    opt("--clip", type=float, default=5.0, help="clip_grad_norm_ bound [5]")
    opt("--step-size", type=int, default=30, help="StepLR: steps per decay [30]")
    opt("--amp", action="store_true", help="CPU bfloat16 autocast")
    opt("--threads", type=int, default=0, help="torch threads [torch's default]")
    opt("--warmup", type=int, default=5, help="steps not timed [5]")
    opt("--log-every", type=int, default=10)
    opt("--seed", type=int, default=1)
    opt("--save", help="rank 0 saves the model's state_dict here at the end")
    return ap.parse_args()


def dataset(a):
    side = 24 if a.model == "cifar" else 32  # the tutorial network takes 24x24 crops
    if a.data:
        import cifar_net as cn
        s = cn.load_train(a.data)
        x = torch.from_numpy(s.pixels).float().div_(255.0).sub_(0.5)
        y = torch.from_numpy(s.labels).long()
    else:
        g = torch.Generator().manual_seed(a.seed)
        x = torch.randn(a.synthetic, 3, 32, 32, generator=g)
        y = (x[:, 0, :8, :8].sum((1, 2)) > 0).long() + 2 * (x[:, 1, :8, :8].sum((1, 2)) > 0).long()
    m = (32 - side) // 2
    return TensorDataset(x[:, :, m:m + side, m:m + side].contiguous(), y)


def model(a):
    if a.model == "resnet18":
        import torchvision
        return torchvision.models.resnet18(num_classes=10)
    if a.model == "small":
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(128, 10))
    import cifar_net as cn
    return cn.Net()


def param_groups(net, wd):
    """No weight decay on biases and normalization parameters."""
    decay = [p for n, p in net.named_parameters() if p.ndim > 1]
    rest = [p for n, p in net.named_parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def main():
    a = options()
    if a.threads:
        torch.set_num_threads(a.threads)
    dist.init_process_group(BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)
    net = model(a)
    ddp = DDP(net)
    groups = param_groups(net, a.weight_decay)
    if a.optimizer == "adamw":
        opt = torch.optim.AdamW(groups, lr=a.lr)
    else:
        opt = torch.optim.SGD(groups, lr=a.lr, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=a.step_size, gamma=0.5)
    data = dataset(a)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=a.seed)
    loader = DataLoader(data, batch_size=a.batch // a.accum, sampler=sampler, drop_last=True)
    step, epoch, t0 = 0, 0, None
    while step < a.steps:
        sampler.set_epoch(epoch)
        it = iter(loader)
        while step < a.steps:
            micro = [b for b in (next(it, None) for _ in range(a.accum)) if b is not None]
            if len(micro) < a.accum:
                break
            if step == a.warmup:
                t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for i, (x, y) in enumerate(micro):
                sync = contextlib.nullcontext() if i == a.accum - 1 else ddp.no_sync()
                amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.amp)
                with sync:
                    with amp:
                        loss = F.cross_entropy(ddp(x), y) / a.accum
                    loss.backward()
                total += float(loss)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), a.clip)
            opt.step()
            sched.step()
            step += 1
            if step % a.log_every == 0 or step == a.steps:
                mean = torch.tensor([total])
                dist.all_reduce(mean)  # the global batch's loss, for the log
                if rank == 0:
                    print(json.dumps({"step": step, "loss": total,
                                      "global_loss": float(mean) / world,
                                      "lr": sched.get_last_lr()[0]}), flush=True)
        epoch += 1
    elapsed = time.perf_counter() - t0 if t0 else float("nan")
    timed = max(0, step - a.warmup)
    with torch.no_grad():
        checksum = float(sum(p.double().sum() for p in net.parameters()))
    print(json.dumps({"rank": rank, "backend": dist.get_backend(), "steps": step,
                      "images_per_s": timed * a.batch * world / elapsed if timed else 0.0,
                      "param_checksum": checksum}), flush=True)
    if rank == 0 and a.save:
        torch.save(net.state_dict(), a.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
