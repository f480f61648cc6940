"""ctr_torch - the CTR example (examples/ctr/ctr_worker.c) in PyTorch: one
embedding row per categorical id in a psd sparse table (psd.torch.Embedding:
each step pulls and pushes only the rows its batch touches), the F
embeddings of a record concatenated with log(1 + x) of its dense features,
a two-hidden-layer ReLU MLP trained as psd variables
(psd.torch.DistributedModule), a sigmoid and the logistic loss. Data:
ctr_synth's files (examples/ctr/ctr_data.h). Run it under psrun:

    build/bin/ctr_synth --out DIR
    build/bin/psrun --local -n 3 --ps 1 -- python3 examples/python/ctr_torch.py --data DIR

Step s's global batch is the records ctr_worker takes at step s, so both
learn from the same data in the same order, and a resumed job goes on
where it stopped. The chief evaluates logloss and AUC on the test split
(read-only pulls) every --eval-every steps and at the end. stdout: one
JSON line at the end; --metrics: JSON lines as ctr_worker writes them.
Exit status: 0 done, 1 an error, 75 stopped after a checkpoint (run the
same command again to resume).
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import psd_path  # noqa: E402,F401  (the checkout's psd when not installed)

import psd  # noqa: E402
import psd.torch  # noqa: E402

MAGIC, VERSION, HEADER_FIXED = b"PSDCTR01", 1, 64
TABLE_LR = {"sgd": 0.5, "adagrad": 0.1, "adam": 0.002, "ftrl": 0.05}  # ctr_worker's


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--data", required=True, help="DIR/train.bin and DIR/test.bin (ctr_synth makes them)")
    a("--epochs", type=float, default=1.0, help="epochs over the training set [1]")
    a("--steps", type=int, default=0, help="steps instead of epochs")
    a("--batch", type=int, default=256, help="records per worker per step [256]")
    a("--dim", type=int, default=8, help="floats per embedding row [8]")
    a("--opt", choices=sorted(TABLE_LR), default="adagrad", help="the rows' rule [adagrad]")
    a("--lr", type=float, default=0.0,
      help="its learning rate [sgd 0.5, adagrad 0.1, adam 0.002, ftrl 0.05]")
    a("--l1", type=float, default=0.0, help="ftrl's L1 [0]")
    a("--l2", type=float, default=0.0, help="ftrl's L2 [0]")
    a("--init-scale", type=float, default=0.05,
      help="rows start uniform in [-X, X) (ftrl: zeros) [0.05]")
    a("--capacity", type=int, default=1 << 21, help="rows the table may hold [2097152]")
    a("--hidden", default="128,64", help="hidden layer widths H1,H2 [128,64]")
    a("--mlp-opt", choices=("sgd", "adam"), default="adam", help="run by psd [adam]")
    a("--mlp-lr", type=float, default=0.0, help="[adam 0.003, sgd 0.1]")
    a("--eval-every", type=int, default=0, help="evaluate every N steps [0: at the end]")
    a("--eval-max", type=int, default=0, help="test records to evaluate [all]")
    a("--eval-batch", type=int, default=4096, help="records per evaluation batch [4096]")
    a("--no-eval", action="store_true", help="no evaluation (benchmarks)")
    a("--metrics", help="JSON lines: progress and evaluations (worker i>0: FILE.w<i>)")
    a("--trace", help="one line per step: step and this worker's batch loss (worker i>0: "
      "FILE.w<i>)")
    a("--warmup", type=int, default=5, help="steps left out of the timing figures [5]")
    a("--threads", type=int, default=1, help="torch intra-op threads [1]")
    a("--seed", type=int, default=1, help="initial values [1]")
    o = p.parse_args(argv)
    o.lr = o.lr or TABLE_LR[o.opt]
    o.mlp_lr = o.mlp_lr or (0.003 if o.mlp_opt == "adam" else 0.1)
    try:
        o.h1, o.h2 = (int(x) for x in o.hidden.split(","))
    except ValueError:
        p.error("--hidden must be H1,H2 (two widths, e.g. 128,64), got %r" % o.hidden)
    return o


# --------------------------------------------------------------------- data

def open_split(path):
    """The records of a ctr_synth file as a read-only structured memmap
    (fields keys[F] uint64, dense[D] float32, label float32)."""
    with open(path, "rb") as f:
        h = f.read(HEADER_FIXED)
    if len(h) < HEADER_FIXED or h[:8] != MAGIC:
        sys.exit("ctr_torch: %s is not a CTR data file (no %s header; make one with ctr_synth)"
                 % (path, MAGIC.decode()))
    version, fields, dense, rb = struct.unpack_from("<4I", h, 8)
    (n,) = struct.unpack_from("<Q", h, 24)
    rec = np.dtype([("keys", "<u8", (fields,)), ("dense", "<f4", (dense,)), ("label", "<f4")])
    start = HEADER_FIXED + 4 * fields
    if version != VERSION or rb != rec.itemsize or os.path.getsize(path) != start + n * rb:
        sys.exit("ctr_torch: %s: bad header or truncated (version %d, %d fields, %d dense, "
                 "%d records of %d bytes)" % (path, version, fields, dense, n, rb))
    return np.memmap(path, dtype=rec, mode="r", offset=start, shape=(n,))


def tensors(recs):
    """Keys (as int64: psd keeps the bits), log(1 + dense) and labels."""
    keys = np.ascontiguousarray(recs["keys"]).view(np.int64)
    dense = np.log1p(np.maximum(recs["dense"], 0, dtype=np.float32))
    return torch.from_numpy(keys), torch.from_numpy(dense), torch.from_numpy(
        np.array(recs["label"]))


class Batches:
    """Step s's global batch is records [s G, s G + G) modulo the largest
    multiple of G in the file (G = workers x batch); worker w takes the
    w-th slice of B, as ctr_worker does."""

    def __init__(self, train, batch, worker, workers):
        self.train, self.batch, self.worker = train, batch, worker
        self.G = batch * workers
        if len(train) < self.G:
            sys.exit("ctr_torch: the training set holds %d records, fewer than one global "
                     "batch (%d workers x %d)" % (len(train), workers, batch))
        self.nbatches = len(train) // self.G

    def __call__(self, step):
        base = (step % self.nbatches) * self.G + self.worker * self.batch
        return self.train[base:base + self.batch]


# -------------------------------------------------------------------- model

class MLP(torch.nn.Module):
    """in -> h1 -> h2 -> 1, ReLU; Glorot-uniform weights, zero biases (the
    initializers ctr_worker asks psd for)."""

    def __init__(self, n_in, h1, h2):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(n_in, h1), torch.nn.Linear(h1, h2)
        self.out = torch.nn.Linear(h2, 1)
        for layer in (self.fc1, self.fc2, self.out):
            torch.nn.init.xavier_uniform_(layer.weight)
            torch.nn.init.zeros_(layer.bias)

    def forward(self, x):
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x))))).squeeze(1)


def table_rule(o):
    """The table's update rule and initializer, as ctr_embed.c sets them."""
    rules = {"sgd": lambda: psd.TableSGD(o.lr), "adagrad": lambda: psd.TableAdagrad(o.lr),
             "adam": lambda: psd.TableAdam(o.lr),
             "ftrl": lambda: psd.TableFTRL(o.lr, l1=o.l1, l2=o.l2)}
    # FTRL starts every row from its own solution: zeros, as usual.
    init = psd.Zeros(seed=o.seed) if o.opt == "ftrl" else \
        psd.Uniform(-o.init_scale, o.init_scale, seed=o.seed)
    return rules[o.opt](), init


