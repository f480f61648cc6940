"""The CIFAR-10 tutorial CNN and its data pipeline in PyTorch, the same as
the C example's (examples/cifar10), so that the psd, DDP and C workers
train one model on one stream of batches:

- Net: the network of nn.h, initialized as nn_model.c's parameter table
  (truncated normals, constant biases); loss(): cross-entropy plus the
  0.004 L2 term on local3/local4 weights, as cnn_train_step.
- load_train / load_test: the binary files, checked as data.c checks them.
- Sampler: data.c's sampler bit for bit (the same epoch permutations, crops,
  flips and per-image standardization), so the batch of step s for worker w
  is a pure function of (seed, s, w, num_workers) and a resumed job goes on
  from where its step says.
- lr_factor: psd's learning-rate schedule (psd/optimizer.c), for runs that
  do not go through psd.
- options / Progress: cifar_worker's options, its progress lines, its
  --metrics JSON lines (docs/telemetry.md) and its closing summary line,
  shared by the psd and the DDP trainers.

Layouts are PyTorch's (OIHW convolutions, [out, in] linear weights, local3
input flattened in (c, h, w) order), not the C model's TF layouts: the
distributions are the same, the values are not interchangeable.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# ------------------------------------------------------------------ network

# nn_model.c's PARAMS: weight stddev (truncated at 2 stddevs), bias constant,
# weight decay of the weight.
INIT = {
    "conv1": (5e-2, 0.0, 0.0),
    "conv2": (5e-2, 0.1, 0.0),
    "local3": (0.04, 0.1, 0.004),
    "local4": (0.04, 0.1, 0.004),
    "softmax_linear": (1.0 / 192.0, 0.0, 0.0),
}


class Net(nn.Module):
    def __init__(self, lrn=True):
        super().__init__()
        self.lrn = lrn
        self.conv1 = nn.Conv2d(3, 64, 5, padding=2)
        self.conv2 = nn.Conv2d(64, 64, 5, padding=2)
        self.local3 = nn.Linear(6 * 6 * 64, 384)
        self.local4 = nn.Linear(384, 192)
        self.softmax_linear = nn.Linear(192, 10)
        # TF: out = in / (1 + 0.001/9 * sum_{9 channels} in^2)^0.75;
        # torch divides alpha by size, so alpha = 0.001/9 * 9.
        self.norm = nn.LocalResponseNorm(size=9, alpha=0.001, beta=0.75, k=1.0)
        self.reset_parameters()

    def reset_parameters(self):
        """nn_model.c's initializers, drawn from torch's global generator
        (torch.manual_seed decides the values)."""
        with torch.no_grad():
            for name, (std, bias, _) in INIT.items():
                layer = getattr(self, name)
                nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
                layer.bias.fill_(bias)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        # TF SAME max-pool k3 s2 (24->12, 12->6) pads one column/row at the
        # end only: that is ceil_mode=True with no padding.
        x = F.max_pool2d(x, 3, 2, ceil_mode=True)
        if self.lrn:
            x = self.norm(x)
        x = F.relu(self.conv2(x))
        if self.lrn:
            x = self.norm(x)
        x = F.max_pool2d(x, 3, 2, ceil_mode=True)
        x = torch.flatten(x, 1)
        x = F.relu(self.local3(x))
        x = F.relu(self.local4(x))
        return self.softmax_linear(x)


def loss(net, logits, labels):
    """The training loss of cnn_train_step: mean cross-entropy plus
    wd * sum(w^2) / 2 for the weights with weight decay. net may be wrapped
    (DDP, psd's module): its layers are reached through .module if so."""
    inner = getattr(net, "module", net)
    out = F.cross_entropy(logits, labels)
    for name, (_, _, wd) in INIT.items():
        if wd > 0:
            out = out + 0.5 * wd * getattr(inner, name).weight.pow(2).sum()
    return out


@torch.no_grad()
def accuracy(net, test, batch=1000):
    """Test accuracy over the whole set (centre crops, as cifar_worker)."""
    net.eval()
    right = 0
    for first in range(0, test.n, batch):
        x, y = eval_batch(test, first, batch)
        right += int((net(x).argmax(1) == y).sum())
    net.train()
    return right / test.n if test.n else 0.0


def lr_factor(step, total, warmup=0, cosine=False, min_factor=0.0):
    """psd_opt_lr's factor (psd/optimizer.c) at step: cosine from 1 after the
    warm-up to min_factor at total; the linear warm-up scales it."""
    f = 1.0
    if cosine and total > warmup:
        p = 0.0 if step <= warmup else min(1.0, (step - warmup) / (total - warmup))
        f = min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * p))
    if step < warmup:
        f *= (step + 1) / warmup
    return f


