"""The torch.distributed backend "psd" (psd/c10d.py) through psrun
--local with real psd servers: every collective against values computed
on each rank, unmodified DDP against gloo and against one process with
the global batch, and the failures that must say what to do."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import BIN, ROOT

HERE = os.path.dirname(os.path.abspath(__file__))
EX = os.path.join(ROOT, "examples", "python")
PY = "/usr/bin/python3"
sys.path.insert(0, HERE)
import c10d_worker as cw  # noqa: E402


def psrun(workers, *cmd, timeout=240, extra=()):
    env = dict(os.environ)
    env.pop("PSD_LIBPSCLIENT", None)  # the checkout's package finds its build/lib
    return subprocess.run([os.path.join(BIN, "psrun"), "--local", "-n", str(workers + 1),
                           "--ps", "1"] + list(extra) + ["--", PY] + list(cmd),
                          capture_output=True, text=True, timeout=timeout, env=env)


def gloo(workers, *cmd, timeout=240):
    """torchrun's contract by hand (Debian's torchrun fails on Python 3.12)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r in range(workers):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(workers), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(workers), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([PY] + list(cmd), env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, o + e
    return "".join(o for o, _ in outs)


def records(out):
    got = []
    for line in out.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[w") else line
        if line.startswith("{"):
            got.append(json.loads(line))
    return got


def test_collectives():
    p = psrun(3, os.path.join(HERE, "c10d_worker.py"), "collectives")
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(3):
        assert "ok rank %d" % r in p.stdout, p.stdout + p.stderr


def test_ddp_script_matches_gloo():
    """train_ddp_psd.py through psd and its twin train_ddp.py over gloo:
    the same losses at every step and the same final parameters."""
    args = ["--synthetic", "512", "--model", "small", "--steps", "12", "--batch", "16",
            "--log-every", "1", "--optimizer", "adamw", "--lr", "0.01", "--step-size", "5",
            "--clip", "1.0", "--threads", "1", "--warmup", "2"]
    p = psrun(2, os.path.join(EX, "train_ddp_psd.py"), *args)
    assert p.returncode == 0, p.stdout + p.stderr
    ps = records(p.stdout)
    g = records(gloo(2, os.path.join(EX, "train_ddp.py"), *args))
    ps_steps = [x for x in ps if "step" in x]
    g_steps = [x for x in g if "step" in x]
    assert len(ps_steps) == len(g_steps) == 12
    for a, b in zip(ps_steps, g_steps):
        assert abs(a["global_loss"] - b["global_loss"]) < 1e-5, (a, b)
    sums = {x["backend"]: x["param_checksum"] for x in ps + g if "backend" in x}
    assert set(sums) == {"psd", "gloo"}
    assert abs(sums["psd"] - sums["gloo"]) < 1e-4 * max(1.0, abs(sums["gloo"])), sums


def test_twin_scripts_differ_in_marked_lines_only():
    a = open(os.path.join(EX, "train_ddp.py")).read().split('"""', 2)[2].splitlines()
    b = open(os.path.join(EX, "train_ddp_psd.py")).read().split('"""', 2)[2].splitlines()
    only_b = [x for x in b if x not in a]
    assert len(only_b) == 1 and "# psd:" in only_b[0], only_b  # the backend's name
    assert len(a) == len(b)


def test_backend_found_without_importing_psd_and_user_sitecustomize_kept(tmpdir_short):
    """psrun's import hook registers "psd" when the script imports
    torch.distributed; a sitecustomize the environment already had still
    runs."""
    own = os.path.join(tmpdir_short, "own")
    os.mkdir(own)
    with open(os.path.join(own, "sitecustomize.py"), "w") as f:
        f.write("print('own sitecustomize ran', flush=True)\n")
    code = ("import sys; import torch.distributed as d; d.init_process_group('psd'); "
            "print('backend', d.get_backend(), 'psd' in sys.modules, flush=True)")
    env = dict(os.environ, PYTHONPATH=own)
    env.pop("PSD_LIBPSCLIENT", None)
    p = subprocess.run([os.path.join(BIN, "psrun"), "--local", "-n", "3", "--ps", "1", "--", PY,
                        "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    for w in range(2):
        assert "[w%d] backend psd True" % w in p.stdout, p.stdout + p.stderr
        assert "[w%d] own sitecustomize ran" % w in p.stdout, p.stdout + p.stderr


def test_ddp_equals_one_process_with_global_batch(tmpdir_short):
    """2 ranks x B (AdamW, two parameter groups, StepLR, clip_grad_norm_,
    BatchNorm, accumulation over 2 micro-batches) equal one process over
    the global batch, each rank's micro-batches through BatchNorm alone
    as DDP does, to 1e-5."""
    out = os.path.join(tmpdir_short, "ddp.pt")
    p = psrun(2, os.path.join(HERE, "c10d_worker.py"), "equivalence", out)
    assert p.returncode == 0, p.stdout + p.stderr
    got = torch.load(out)
    torch.manual_seed(7)
    net = cw.small_net()
    opt = torch.optim.AdamW(cw.groups(net), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    n, B, half = 2, cw.B, cw.B // 2
    for step in range(cw.STEPS):
        x, y = cw.batches(step, n)
        opt.zero_grad()
        for r in range(n):
            for lo, hi in ((0, half), (half, B)):
                xs, ys = x[r * B + lo:r * B + hi], y[r * B + lo:r * B + hi]
                (F.cross_entropy(net(xs), ys) / 2 / n).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        sched.step()
    moved = 0.0
    torch.manual_seed(7)
    start = dict(cw.small_net().named_parameters())
    for name, p_ in net.named_parameters():
        assert torch.allclose(got[name], p_.detach(), atol=1e-5, rtol=0), name
        moved = max(moved, float((p_.detach() - start[name].detach()).abs().max()))
    assert moved > 1e-3  # it trained


def test_skipped_call_fails_within_timeout_naming_it():
    p = psrun(2, os.path.join(HERE, "c10d_worker.py"), "skip", timeout=120)
    assert p.returncode != 0
    assert "rank 0 failed" in p.stdout, p.stdout + p.stderr
    assert "all_reduce(SUM, torch.float32(3,))" in p.stdout, p.stdout
    assert "timeout" in p.stdout, p.stdout


def test_outside_psrun_says_how_to_launch():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PS_")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    code = ("import sys; sys.path.insert(0, %r); import psd_path, psd.torch; "
            "import torch.distributed as d; d.init_process_group('psd')" % EX)
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode != 0
    assert "psrun" in p.stderr and "PS_HOSTS is not set" in p.stderr, p.stderr


def test_backup_workers_ddp_goes_on_without_a_dead_rank(tmpdir_short):
    """psrun --backup-workers 1, 3 ranks: all_reduce means are over the
    first two parts (the same on every rank), exact calls over all three;
    DDP trains on after rank 2 dies, and ranks 0 and 1 end equal."""
    out = os.path.join(tmpdir_short, "bk")
    p = psrun(3, os.path.join(HERE, "c10d_worker.py"), "backup", out,
              extra=("--backup-workers", "1"))
    log = p.stdout + p.stderr
    assert p.returncode == 0, log
    assert "rank 2 dies" in log and "going on without it" in log, log
    for r in (0, 1):
        assert "rank %d trained 12 steps" % r in log, log
    a, b = _state(out + ".0"), _state(out + ".1")
    for k in a:  # BatchNorm's running statistics are each rank's own after
        if "running_" not in k:  # the last forward, as under DDP on gloo
            assert torch.equal(a[k], b[k]), k


def test_restarted_rank_refused_with_a_sentence(tmpdir_short):
    """A restarted rank of a script without psd.torch.Checkpoint cannot
    rejoin: it stops at its first collective after DDP's start, saying what
    the script needs, and the job ends at once instead of waiting out the
    group's timeout."""
    import time
    marker = os.path.join(tmpdir_short, "died")
    t0 = time.monotonic()
    p = psrun(2, os.path.join(HERE, "c10d_worker.py"), "restart", marker,
              extra=("--restart-workers", "1"), timeout=120)
    log = p.stdout + p.stderr
    assert p.returncode != 0, log
    assert "rank 1 dies" in log and "restarted it" in log, log
    assert "rank 1 was restarted by psrun --restart-workers and has not rejoined" in log, log
    assert "create psd.torch.Checkpoint(ddp, optimizer, scheduler, loader)" in log, log
    assert time.monotonic() - t0 < 90, log


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The rejoin script's final state_dicts without a death."""
    out = str(tmp_path_factory.mktemp("rejoin") / "ref")
    p = psrun(2, os.path.join(HERE, "c10d_worker.py"), "rejoin", out, "-1")
    assert p.returncode == 0, p.stdout + p.stderr
    return [_state("%s.%d" % (out, r)) for r in (0, 1)]


@pytest.mark.parametrize("die", [1, 0])
def test_restarted_rank_rejoins_with_the_others_state(tmpdir_short, uninterrupted, die):
    """psrun --restart-workers: a rank that dies in the middle of a DDP
    step's backward (some of its buckets sent) is started again and, with
    psd.torch.Checkpoint's line, rejoins: it takes the others' model,
    optimizer, scheduler, place in the data and call counts, redoes the
    step they wait in, and the job ends with every rank's parameters and
    buffers bit-identical to an uninterrupted run's. die=0: the chief (the
    torch store's server and broadcasts' root) is the one restarted;
    die=1 runs with a checkpoint directory (the stop vote's calls too)."""
    out = os.path.join(tmpdir_short, "out")
    extra = ["--restart-workers", "1"]
    if die == 1:
        extra += ["--checkpoint-dir", os.path.join(tmpdir_short, "ck")]
    p = psrun(2, os.path.join(HERE, "c10d_worker.py"), "rejoin", out, str(die),
              extra=tuple(extra), timeout=180)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log
    assert "rank %d dies before step 8's optimizer step" % die in log, log
    assert "rank %d rejoined at step 7 (epoch 1) with rank %d's state" % (die, 1 - die) in log, log
    for r in (0, 1):
        got, want = _state("%s.%d" % (out, r)), uninterrupted[r]
        assert list(got) == list(want)
        for k in got:
            assert torch.equal(got[k], want[k]), (r, k)


def test_restarted_rank_refused_between_steps(tmpdir_short):
    """A rank that dies between its optimizer step and the script's
    all_reduce of the loss leaves the others waiting outside a training
    step, where a restarted rank cannot join them: it is told so by rank 0
    and stops, and the job ends at once."""
    import time
    t0 = time.monotonic()
    p = psrun(2, os.path.join(HERE, "c10d_worker.py"), "rejoin",
              os.path.join(tmpdir_short, "out"), "1", "after",
              extra=("--restart-workers", "1"), timeout=120)
    log = p.stdout + p.stderr
    assert p.returncode != 0, log
    assert "rank 1 dies after step 8's optimizer step" in log, log
    assert "restarted rank 1 cannot rejoin: rank 0 waits for it in a collective outside a " \
        "training step" in log, log
    assert time.monotonic() - t0 < 90, log


def _sigterm_at_step_9(cmd, env):
    """Runs cmd and sends psrun SIGTERM once rank 0 has taken 9 steps:
    (status, output, seconds from the signal to the exit)."""
    import signal
    import time
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    seen = []
    deadline = time.monotonic() + 120
    t0 = time.monotonic()
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("[w0] step 9") or time.monotonic() > deadline:
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            break
    text = "".join(seen) + proc.communicate(timeout=120)[0]
    return proc.returncode, text, time.monotonic() - t0


def test_stop_with_a_dead_backup_rank_and_resume(tmpdir_short):
    """psrun --backup-workers 1, 3 ranks, rank 2 dead: SIGTERM still stops
    the job after a checkpoint (the saved-mark needs the job's N - K ranks,
    not the dead one) with status 75 at once, and the same command
    resumes it, rank 2 from rank 0's place in the data."""
    out, ck = os.path.join(tmpdir_short, "out.pt"), os.path.join(tmpdir_short, "ck")
    cmd = [os.path.join(BIN, "psrun"), "--local", "-n", "4", "--ps", "1", "--backup-workers",
           "1", "--checkpoint-dir", ck, "--", PY, os.path.join(HERE, "c10d_worker.py"),
           "preempt_backup", out, "40"]
    env = dict(os.environ)
    env.pop("PSD_LIBPSCLIENT", None)
    status, text, took = _sigterm_at_step_9(cmd, env)
    assert status == 75, text
    assert took < 30, text  # not the group's timeout
    assert "rank 2 dies" in text and "stopped on request after step" in text, text
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log
    assert "rank 2 has no state of its own" in log and "resuming at step" in log, log
    assert os.path.exists(out), log


def _state(path):
    return torch.load(path)


@pytest.mark.parametrize("mode", ["preempt", "preempt1"])
def test_sigterm_stops_after_a_checkpoint_and_resumes_bit_identical(tmpdir_short, mode):
    """psd.torch.Checkpoint: SIGTERM to psrun in the middle of a DDP run
    (dropout, BatchNorm, AdamW, StepLR, a DataLoader over a
    DistributedSampler) ends it with status 75 after a checkpoint; the same
    command resumes it, and the final parameters and buffers are
    bit-identical to an uninterrupted run's. preempt: the loop starts at
    ckpt.epoch; preempt1: the script's loop unchanged (epochs from 0, the
    scheduler stepped per epoch), the Checkpoint line its only change."""
    steps = "40" if mode == "preempt" else "7"  # preempt1: 7 epochs of 6 steps
    ref = os.path.join(tmpdir_short, "ref.pt")
    p = psrun(2, os.path.join(HERE, "c10d_worker.py"), mode, ref, steps,
              extra=("--checkpoint-dir", os.path.join(tmpdir_short, "ck-ref")))
    assert p.returncode == 0, p.stdout + p.stderr
    out = os.path.join(tmpdir_short, "out.pt")
    ck = os.path.join(tmpdir_short, "ck")
    cmd = [os.path.join(BIN, "psrun"), "--local", "-n", "3", "--ps", "1", "--checkpoint-dir",
           ck, "--", PY, os.path.join(HERE, "c10d_worker.py"), mode, out, steps]
    env = dict(os.environ)
    env.pop("PSD_LIBPSCLIENT", None)
    status, text, _took = _sigterm_at_step_9(cmd, env)
    assert status == 75, text
    assert "stopped on request after step" in text, text
    stop = int(text.split("stopped on request after step ")[1].split(";")[0])
    assert 9 <= stop < (int(steps) if mode == "preempt" else 42), text
    assert not os.path.exists(out)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resuming at step %d" % stop in p.stdout + p.stderr, p.stdout + p.stderr
    got, want = _state(out), _state(ref)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
