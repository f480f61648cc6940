"""psd.torch against real psd processes and real worker processes: two
workers x b equal one worker x 2b equal plain local PyTorch; buckets
pushed during backward; mirrored (float64) parameters; the sparse
Embedding; stop and resume."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import hosts

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "torch_worker.py")
sys.path.insert(0, HERE)
import torch_worker  # noqa: E402


def run_workers(ps, nw, b, steps, tmp, *opts, expect=0):
    procs, outs = [], []
    for w in range(nw):
        out = os.path.join(tmp, "w%d.%d.npz" % (w, nw))
        procs.append(subprocess.Popen([sys.executable, WORKER, ",".join(hosts(ps)), str(w),
                                       str(nw), str(b), str(steps), out] + list(opts),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outs.append(out)
    for p in procs:
        text = p.communicate(timeout=120)[0].decode()
        assert p.returncode == expect, text
    return [dict(np.load(o)) for o in outs]


def local_reference(steps, dtype=torch.float32, torchopt=False):
    """The same training with torch.optim.SGD in one process, batch 2b=64
    (torchopt: torch_worker.torch_training's AdamW, StepLR and clipping)."""
    net = torch_worker.Net(None, dtype)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    update = opt.step
    if torchopt:
        opt, update = torch_worker.torch_training(net)
    for step in range(steps):
        x, y, ids = torch_worker.batch(step, 0, 64, dtype)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x, ids), y).backward()
        update()
    return {k: v.detach().double().numpy() for k, v in net.named_parameters()}


def assert_close(a, b, keys, tol=1e-5):
    for k in keys:
        np.testing.assert_allclose(a[k], b[k], atol=tol, rtol=0, err_msg=k)


@pytest.mark.parametrize("opts", [("bucket=256",), ("overlap=0",)])
def test_two_workers_equal_one_and_local_torch(start_psd, tmpdir_short, opts):
    ref = local_reference(8)
    one = run_workers(start_psd(1), 1, 64, 8, tmpdir_short, *opts)[0]
    two = run_workers(start_psd(2), 2, 32, 8, tmpdir_short, *opts)
    assert one["step"] == 8 and two[0]["step"] == 8
    assert_close(one, ref, ref.keys())
    assert_close(two[0], one, ref.keys())
    assert_close(two[1], one, ref.keys())


@pytest.mark.parametrize("opts", [("bucket=256",), ("overlap=0",)])
def test_torch_optimizer_two_workers_equal_one_process(start_psd, tmpdir_short, opts):
    """A torch.optim optimizer on the workers (AdamW, two parameter groups,
    StepLR, clip_grad_norm_ after step()): 2 workers x 32 give one
    process's parameters over the batch of 64."""
    ref = local_reference(8, torchopt=True)
    two = run_workers(start_psd(1), 2, 32, 8, tmpdir_short, "torchopt=1", *opts)
    assert two[0]["step"] == 8
    assert_close(two[0], ref, ref.keys())
    assert_close(two[1], ref, ref.keys())
    moved = local_reference(0, torchopt=True)
    assert max(np.abs(ref[k] - moved[k]).max() for k in ref) > 1e-3  # it trained


def test_mirrored_float64_parameters(start_psd, tmpdir_short):
    ref = local_reference(5, torch.float64)
    two = run_workers(start_psd(1), 2, 32, 5, tmpdir_short, "float64=1")
    assert_close(two[0], ref, ref.keys(), tol=1e-4)  # float32 on the servers


def test_embedding_two_workers_equal_one(start_psd, tmpdir_short):
    one = run_workers(start_psd(1), 1, 64, 6, tmpdir_short, "embed=1")[0]
    two = run_workers(start_psd(2), 2, 32, 6, tmpdir_short, "embed=1")
    assert_close(two[0], one, [k for k in one if k != "step"])
    initial = torch_worker.Net  # rows moved away from their initial values
    assert initial and np.abs(one["emb_rows"]).sum() > 0


