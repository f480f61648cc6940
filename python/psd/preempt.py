"""psd.torch.Checkpoint: a DistributedDataParallel script on the psd
backend stops on Slurm's preemption signal after saving its state, and the
same command resumes it bit-identically.

psd's servers hold no state for such a job (its variables are mean
variables, whose value starts afresh every step): the state is the
workers' model, optimizer, scheduler, random generators and place in the
data. One line after creating them,

    ckpt = psd.torch.Checkpoint(ddp, optimizer, scheduler, loader)

restores that state when the job is resumed, and from then on:
- SIGTERM or SIGUSR1 (Slurm's preemption or walltime signal, forwarded by
  psrun) sets a flag in the rank it reaches;
- after each optimizer step every rank votes (a one-float mean through the
  servers, overlapped with the next step): every rank gets the same mean,
  so every rank knows at the same step whether some rank was asked to
  stop;
- at the next training forward after a yes (after scheduler.step() and
  the next batch's loading, before any random draw of the forward), every
  rank saves its state, rank 0 marks the checkpoint complete once all
  have, and the process exits 75 (psd.EXIT_STOPPED); psd exits 75 too.

That line is all a script over epochs and its loader needs: resumed, the
loader (a DataLoader over a DistributedSampler, or any sampler) yields
nothing in the epochs the stopped run had finished and skips the batches
it had consumed in the epoch it stopped in; the model's state is loaded
at once, and the optimizer's, the scheduler's and the random generators'
at the first training batch, so whatever the skipped epochs' own code did
(scheduler.step() once per epoch) is replaced by the saved state. A
script may instead start its loop at ckpt.epoch (and count its steps from
ckpt.step), which also spares the skipped epochs' evaluation. Files:
DIR/torch/step-<step>/rank-<r>.pt and `complete`, DIR being psrun's
--checkpoint-dir (PS_CHECKPOINT_DIR).
"""
import functools
import os
import random
import secrets
import signal
import stat
import sys
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["Checkpoint"]

from . import EXIT_STOPPED  # noqa: E402  (psclient.h's PS_EXIT_STOPPED)
SUBDIR = "torch"  # inside psrun's --checkpoint-dir, beside psd's step-* files
_WHOLE = -1  # _skip_for: every batch of the epoch
FORMAT = 1
REJOIN_FORMAT = 1  # what a waiting rank sends a restarted one (psd.rejoin)


