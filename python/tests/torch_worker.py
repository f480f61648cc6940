"""A PyTorch worker the tests start as a process: trains a small model
through psd.torch.DistributedModule on a deterministic batch and saves the
final parameters (and its step) to an .npz file.

usage: torch_worker.py HOSTS WORKER NUM_WORKERS BATCH STEPS OUT [opts]
  opts: bucket=BYTES  overlap=0|1  embed=1  float64=1  stop_at=STEP  bn=1 (a batch
        norm)  accum=1 (two micro-batches per step, the first in no_sync)
        twice=1 (a second backward outside no_sync: an error)
        torchopt=1 (torch.optim.AdamW with two parameter groups, StepLR and
        clip_grad_norm_ on the workers: torch_training())"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # python/
import psd  # noqa: E402
import psd.torch  # noqa: E402

SEED = 1234


class Net(torch.nn.Module):
    def __init__(self, embed_client=None, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(SEED)
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1).to(dtype)
        self.fc1 = torch.nn.Linear(3 * 4 * 4 + (4 if embed_client else 0), 16).to(dtype)
        self.fc2 = torch.nn.Linear(16, 5).to(dtype)
        self.bn = None
        self.emb = None
        if embed_client is not None:
            self.emb = psd.torch.Embedding(embed_client, "emb", 4, 1000,
                                           optimizer=psd.TableSGD(0.1),
                                           init=psd.Normal(0, 0.1, seed=3))

    def forward(self, x, ids):
        h = torch.relu(self.conv(x)).flatten(1)
        if self.emb is not None:
            h = torch.cat([h, self.emb(ids).sum(1).to(h.dtype)], 1)
        h = self.fc1(h)
        if self.bn is not None:
            h = self.bn(h)
        return self.fc2(torch.relu(h))


def batch(step, lo, hi, dtype):
    """Rows lo..hi of step's global batch: the same data however split."""
    g = torch.Generator().manual_seed(SEED + step)
    x = torch.randn(64, 2, 4, 4, generator=g).to(dtype)
    y = torch.randint(0, 5, (64,), generator=g)
    ids = torch.randint(-50, 50, (64, 3), generator=g)
    return x[lo:hi], y[lo:hi], ids[lo:hi]


def torch_training(net):
    """The optimizer, scheduler and clipping of torchopt=1, also used by
    the single-process reference."""
    decay = [p for p in net.parameters() if p.ndim > 1]
    rest = [p for p in net.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0, "lr": 0.02}], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    def update():
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        sched.step()

    return opt, update


STOP_WAIT_STEPS = 20000  # steps past the last one a stopping run may take


def main():
    hosts, w, nw, b, steps, out = sys.argv[1:7]
    opts = dict(a.split("=") for a in sys.argv[7:])
    w, nw, b, steps = int(w), int(nw), int(b), int(steps)
    dtype = torch.float64 if opts.get("float64") == "1" else torch.float32
    client = psd.Client(hosts=hosts.split(","), worker_index=w, num_workers=nw,
                        telemetry="off")
    net = Net(client if opts.get("embed") == "1" else None, dtype)
    if opts.get("bn") == "1":
        net.bn = torch.nn.BatchNorm1d(16).to(dtype)
    topt, update = torch_training(net) if opts.get("torchopt") == "1" else (None, None)
    model = psd.torch.DistributedModule(
        net, client, optimizer=topt or psd.SGD(lr=0.1, momentum=0.9),
        bucket_bytes=int(opts.get("bucket", 1 << 20)), overlap=opts.get("overlap", "1") == "1")
    step = model.start()
    # A stop ends the run at the step the chief picks once every ps has
    # written its file; training goes on while it is written (as long as
    # the disk takes: docs/checkpoint.md), so a stopping run steps past
    # `steps` until psd.Stopped, within a bound that fails the test.
    limit = steps + STOP_WAIT_STEPS if opts.get("stop_at") else steps
    try:
        while step < limit:
            if opts.get("stop_at") and step == int(opts["stop_at"]) and w == 0:
                client.request_stop()
            x, y, ids = batch(step, w * b, (w + 1) * b, dtype)
            if topt:
                topt.zero_grad()
            if opts.get("accum") == "1":  # two micro-batches, one step
                h = b // 2
                with model.no_sync():
                    torch.nn.functional.cross_entropy(model(x[:h], ids[:h]), y[:h]).backward()
                x, y, ids = x[h:], y[h:], ids[h:]
            loss = torch.nn.functional.cross_entropy(model(x, ids), y)
            loss.backward()
            if opts.get("twice") == "1":
                torch.nn.functional.cross_entropy(model(x, ids), y).backward()
            step = model.step()
            if topt:  # .grad is the workers' mean: the script's own update
                update()
    except psd.Stopped:
        client.finish()
        np.savez(out, step=step, stop_step=client.stop_step)
        sys.exit(psd.EXIT_STOPPED)
    if opts.get("stop_at"):
        sys.exit("torch_worker: stop requested at step %s, still not stopped at step %d"
                 % (opts["stop_at"], step))
    params = {k: v.detach().double().numpy() for k, v in net.named_parameters()}
    params.update({"buf." + k: v.detach().double().numpy() for k, v in net.named_buffers()})
    if net.emb is not None:
        params["emb_rows"] = net.emb.table.pull(np.arange(-50, 50), read_only=True)
    client.finish()
    np.savez(out, step=step, **params)


if __name__ == "__main__":
    main()