class CTRModel(torch.nn.Module):
    """Embeddings (a psd table) -> concatenated with the dense features ->
    the MLP (psd variables, created by the chief from its own values)."""

    def __init__(self, client, o, fields, dense):
        super().__init__()
        torch.manual_seed(o.seed)
        mlp_opt = psd.Adam(o.mlp_lr) if o.mlp_opt == "adam" else psd.SGD(o.mlp_lr)
        self.mlp = psd.torch.DistributedModule(MLP(fields * o.dim + dense, o.h1, o.h2), client,
                                               optimizer=mlp_opt, prefix="mlp.")
        rule, init = table_rule(o)
        self.emb = psd.torch.Embedding(client, "embedding", o.dim, o.capacity, optimizer=rule,
                                       init=init)

    def forward(self, keys, dense):
        return self.head(self.emb(keys), dense)

    def head(self, emb, dense):
        """Logits from the batch's embeddings (batch x fields x dim)."""
        return self.mlp(torch.cat([emb.flatten(1), dense], 1))


# --------------------------------------------------------------- evaluation

def auc(score, label):
    """Mann-Whitney AUC, ties sharing their mean rank (as ctr_auc)."""
    order = np.argsort(score, kind="stable")
    s, pos = score[order], label[order] > 0.5
    _, first, counts = np.unique(s, return_index=True, return_counts=True)
    ranks = np.repeat(first + (counts + 1) / 2.0, counts)
    npos = float(pos.sum())
    nneg = len(s) - npos
    if npos == 0 or nneg == 0:
        return float("nan")
    return float((ranks[pos].sum() - npos * (npos + 1) / 2) / (npos * nneg))