def test_stop_and_resume(start_psd, tmpdir_short):
    ckpt = os.path.join(tmpdir_short, "ckpt")
    os.mkdir(ckpt, 0o700)
    ps = start_psd(1, "--checkpoint-dir", ckpt)
    stopped = run_workers(ps, 2, 32, 30, tmpdir_short, "stop_at=3", expect=75)
    assert ps[0].wait() == 75
    # Every worker names the same stop step. Training goes on while the
    # file is written, so a worker's last step is that one or later (or the
    # one before, where its pull of it raced the stop).
    stop_step = int(stopped[0]["stop_step"])
    assert 3 <= stop_step < 30 and int(stopped[1]["stop_step"]) == stop_step
    assert all(int(s["step"]) >= stop_step - 1 for s in stopped), stopped
    ps = start_psd(1, "--checkpoint-dir", ckpt)
    resumed = run_workers(ps, 2, 32, 30, tmpdir_short)
    ref = run_workers(start_psd(1), 2, 32, 30, tmpdir_short)
    keys = [k for k in ref[0] if k != "step"]
    assert_close(resumed[0], ref[0], keys, tol=0)  # bit-identical


def local_accumulated(steps):
    """Local PyTorch with two backward passes per step (gradients summed)."""
    net = torch_worker.Net(None)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y, ids = torch_worker.batch(step, 0, 64, torch.float32)
        opt.zero_grad()
        for lo, hi in ((0, 32), (32, 64)):
            torch.nn.functional.cross_entropy(net(x[lo:hi], ids[lo:hi]), y[lo:hi]).backward()
        opt.step()
    return {k: v.detach().double().numpy() for k, v in net.named_parameters()}


def test_no_sync_accumulates_micro_batches(start_psd, tmpdir_short):
    ref = local_accumulated(5)
    one = run_workers(start_psd(1), 1, 64, 5, tmpdir_short, "accum=1", "bucket=256")[0]
    assert_close(one, ref, ref.keys())