def _private_dir(path: str) -> None:
    """Creates path (0700) or checks that it is this user's own directory
    that nobody else may write: torch.load unpickles what it reads, so a
    file another user could plant there would run their code here."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError("psd.torch.Checkpoint: %s is not a directory (a symbolic link?); "
                           "refusing to keep state there" % path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise RuntimeError("psd.torch.Checkpoint: %s is owned by uid %d with mode %04o; it "
                           "must be this user's (uid %d) and writable by nobody else"
                           % (path, st.st_uid, st.st_mode & 0o7777, os.geteuid()))


def _atomic_write(path: str, write) -> None:
    """write(fileobj) into a new 0600 file beside path, synced, then renamed
    over path: a reader never sees half a file."""
    d = os.path.dirname(path)
    tmp = os.path.join(d, ".%s.%s" % (os.path.basename(path), secrets.token_hex(8)))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _rng_state():
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}


def _set_rng_state(s) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if s.get("cuda") is not None:
        torch.cuda.set_rng_state_all(s["cuda"])


def _psd_group():
    from .c10d import ProcessGroupPsd
    pg = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    if not isinstance(pg, ProcessGroupPsd):
        raise RuntimeError("psd.torch.Checkpoint needs torch.distributed's default group on the "
                           "psd backend: call init_process_group(\"psd\") first (%s)"
                           % ("it is %r" % dist.get_backend() if pg else "none yet"))
    return pg


class Checkpoint:
    """Saves a DDP job's state when it is asked to stop and restores it when
    the job runs again (see the module's doc). model: the DDP module (or
    the module it wraps, if DDP wraps it later); optimizer, scheduler: any
    torch.optim ones (scheduler may be None); loader: the training
    DataLoader whose place in the epoch is kept (None: the script skips to
    ckpt.step itself); directory: instead of psrun's --checkpoint-dir.
    Attributes: step (optimizer steps done; 0 on a fresh run), epoch (the
    sampler's epoch at the stop), resumed (bool)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler=None, loader: Optional[torch.utils.data.DataLoader] = None,
                 directory: Optional[str] = None):
        self._pg = _psd_group()
        self.rank, self.world = self._pg.rank(), self._pg.size()
        self.step, self.epoch, self.resumed, self.rejoined = 0, 0, False, False
        self._ddp, self._module = model, getattr(model, "module", model)
        self._opt, self._sched, self._loader = optimizer, scheduler, loader
        self._skip = None  # (epoch, batches) the resumed loader skips
        self._rng = None  # restored at the first training forward
        self._pending = None  # (optimizer, scheduler) states, restored then too
        self._epoch_now, self._batches = 0, 0
        self._asked, self._stopping, self._vote = False, False, None
        self._in_step, self._snap, self._catchup = False, None, False
        replicas = os.environ.get("PS_REPLICAS_TO_AGGREGATE", "")
        self._backups = replicas.isdigit() and 0 < int(replicas) < self.world
        directory = directory or os.environ.get("PS_CHECKPOINT_DIR")
        self._root = os.path.join(directory, SUBDIR) if directory else None
        if self._root is not None:
            _private_dir(directory)
            _private_dir(self._root)
        if self._pg.prejoin:
            self._rejoin()
        elif self._root is not None:
            self._load()
        elif self.rank == 0:
            print("psd.torch.Checkpoint: no checkpoint directory (psrun --checkpoint-dir "
                  "DIR): SIGTERM ends this job without saving it", file=sys.stderr, flush=True)
        if self._root is not None:
            self._on_signals()
        self._pg.serve_rejoins(self._rejoin_state)
        self._wrap_optimizer()
        model.register_forward_pre_hook(self._before_forward)
        if loader is not None:
            self._wrap_loader(loader)

    # -- restore
    def _complete(self):
        """Step directories that rank 0 marked complete, newest first."""
        out = []
        for name in os.listdir(self._root):
            if name.startswith("step-") and name[5:].isdigit() and \
                    os.path.exists(os.path.join(self._root, name, "complete")):
                out.append((int(name[5:]), name))
        return [os.path.join(self._root, n) for _, n in sorted(out, reverse=True)]

    def _load(self) -> None:
        found = self._complete()
        if not found:
            return
        d = found[0]
        path = os.path.join(d, "rank-%d.pt" % self.rank)
        if self.rank != 0 and self._backups and not os.path.exists(path):
            # A backup rank that had died: the others' place in the data is
            # its place too (the same step), its random draws start afresh.
            print("psd.torch.Checkpoint: rank %d has no state of its own in %s (it had died and "
                  "the job went on with backup workers): it resumes from rank 0's place in "
                  "the data with fresh random generators" % (self.rank, d), file=sys.stderr,
                  flush=True)
            path = os.path.join(d, "rank-0.pt")
        mine = torch.load(path, map_location="cpu")
        if mine["rank"] != self.rank:
            mine["rng"] = None
        if mine.get("format") != FORMAT or mine.get("world") != self.world:
            raise RuntimeError(
                "psd.torch.Checkpoint: %s was saved by a job of %s ranks (format %s); this "
                "one has %d: resume with the same number of workers, or move %s aside to "
                "start afresh" % (d, mine.get("world"), mine.get("format"), self.world,
                                  self._root))
        chief = mine if self.rank == 0 else torch.load(os.path.join(d, "rank-0.pt"),
                                                       map_location="cpu")
        self._module.load_state_dict(chief["model"])
        if self._sched is not None and chief["scheduler"] is None:
            raise RuntimeError("psd.torch.Checkpoint: %s has no scheduler state but a "
                               "scheduler was given" % d)
        self._opt.load_state_dict(chief["optimizer"])  # now, and again at the first batch
        self._pending = (chief["optimizer"], chief["scheduler"])
        self.step, self.epoch, self.resumed = mine["step"], mine["epoch"], True
        self._opt._step_count = 1  # the skipped epochs' scheduler.step() is not early
        self._skip = (mine["epoch"], mine["batches"])
        self._rng = mine["rng"]  # None: fresh
        if self.rank == 0:
            print("psd.torch.Checkpoint: resuming at step %d (epoch %d) from %s"
                  % (self.step, self.epoch, d), file=sys.stderr, flush=True)

    # -- the stop
    def _on_signals(self) -> None:
        previous = {}

        def asked(signum, frame):
            self._asked = True
            if signum in previous:  # the script's own handler runs too
                previous[signum](signum, frame)

        for s in (signal.SIGTERM, signal.SIGUSR1):
            old = signal.signal(s, asked)  # raises outside the main thread
            if callable(old):
                previous[s] = old

    def _wrap_optimizer(self) -> None:
        inner = self._opt.step

        @functools.wraps(inner)  # keeps lr_scheduler's step counter mark
        def step(*args, **kwargs):
            out = inner(*args, **kwargs)
            self._after_step()
            return out

        self._opt.step = step

    def _after_step(self) -> None:
        """Every rank runs the same steps, so every rank waits here for the
        same vote (the one sent after the step before) and gets the same
        mean: the decision to stop is the same on every rank."""
        self.step += 1
        self._in_step = False
        if self._vote is not None:
            vote, self._vote = self._vote, None
            if vote.wait() > 0:
                self._stopping = True
        if self._catchup:  # the step this rank rejoined in is done
            self._catchup = False
            self._pg.end_catchup()
        if not self._stopping and self._root is not None:
            self._vote = self._pg.vote(self._asked)

    def _before_forward(self, module, inputs) -> None:
        if not module.training:
            return
        if not self._in_step:  # a step starts: what a restarted rank would redo it from
            self._in_step = True
            self._snap = (self.step, self._epoch_now, self._batches, self._pg.engine.counters(),
                          self._vote is not None)
        if self._rng is not None:  # the resumed run's first step: draws as before
            _set_rng_state(self._rng)
            self._rng = None
        if self._pending is not None:  # over what skipped epochs' code did
            opt, sched = self._pending
            self._pending = None
            self._opt.load_state_dict(opt)
            if self._sched is not None:
                self._sched.load_state_dict(sched)
        if self._stopping:
            self._save_and_exit()
        self._batches += 1  # this forward's batch is consumed

    def _save_and_exit(self) -> None:
        d = os.path.join(self._root, "step-%012d" % self.step)
        _private_dir(d)
        state = {"format": FORMAT, "world": self.world, "rank": self.rank, "step": self.step,
                 "epoch": self._epoch_now, "batches": self._batches, "rng": _rng_state()}
        if self.rank == 0:
            state["model"] = self._module.state_dict()
            state["optimizer"] = self._opt.state_dict()
            state["scheduler"] = self._sched.state_dict() if self._sched is not None else None
        _atomic_write(os.path.join(d, "rank-%d.pt" % self.rank), lambda f: torch.save(state, f))
        if self._backups:  # the job's N - K ranks' files are on disk (a dead backup has none)
            self._pg.vote(True).wait()
        else:
            dist.barrier()  # every rank's file is on disk
        if self.rank == 0:
            _atomic_write(os.path.join(d, "complete"),
                          lambda f: f.write(b"%d ranks\n" % self.world))
            for old in self._complete()[1:]:
                for n in os.listdir(old):
                    os.unlink(os.path.join(old, n))
                os.rmdir(old)
            print("psd.torch.Checkpoint: stopped on request after step %d; its state is in %s; "
                  "run the same command again to resume (exit %d)"
                  % (self.step, d, EXIT_STOPPED), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_STOPPED)

    # -- a restarted rank rejoins (psd.rejoin)
    def _rejoin_state(self, who: int):
        """(ok, bytes) for restarted rank ``who``, in the collective thread
        while this rank waits for it: the state the step it waits in
        started from, or why there is none."""
        from . import rejoin
        snap = self._snap
        if not self._in_step or snap is None:
            return False, (
                "psd.torch.Checkpoint: restarted rank %d cannot rejoin: rank %d waits for it "
                "in a collective outside a training step (between optimizer.step() and the "
                "next training forward: an evaluation, a logging all_reduce, a barrier), which "
                "a restarted rank cannot redo. Stop the job and run it again (with a "
                "checkpoint directory it resumes from its last stop)" % (who, self.rank)
            ).encode()
        step, epoch, batches, counters, voted = snap
        state = {"format": REJOIN_FORMAT, "world": self.world, "from": self.rank,
                 "step": step, "epoch": epoch, "batches": batches, "counters": counters,
                 "voted": voted, "model": self._module.state_dict(),
                 "optimizer": self._opt.state_dict(),
                 "scheduler": self._sched.state_dict() if self._sched is not None else None,
                 "rebuilt": list(self._pg.rebuilt)}
        return True, rejoin.dumps(state)

    def _rejoin(self) -> None:
        """This rank was restarted: takes the others' state and joins them
        in the step they wait in."""
        from . import rejoin
        print("psd.torch.Checkpoint: rank %d was restarted; it asks the others for their "
              "state" % self.rank, file=sys.stderr, flush=True)
        st = rejoin.loads(self._pg.request_rejoin())
        if st.get("format") != REJOIN_FORMAT or st.get("world") != self.world:
            raise rejoin.RejoinRefused(
                "psd.torch.Checkpoint: rank %d's state (format %s, %s ranks) does not fit "
                "this rank (format %d, %d ranks): is every rank running the same psd?"
                % (st.get("from", -1), st.get("format"), st.get("world"), REJOIN_FORMAT,
                   self.world))
        self._module.load_state_dict(st["model"])
        self._opt.load_state_dict(st["optimizer"])  # now, and again at the first batch
        self._pending = (st["optimizer"], st["scheduler"])
        self.step, self.epoch, self.rejoined = st["step"], st["epoch"], True
        self._opt._step_count = 1  # the skipped epochs' scheduler.step() is not early
        self._skip = (st["epoch"], st["batches"])
        counters, rebuilt = dict(st["counters"]), st["rebuilt"]
        build = getattr(self._ddp, "_build_params_for_reducer", None)
        numels = [p.numel() for p in build()[0]] if build is not None else []
        layout = rejoin.rebuilt_layout(rebuilt, numels) if rebuilt else None
        if rebuilt and layout is None:
            raise rejoin.RejoinRefused(
                "psd.torch.Checkpoint: restarted rank %d cannot rejoin: rank %d's DDP bucket "
                "layout does not describe this rank's parameters (%d): is the model the same "
                "on every rank?" % (self.rank, st["from"], len(numels)))
        for key, seq, _v in rebuilt:
            if seq >= counters.get(key, 0):  # made in the step this rank redoes
                counters[key] = counters.get(key, 0) + 1
        if st["voted"]:  # the vote sent before that step: this rank sends it again
            counters["vote/1"] -= 1
        self._pg.join(counters, layout, numels, [v for _k, _s, v in rebuilt] if layout else [])
        self._catchup = True
        if st["voted"]:
            self._vote = self._pg.vote(False)
        print("psd.torch.Checkpoint: rank %d rejoined at step %d (epoch %d) with rank %d's "
              "state" % (self.rank, self.step, self.epoch, st["from"]), file=sys.stderr,
              flush=True)

    # -- the data
    def _wrap_loader(self, loader) -> None:
        bs = loader.batch_sampler
        if bs is None:
            raise ValueError("psd.torch.Checkpoint: the loader has no batch sampler "
                             "(batch_size=None); pass loader=None and skip to ckpt.step in "
                             "the script")
        base, cp = type(bs), self
        passes = [0]  # epochs of a sampler without set_epoch: the loader's passes

        def __iter__(self):
            epoch = getattr(getattr(self, "sampler", None), "epoch", None)
            if epoch is None:
                epoch = passes[0]
            passes[0] += 1
            cp._epoch_now, cp._batches = epoch, 0
            skip = cp._skip_for(epoch)
            if skip == _WHOLE:
                return  # an epoch the stopped run had finished
            for i, b in enumerate(base.__iter__(self)):
                if i >= skip:
                    yield b

        bs.__class__ = type("Resumable" + base.__name__, (base,), {"__iter__": __iter__})

    def _skip_for(self, epoch: int) -> int:
        """Batches of this epoch the resumed loader skips (all of an epoch
        the stopped run had finished)."""
        if self._skip is None:
            return 0
        want, n = self._skip
        if epoch < want:
            return _WHOLE
        self._skip = None
        if epoch > want:
            raise RuntimeError(
                "psd.torch.Checkpoint: the job resumes at step %d in epoch %d, but the loader "
                "starts epoch %d: start the loop at epoch 0 or at ckpt.epoch, and call "
                "sampler.set_epoch(epoch) each epoch" % (self.step, want, epoch))
        return n
