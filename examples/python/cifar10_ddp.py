#!/usr/bin/python3
"""cifar10_ddp.py - the CIFAR-10 tutorial CNN trained with PyTorch's
DistributedDataParallel over gloo, NPROC processes on this machine: the
baseline cifar10_torch.py (psd) and cifar_worker (C) are compared with.
Same network, data pipeline (cifar_net.py: data.c's batches bit for bit),
options, recipe and reports as those two: torch.optim.SGD with the same
momentum rule (v = m*v + g; w -= lr*v) and psd's schedule (lr_factor).

  cifar10_ddp.py --data DIR --epochs 1 --nproc 2 [--metrics m.jsonl] ...

Rank r trains worker r's shard; rank 0 is the chief (test accuracy,
--metrics FILE; rank r > 0 writes FILE.w<r>). Every rank prints its summary
line, as cifar_worker does. No torchrun: the processes are forked here
(the data sets, loaded once, are shared), MASTER_ADDR 127.0.0.1 and a free
port (--port to choose one).
"""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cifar_net as cn  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(rank, a, port, train_set, test_set):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(a.threads or cn.default_threads(a.nproc))
    dist.init_process_group("gloo", rank=rank, world_size=a.nproc)
    per_epoch, total, warmup = cn.schedule(a, train_set.n, a.nproc)
    torch.manual_seed(a.seed)
    net = cn.Net(lrn=not a.no_lrn)
    model = DDP(net)  # rank 0's initial values go to every rank
    opt = torch.optim.SGD(net.parameters(), lr=a.lr, momentum=a.momentum)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cn.lr_factor(s, total, warmup, a.cosine))
    sampler = cn.Sampler(train_set, rank, a.nproc, a.seed)
    chief = rank == 0
    prog = cn.Progress(a, rank, a.nproc, total, per_epoch, 0)
    for step in range(total):
        x, y, epoch = sampler.batch(step, a.batch)
        opt.zero_grad(set_to_none=True)
        loss = cn.loss(model, model(x), y)
        loss.backward()  # DDP averages the gradients over the ranks
        opt.step()
        sched.step()
        due = chief and a.eval_every > 0 and (step + 1) % a.eval_every == 0 and step + 1 < total
        prog.record(step + 1, epoch, float(loss), cn.accuracy(net, test_set) if due else None)
    prog.finish(cn.accuracy(net, test_set) if chief else None)
    dist.destroy_process_group()


def main():
    ap = cn.options(__doc__)
    ap.add_argument("--nproc", type=int, default=2, help="training processes [2]")
    ap.add_argument("--port", type=int, default=0, help="rendezvous port [a free one]")
    a = ap.parse_args()
    train_set, test_set = cn.load_train(a.data), cn.load_test(a.data)
    # fork, not spawn: no second import of torch, and the sets are shared.
    mp.start_processes(train, args=(a, a.port or free_port(), train_set, test_set),
                       nprocs=a.nproc, start_method="fork")


if __name__ == "__main__":
    main()