def test_second_backward_without_no_sync_is_an_error(start_psd, tmpdir_short):
    ps = start_psd(1)
    out = os.path.join(tmpdir_short, "x.npz")
    p = subprocess.run([sys.executable, WORKER, ",".join(hosts(ps)), "0", "1", "8", "3", out,
                        "twice=1"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "no_sync" in p.stderr, p.stderr


def test_batchnorm_buffers_follow_the_chief(start_psd, tmpdir_short):
    two = run_workers(start_psd(1), 2, 32, 6, tmpdir_short, "bn=1")
    for k in ("buf.bn.running_mean", "buf.bn.running_var"):
        assert np.abs(two[0][k]).sum() > 0, k
        np.testing.assert_array_equal(two[1][k], two[0][k], err_msg=k)
    assert_close(two[1], two[0], [k for k in two[0] if not k.startswith("buf.")], tol=0)


def test_module_memory_flat_over_3k_steps(start_psd):
    """DistributedModule and Embedding hold nothing per step: resident
    memory after 3,000 steps within 2 MiB of where it was after 500."""
    import gc

    import psd
    import psd.torch
    from test_client import rss_kib
    ps = start_psd(1)
    with psd.Client(hosts=hosts(ps), telemetry="off") as c:
        net = torch_worker.Net(c)
        model = psd.torch.DistributedModule(net, c, optimizer=psd.SGD(lr=0.01), bucket_bytes=512)
        step = model.start()
        x, y, ids = torch_worker.batch(0, 0, 16, torch.float32)
        for i in range(3000):
            if i == 500:
                gc.collect()
                base = rss_kib()
            torch.nn.functional.cross_entropy(model(x, ids), y).backward()
            step = model.step()
        gc.collect()
        grown = rss_kib() - base
        assert step == 3000 and grown < 2048, "grew %d KiB over 2500 steps" % grown


def test_embedding_rejects_float_ids(start_psd):
    """Float ids were truncated to int64 silently (1.7 read row 1), where
    Table.pull and torch.nn.Embedding refuse them."""
    import psd
    import psd.torch
    ps = start_psd(1)
    c = psd.Client(hosts=hosts(ps), telemetry="off")
    emb = psd.torch.Embedding(c, "e", 4, 100, init=psd.Constant(1.0))
    for ids in (torch.tensor([1.7, 2.2]), torch.tensor([True])):
        with pytest.raises(TypeError, match="integer"):
            emb(ids)
    assert emb(torch.tensor([[1, 2]], dtype=torch.int32)).shape == (1, 2, 4)
    c.finish()
    c.close()


# --------------------------------------------- what must not pass silently

def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _loss(model):
    g = torch.Generator().manual_seed(1)
    return model(torch.randn(8, 4, generator=g)).pow(2).mean()


def test_torch_optimizer_over_other_parameters_is_refused(start_psd):
    import psd
    import psd.torch
    with psd.Client(hosts=hosts(start_psd(1)), telemetry="off") as c:
        net = _tiny()
        with pytest.raises(ValueError, match="not one of the module's"):
            psd.torch.DistributedModule(net, c, optimizer=torch.optim.AdamW(_tiny().parameters()))


def test_second_module_on_one_client_is_refused(start_psd):
    import psd
    import psd.torch
    with psd.Client(hosts=hosts(start_psd(1)), telemetry="off") as c:
        psd.torch.DistributedModule(_tiny(), c, optimizer=psd.SGD(lr=0.1))
        with pytest.raises(ValueError, match="already has a DistributedModule"):
            psd.torch.DistributedModule(_tiny(), c, optimizer=psd.SGD(lr=0.1), prefix="b.")


def test_torch_optimizer_left_in_the_loop_raises(start_psd):
    """Its step() changed the parameters, which the servers' values would
    have replaced: the next model.step() raises before pushing."""
    import psd
    import psd.torch
    with psd.Client(hosts=hosts(start_psd(1)), telemetry="off") as c:
        net = _tiny()
        model = psd.torch.DistributedModule(net, c, optimizer=psd.SGD(lr=0.1))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        model.start()
        _loss(model).backward()
        assert model.step() == 1  # no torch optimizer yet: fine
        _loss(model).backward()
        opt.step()
        with pytest.raises(RuntimeError, match="changed outside psd"):
            model.step()


@pytest.mark.parametrize("overlap", [True, False])
def test_clipping_after_backward(start_psd, overlap):
    """With overlap (buckets pushed during backward) clipping afterwards
    would be lost: step() raises and says to pass overlap=False; with
    overlap=False the clipped gradient is the one the servers apply."""
    import psd
    import psd.torch
    with psd.Client(hosts=hosts(start_psd(1)), telemetry="off") as c:
        net = _tiny()
        model = psd.torch.DistributedModule(net, c, optimizer=psd.SGD(lr=1.0), overlap=overlap)
        model.start()
        before = [p.detach().clone() for p in net.parameters()]
        _loss(model).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)
        if overlap:
            with pytest.raises(RuntimeError, match="overlap=False"):
                model.step()
            return
        model.step()
        moved = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(net.parameters(), before)])
        assert abs(float(moved.norm()) - 1e-3) < 1e-6, float(moved.norm())


def test_frozen_parameters_follow_the_chief(start_psd):
    import threading

    import psd
    import psd.torch
    ps = start_psd(1)
    got, errs = {}, []

    def worker(w):
        try:
            with psd.Client(hosts=hosts(ps), worker_index=w, num_workers=2,
                            telemetry="off") as c:
                net = _tiny()
                net[0].weight.requires_grad_(False)
                with torch.no_grad():
                    net[0].weight.fill_(1.0 + w)  # each worker's own frozen values
                model = psd.torch.DistributedModule(net, c, optimizer=psd.SGD(lr=0.1))
                model.start()
                _loss(model).backward()
                model.step()
                got[w] = net[0].weight.detach().clone()
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=worker, args=(w,)) for w in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errs, errs
    assert torch.equal(got[0], torch.ones(3, 4)) and torch.equal(got[1], got[0])
