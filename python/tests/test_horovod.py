"""psd.horovod (Horovod's PyTorch API on psd) through psrun --local with a
real psd: a script written as Horovod's examples are, changed only in its
import line, against one process over the global batch; the other calls
against values computed on each rank."""
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

from test_c10d import HERE, psrun

sys.path.insert(0, HERE)
import hvd_worker as hw  # noqa: E402

STEPS = 6


def one_process(world):
    """The same training in one process: each step's gradient is the mean
    of the ranks' (each rank's micro-batches through BatchNorm alone, as
    they are on the ranks)."""
    dataset = hw.data()
    parts = [list(DistributedSampler(dataset, num_replicas=world, rank=r, shuffle=False))
             for r in range(world)]
    model = hw.net()
    opt = hw.optimizer(model, world)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for r in range(world):
            idx = parts[r][step * hw.B:(step + 1) * hw.B]
            x, y = dataset[idx]
            for xs, ys in zip(x.chunk(hw.ACCUM), y.chunk(hw.ACCUM)):
                loss = F.cross_entropy(model(xs), ys) / hw.ACCUM / world
                loss.backward()
                total += float(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        losses.append(total)
    return dict(model.named_parameters()), losses


def test_horovod_script_matches_one_process(tmpdir_short):
    out = os.path.join(tmpdir_short, "hvd.pt")
    p = psrun(2, os.path.join(HERE, "hvd_worker.py"), "train", out, str(STEPS))
    assert p.returncode == 0, p.stdout + p.stderr
    got = torch.load(out)
    want, losses = one_process(2)
    assert len(got["losses"]) == STEPS
    for a, b in zip(got["losses"], losses):
        assert abs(a - b) < 1e-5, (got["losses"], losses)
    start = dict(hw.net().named_parameters())
    for name, p_ in want.items():
        assert torch.allclose(got["params"][name], p_.detach(), atol=1e-5, rtol=0), name
        assert not torch.allclose(p_, start[name], atol=1e-3), name + " did not train"


def test_fp16_compression_trains_close(tmpdir_short):
    out = os.path.join(tmpdir_short, "hvd16.pt")
    p = psrun(2, os.path.join(HERE, "hvd_worker.py"), "train", out, str(STEPS), "fp16")
    assert p.returncode == 0, p.stdout + p.stderr
    got = torch.load(out)
    want, _ = one_process(2)
    for name, p_ in want.items():
        assert torch.allclose(got["params"][name], p_.detach(), atol=2e-2, rtol=0), name


def test_api_calls():
    p = psrun(3, os.path.join(HERE, "hvd_worker.py"), "api")
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(3):
        assert "ok rank %d" % r in p.stdout, p.stdout + p.stderr