def logloss(prob, label):
    p = np.clip(prob.astype(np.float64), 1e-7, 1 - 1e-7)
    return float(-np.mean(np.where(label > 0.5, np.log(p), np.log1p(-p))))


@torch.no_grad()
def evaluate(model, test, o):
    """AUC and logloss on the test split; the embedding pulls read-only,
    so evaluation creates no rows."""
    n = min(len(test), o.eval_max) if o.eval_max else len(test)
    model.eval()
    probs = []
    for first in range(0, n, o.eval_batch):
        keys, dense, _ = tensors(test[first:min(n, first + o.eval_batch)])
        probs.append(torch.sigmoid(model(keys, dense)).numpy())
    model.train()
    prob, label = np.concatenate(probs), np.asarray(test["label"][:n])
    return auc(prob, label), logloss(prob, label)


# ----------------------------------------------------------------- training

def per_worker(name, w):
    """FILE for worker 0, FILE.w<i> for worker i (one writer per file),
    line-buffered so that a stopped or killed run leaves whole lines."""
    return open(name if w == 0 else "%s.w%d" % (name, w), "w", buffering=1) if name else None


class Trainer:
    """One worker's run: the loop, the timing figures and the output."""

    def __init__(self, client, o):
        self.o, self.client = o, client
        self.w, self.nw = client.worker_index, client.num_workers
        train = open_split(os.path.join(o.data, "train.bin"))
        self.fields, self.dense = train.dtype["keys"].shape[0], train.dtype["dense"].shape[0]
        self.batches = Batches(train, o.batch, self.w, self.nw)
        self.total = o.steps or math.ceil(o.epochs * len(train) / self.batches.G)
        self.evaluating = self.w == 0 and not o.no_eval
        self.test = open_split(os.path.join(o.data, "test.bin")) if self.evaluating else None
        torch.set_num_threads(o.threads)
        self.model = CTRModel(client, o, self.fields, self.dense)
        self.metrics, self.trace = per_worker(o.metrics, self.w), per_worker(o.trace, self.w)
        self.times = []  # (step, pull, compute, push) ms of each step after the warm-up
        self.unique = []  # distinct keys of sampled batches
        self.loss = self.auc = self.logloss = float("nan")
        self.losses = []

    def step(self, step):
        """Forward, backward, the psd step; the new step."""
        t0 = time.perf_counter()
        keys, dense, label = tensors(self.batches(step))
        t1 = time.perf_counter()
        emb = self.model.emb(keys)  # the pull of the batch's rows
        t2 = time.perf_counter()
        loss = F.binary_cross_entropy_with_logits(self.model.head(emb, dense), label)
        loss.backward()  # MLP buckets go out as they are ready; rows' gradients staged
        self.loss = loss.item()
        if self.trace:  # before the push: a stopped run's last step is in it too
            self.trace.write("%d %.9g\n" % (step, self.loss))
        t3 = time.perf_counter()
        new = self.model.mlp.step()  # the rest of the push, the table's, then the pull
        t4 = time.perf_counter()
        if step >= self.first + self.o.warmup:
            self.times.append([(t4 - t0) * 1e3, (t2 - t1) * 1e3,
                               (t1 - t0 + t3 - t2) * 1e3, (t4 - t3) * 1e3])
        if step % 8 == 0:  # sampled: counting every step would cost time
            self.unique.append(len(np.unique(keys.numpy())))
        self.losses.append(self.loss)
        return new

    def train(self):
        step = self.first = self.report_step = self.model.mlp.start()
        if step:
            print("ctr_torch %d: resuming at step %d" % (self.w, step), file=sys.stderr)
        self.t0 = self.last = time.perf_counter()
        while step < self.total:
            step = self.step(step)
            ev = self.evaluating and self.o.eval_every and step % self.o.eval_every == 0 \
                and step < self.total
            if ev:
                self.auc, self.logloss = evaluate(self.model, self.test, self.o)
            if time.perf_counter() - self.last >= 1.0 or ev:
                self.report(step, ev)
        self.wall = time.perf_counter() - self.t0
        self.steps = step - self.first
        if self.evaluating:
            self.auc, self.logloss = evaluate(self.model, self.test, self.o)
            print("w0 step %d test logloss %.4f auc %.4f" % (step, self.logloss, self.auc),
                  file=sys.stderr)
        return step

    def report(self, step, evaluated):
        """A progress line on stderr and in --metrics, ctr_worker's fields."""
        now = time.perf_counter()
        dt, steps = now - self.last, step - self.report_step
        uniq = float(np.mean(self.unique)) if self.unique else 0.0
        loss = float(np.mean(self.losses)) if self.losses else float("nan")
        line = {"worker": self.w, "wall_s": round(now - self.t0, 3), "step": step,
                "loss": round(loss, 5),
                "samples_per_sec": round(steps * self.o.batch * self.nw / dt, 1),
                "keys_per_step": self.o.batch * self.fields, "unique_keys_per_step": round(uniq),
                "rows_per_sec": round(uniq * steps / dt)}
        if evaluated:
            line.update(auc=round(self.auc, 5), logloss=round(self.logloss, 5))
        print("w%d step %d loss %.4f samples/s %.0f%s" % (
            self.w, step, loss, line["samples_per_sec"],
            " test logloss %.4f auc %.4f" % (self.logloss, self.auc) if evaluated else ""),
            file=sys.stderr)
        if self.metrics:
            self.metrics.write(json.dumps(line) + "\n")
            self.metrics.flush()
        self.last, self.report_step, self.losses = now, step, []

    def summary(self, step):
        """The final JSON line: evaluation (the chief's), throughput and the
        medians of the timed steps (pull: the embedding's forward; compute:
        the batch, the MLP and backward, bucket pushes included; push: the
        psd step)."""
        t = np.array(self.times).reshape(-1, 4)
        med = np.median(t, axis=0) if len(t) else np.zeros(4)
        lo, hi = (t[:, 0].min(), t[:, 0].max()) if len(t) else (0, 0)
        uniq = float(np.mean(self.unique)) if self.unique else 0.0
        rate = self.steps / self.wall if self.wall > 0 else 0.0
        ev = self.evaluating

        def ms(x):
            return round(float(x), 3)

        return {"auc": round(self.auc, 5) if ev else None,
                "logloss": round(self.logloss, 5) if ev else None, "worker": self.w,
                "workers": self.nw, "steps": step, "batch": self.o.batch,
                "loss": round(self.loss, 5), "embed": "table", "wall_s": ms(self.wall),
                "samples_per_sec": round(rate * self.o.batch * self.nw, 1),
                "steps_per_sec": round(rate, 2), "step_ms": ms(med[0]), "step_ms_min": ms(lo),
                "step_ms_max": ms(hi), "pull_ms": ms(med[1]), "compute_ms": ms(med[2]),
                "push_ms": ms(med[3]), "timed_steps": len(t),
                "keys_per_step": self.o.batch * self.fields, "unique_keys_per_step": round(uniq),
                "rows_per_sec": round(uniq * 1e3 / med[0]) if med[0] > 0 else 0}

    def close(self):
        for f in (self.metrics, self.trace):
            if f:
                f.close()


def main(argv=None):
    o = parse_args(argv)
    try:
        client = psd.Client.from_env()
    except psd.Error as e:
        sys.exit("ctr_torch: %s" % e)
    t = Trainer(client, o)
    try:
        step = t.train()
    except psd.Stopped as e:  # after a checkpoint: the same command resumes
        print("ctr_torch %d: %s" % (t.w, e), file=sys.stderr)
        client.finish()
        t.close()
        return psd.EXIT_STOPPED
    client.finish()
    line = json.dumps(t.summary(step))
    print(line, flush=True)
    if t.metrics:
        t.metrics.write(line + "\n")
    t.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