# --------------------------------------------------------------------- data

SIDE, CROP, RECORD = 32, 24, 1 + 3 * 32 * 32
TRAIN_FILES = 5


class CifarSet:
    """labels: (n,) uint8; pixels: (n, 3, 32, 32) uint8."""

    def __init__(self, labels, pixels):
        self.labels, self.pixels, self.n = labels, pixels, len(labels)


def _read(paths):
    parts = []
    for p in paths:
        raw = np.fromfile(p, dtype=np.uint8)
        if raw.size == 0 or raw.size % RECORD:
            raise ValueError(f"{p}: size {raw.size} is not a whole number of {RECORD}-byte records")
        recs = raw.reshape(-1, RECORD)
        bad = np.flatnonzero(recs[:, 0] > 9)
        if bad.size:
            raise ValueError(f"{p}: record {bad[0]} has label {recs[bad[0], 0]} (expected 0..9)")
        parts.append(recs)
    recs = np.concatenate(parts)
    return CifarSet(recs[:, 0].copy(), recs[:, 1:].reshape(-1, 3, SIDE, SIDE))


def load_train(d):
    """data_batch_1.bin .. data_batch_K.bin, the run without gaps (data.h)."""
    paths = [os.path.join(d, f"data_batch_{k}.bin") for k in range(1, TRAIN_FILES + 1)]
    have = [os.path.exists(p) for p in paths]
    k = have.index(False) if False in have else TRAIN_FILES
    if k == 0:
        raise FileNotFoundError(f"{paths[0]}: no such file")
    if any(have[k:]):
        raise ValueError(f"{paths[k]}: missing, but a later data_batch file exists")
    return _read(paths[:k])


def load_test(d):
    return _read([os.path.join(d, "test_batch.bin")])


# data.c's counter-based randomness: splitmix64 on uint64 arrays (numpy
# integer arithmetic wraps modulo 2^64, as C's).
U = np.uint64
GOLDEN = U(0x9E3779B97F4A7C15)
TAG_PERM, TAG_AUG = U(0x7065726D75746531), U(0x6175676D656E7431)


def _mix64(z):
    z = z + GOLDEN
    z = (z ^ (z >> U(30))) * U(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> U(27))) * U(0x94D049BB133111EB)
    return z ^ (z >> U(31))


def _hash4(seed, tag, a, b):
    with np.errstate(over="ignore"):
        h = _mix64(np.atleast_1d(U(seed) ^ tag))
        h = _mix64(h ^ np.asarray(a, dtype=U))
        return _mix64(h ^ np.asarray(b, dtype=U))


def _below(r, bound):
    """(r * bound) >> 64 for bound < 2^32, without 128-bit integers."""
    bound = bound.astype(U)
    hi, lo = r >> U(32), r & U(0xFFFFFFFF)
    return (hi * bound + ((lo * bound) >> U(32))) >> U(32)


def _standardize(crops):
    """TF per_image_standardization of uint8 (B, 3, 24, 24), computed as
    data.c's prep_image (exact integer moments) so the floats are the
    same bits."""
    v = crops.reshape(len(crops), -1).astype(np.int64)
    n = float(v.shape[1])
    s, ss = v.sum(1).astype(np.float64), (v * v).sum(1).astype(np.float64)
    var = np.maximum((ss * n - s * s) / (n * n), 0.0)
    inv = (1.0 / np.maximum(np.sqrt(var), 1.0 / math.sqrt(n))).astype(np.float32)
    mean = (s / n).astype(np.float32)
    return (crops.astype(np.float32) - mean[:, None, None, None]) * inv[:, None, None, None]


def _crop(pixels, rec, dy, dx, flip):
    """24x24 crops at (dy, dx) of the records rec, mirrored where flip."""
    ar = np.arange(CROP)
    rows = dy[:, None] + ar
    cols = dx[:, None] + np.where(flip[:, None], CROP - 1 - ar, ar)
    return pixels[rec[:, None, None, None], np.arange(3)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]


