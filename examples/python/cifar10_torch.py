#!/usr/bin/python3
"""cifar10_torch.py - the CIFAR-10 tutorial CNN in PyTorch, trained through
psd with psd.torch.DistributedModule: the Python twin of cifar_worker (same
network, initializers, batches, options, metrics and summary line; see
cifar_net.py). Run it under psrun:

  build/bin/psrun --local -n 3 --ps 1 -- /usr/bin/python3 \\
      examples/python/cifar10_torch.py --data DIR --epochs 1 --momentum 0.9 --cosine

(the psd package: pip install ./python, docs/python.md; or, from a build
tree, PYTHONPATH=python PSD_LIBPSCLIENT=build/lib/libpsclient.so).

The servers run the optimizer (SGD, momentum and schedule as
cifar_worker's: psd.SGD, psd.Cosine, psd.Warmup); the workers push the
gradient of the loss with its L2 term. The chief (worker 0) evaluates the
test set every --eval-every steps and at the end.

With psrun --checkpoint-dir, SIGTERM or SIGUSR1 stops the job after a
checkpoint: every worker finishes and exits 75; run the job again and it
resumes at the checkpoint's step, with the batches that step gets.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cifar_net as cn  # noqa: E402
import psd_path  # noqa: E402,F401  (the checkout's psd when not installed)

import psd  # noqa: E402
import psd.torch  # noqa: E402


def optimizer(a, total, warmup):
    """cifar_worker's server-side optimizer (momentum 0: plain SGD)."""
    if a.cosine:
        sched = psd.Cosine(total, warmup_steps=warmup)
    elif warmup:
        sched = psd.Warmup(warmup)
    else:
        sched = None
    return psd.SGD(a.lr, momentum=a.momentum, schedule=sched)


def train(a, client, train_set, test_set):
    """The training loop; returns its Progress and the chief's final test
    accuracy (None on the others); psd.Stopped when the job stops."""
    w, nw = client.worker_index, client.num_workers
    per_epoch, total, warmup = cn.schedule(a, train_set.n, nw)
    torch.manual_seed(a.seed)  # the chief's initial values; the others attach
    net = cn.Net(lrn=not a.no_lrn)
    model = psd.torch.DistributedModule(net, client, optimizer=optimizer(a, total, warmup))
    step = model.start()  # 0, or where a resumed job is
    if step:
        print(f"cifar10_torch {w}: resuming at step {step}", file=sys.stderr)
    sampler = cn.Sampler(train_set, w, nw, a.seed)
    prog = cn.Progress(a, w, nw, total, per_epoch, step)
    try:
        while step < total:
            x, y, epoch = sampler.batch(step, a.batch)
            loss = cn.loss(net, model(x), y)
            loss.backward()  # gradients go out bucket by bucket
            step = model.step()
            due = (test_set is not None and a.eval_every > 0 and step % a.eval_every == 0
                   and step < total)
            prog.record(step, epoch, float(loss), cn.accuracy(net, test_set) if due else None)
    except psd.Stopped:
        prog.finish(stopped=True)
        raise
    acc = cn.accuracy(net, test_set) if test_set is not None else None
    return prog, acc


def main():
    a = cn.options(__doc__).parse_args()
    train_set = cn.load_train(a.data)
    client = psd.Client.from_env()
    test_set = cn.load_test(a.data) if client.worker_index == 0 else None
    local = int(os.environ.get("PS_LOCAL_WORKERS", "1"))  # psrun --local: workers share cores
    torch.set_num_threads(a.threads or cn.default_threads(local))
    try:
        prog, acc = train(a, client, train_set, test_set)
    except psd.Stopped as e:
        print(f"cifar10_torch {client.worker_index}: {e}", file=sys.stderr)
        client.finish()
        sys.exit(psd.EXIT_STOPPED)  # 75, as the C workers: run it again
    client.finish()
    prog.finish(acc)


if __name__ == "__main__":
    main()