def _to_torch(images, labels):
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def eval_batch(s, first, batch):
    """Records first.. (at most batch), centre crop, standardized; as
    cifar_eval_batch."""
    rec = np.arange(first, min(first + batch, s.n))
    off = np.full(len(rec), (SIDE - CROP) // 2)
    crops = _crop(s.pixels, rec, off, off, np.zeros(len(rec), dtype=bool))
    return _to_torch(_standardize(crops), s.labels[rec])


class Sampler:
    """data.h's training sampler: every epoch is a permutation of the set,
    the same on every worker; global step s covers positions s*W*B ..
    (s+1)*W*B - 1 of perm_0, perm_1, ...; worker w takes B of them from
    s*W*B + w*B. Crop and flip come from a hash of (seed, epoch, position)."""

    def __init__(self, s, worker, num_workers, seed):
        if not 0 <= worker < num_workers or s.n <= worker:
            raise ValueError(f"worker {worker} of {num_workers} on a set of {s.n}")
        self.set, self.w, self.nw, self.seed = s, worker, num_workers, seed
        self._perms = {}  # the last two epochs' permutations

    def _perm(self, e):
        if e not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[next(iter(self._perms))]
            self._perms[e] = self._shuffle(e)
        return self._perms[e]

    def _shuffle(self, e):
        """data.c's epoch_perm: Fisher-Yates over a splitmix64 stream. The
        random draws are vectorized; only the swaps are a Python loop."""
        n = self.set.n
        with np.errstate(over="ignore"):
            k = np.arange(1, n, dtype=U)
            state = _hash4(self.seed, TAG_PERM, 0, e) + k * GOLDEN
            bounds = n + 1 - k  # i = n, n-1, .., 2
            js = _below(_mix64(state), bounds).tolist()
        p = list(range(n))
        for i, j in zip(range(n, 1, -1), js):
            p[i - 1], p[j] = p[j], p[i - 1]
        return np.array(p, dtype=np.int64)

    def batch(self, step, B):
        """(images (B, 3, 24, 24) float32, labels (B,) int64, epoch) of
        global step `step`; epoch: the global batch's first position in
        epochs, as cifar_sampler_batch."""
        n = self.set.n
        gfirst = step * B * self.nw
        pos = gfirst + self.w * B + np.arange(B)
        ep, off = pos // n, pos % n
        rec = np.empty(B, dtype=np.int64)
        for e in np.unique(ep):
            rec[ep == e] = self._perm(int(e))[off[ep == e]]
        h = _hash4(self.seed, TAG_AUG, ep, off)
        dy = (((h & U(0x1FFFFF)) * U(9)) >> U(21)).astype(np.int64)
        dx = ((((h >> U(21)) & U(0x1FFFFF)) * U(9)) >> U(21)).astype(np.int64)
        flip = (h >> U(63)).astype(bool)
        crops = _crop(self.set.pixels, rec, dy, dx, flip)
        x, y = _to_torch(_standardize(crops), self.set.labels[rec])
        return x, y, gfirst // n + (gfirst % n) / n


# --------------------------------------------------- runs: options, reports


def options(doc):
    """cifar_worker's training options (its defaults too)."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    opt = ap.add_argument
    opt("--data", required=True, help="CIFAR-10 binary files (cifar_synth makes small ones)")
    opt("--epochs", type=float, default=1.0, help="epochs over the training set [1]")
    opt("--steps", type=int, default=0, help="steps instead of epochs")
    opt("--batch", type=int, default=128, help="images per worker per step [128]")
    opt("--lr", type=float, default=0.1, help="learning rate for the global batch [0.1]")
    opt("--momentum", type=float, default=0.0, help="SGD momentum [0: plain SGD]")
    opt("--warmup-epochs", type=float, default=0.0, help="linear warm-up of the lr [0]")
    opt("--cosine", action="store_true", help="cosine decay of the lr to 0 at the last step")
    opt("--eval-every", type=int, default=0, help="chief evaluates every N steps [0: at the end]")
    opt("--metrics", help="JSON lines of progress (worker i>0: FILE.w<i>)")
    opt("--threads", type=int, default=0,
        help="torch threads [SLURM_CPUS_PER_TASK, else cores/local workers]")
    opt("--seed", type=int, default=1, help="initial values, data order and augmentation [1]")
    opt("--no-lrn", action="store_true", help="drop both LRN layers")
    return ap


def default_threads(local_workers):
    """As cifar_worker: SLURM_CPUS_PER_TASK, else this process's share of
    the cores it may run on."""
    v = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if v.isdigit() and int(v) > 0:
        return int(v)
    return max(1, len(os.sched_getaffinity(0)) // max(1, local_workers))


def schedule(a, n_train, num_workers):
    """(steps per epoch, total steps, warm-up steps) as cifar_worker counts
    them: every worker sees its shard once per epoch."""
    per_epoch = n_train / (num_workers * a.batch)
    total = a.steps or math.ceil(a.epochs * per_epoch)
    warmup = round(a.warmup_epochs * per_epoch)
    if a.cosine and total <= warmup:
        sys.exit("--cosine needs more steps than the warm-up")
    return per_epoch, total, warmup


class Progress:
    """cifar_worker's reports: a line on stderr and in --metrics about once
    a second and after each evaluation, then one JSON summary on stdout."""

    def __init__(self, a, worker, num_workers, total, per_epoch, first_step):
        self.a, self.w, self.nw = a, worker, num_workers
        self.total, self.per_epoch = total, per_epoch
        path = a.metrics if worker == 0 else f"{a.metrics}.w{worker}"
        self.metrics = open(path, "w") if a.metrics else None
        self.t0 = self.last = self.end = time.perf_counter()
        self.first = self.mark = self.step = first_step
        self.loss_sum, self.loss_n, self.loss, self.epoch = 0.0, 0, float("nan"), 0.0

    def _line(self, wall, ips, loss, acc):
        d = {"worker": self.w, "wall_s": round(wall, 3), "step": self.step,
             "epoch": round(self.epoch, 4), "loss": round(loss, 5), "images_per_sec": round(ips, 2)}
        if acc is not None:
            d["test_accuracy"] = round(acc, 5)
        if self.metrics:
            self.metrics.write(json.dumps(d, separators=(",", ":")) + "\n")
            self.metrics.flush()

    def record(self, step, epoch, loss, acc=None):
        """After a step: step is the next one, epoch and loss the batch's."""
        self.step, self.epoch, self.loss = step, epoch, loss
        self.loss_sum += loss
        self.loss_n += 1
        now = self.end = time.perf_counter()
        if now - self.last < 1.0 and acc is None:
            return
        ips = (step - self.mark) * self.a.batch * self.nw / (now - self.last)
        eta = (self.total - step) * self.a.batch * self.nw / ips if ips > 0 else 0
        loss = self.loss_sum / self.loss_n
        print(f"w{self.w} step {step} epoch {epoch:.2f} loss {loss:.4f} images/s {ips:.1f} "
              f"eta {eta:.0f}s", file=sys.stderr, flush=True)
        if acc is not None:
            print(f"w{self.w} step {step} test accuracy {acc:.4f}", file=sys.stderr, flush=True)
        self._line(now - self.t0, ips, loss, acc)
        self.last, self.mark, self.loss_sum, self.loss_n = now, step, 0.0, 0

    def finish(self, acc=None, stopped=False):
        """The last metrics line and the summary (neither when the job
        stopped: it goes on when run again). acc: the chief's."""
        wall = self.end - self.t0  # the training loop's, as cifar_worker
        ips = (self.step - self.first) * self.a.batch * self.nw / wall if wall > 0 else 0.0
        if not stopped:
            self.epoch = self.step / self.per_epoch
            self._line(wall, ips, self.loss, acc if self.w == 0 else None)
            out = {"test_accuracy": None if acc is None else round(acc, 4),
                   "images_per_sec": round(ips, 1), "steps": self.step,
                   "epochs": round(self.epoch, 3), "wall_s": round(wall, 2)}
            out.update({"workers": self.nw, "batch": self.a.batch} if self.w == 0
                       else {"worker": self.w})
            out["loss"] = round(self.loss, 4)
            print(json.dumps(out), flush=True)
        if self.metrics:
            self.metrics.close()
