"""examples/python/ctr_torch.py on ctr_synth's data: through psrun it
learns (test AUC above chance) and prints its summary; stopped by SIGTERM
after a checkpoint it exits 75, and the same command resumes at the
checkpoint's step with the same batch and the same loss."""
import json
import os
import signal
import subprocess
import sys
import time

from conftest import BIN, ROOT, hosts

SCRIPT = os.path.join(ROOT, "examples", "python", "ctr_torch.py")
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))


def synth(tmp):
    """A small, easy data set: 8 fields of at most 1000 ids each."""
    out = os.path.join(tmp, "data")
    subprocess.run([os.path.join(BIN, "ctr_synth"), "--out", out, "--train", "8192", "--test",
                    "2048", "--fields", "8", "--max-vocab", "1000"], check=True,
                   stdout=subprocess.DEVNULL)
    return out


def worker_lines(out, w):
    """What worker w printed on stdout through psrun ("[wW] " prefixed)."""
    tag = "[w%d] " % w
    return [line[len(tag):] for line in out.splitlines() if line.startswith(tag)]


def test_ctr_torch_learns_through_psrun(tmpdir_short):
    data, metrics = synth(tmpdir_short), os.path.join(tmpdir_short, "metrics")
    p = subprocess.run([os.path.join(BIN, "psrun"), "--local", "-n", "3", "--ps", "1", "--",
                        sys.executable, SCRIPT, "--data", data, "--steps", "40", "--batch", "64",
                        "--eval-every", "20", "--metrics", metrics],
                       env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    out = p.stdout.decode()
    assert p.returncode == 0, out
    chief = json.loads([x for x in worker_lines(out, 0) if x.startswith("{")][-1])
    other = json.loads([x for x in worker_lines(out, 1) if x.startswith("{")][-1])
    assert chief["steps"] == 40 and chief["workers"] == 2, chief
    assert isinstance(chief["auc"], float) and 0.5 < chief["auc"] <= 1, chief
    assert other["auc"] is None and other["steps"] == 40, other
    with open(metrics) as f:
        lines = [json.loads(x) for x in f]
    assert [x.get("step", x.get("steps")) for x in lines if "auc" in x] == [20, 40], lines
    assert lines[-1] == chief


def trace(path):
    """{step: loss} of a --trace file."""
    with open(path) as f:
        return {int(s): float(v) for s, v in (x.split() for x in f)}


def worker(ps, data, tmp, name, steps):
    """One worker (the whole job) started without psrun; its --trace file."""
    env = dict(ENV, PS_HOSTS=",".join(hosts(ps)), PS_WORKER_INDEX="0", PS_NUM_WORKERS="1",
               PS_TELEMETRY="off")
    path = os.path.join(tmp, name)
    p = subprocess.Popen([sys.executable, SCRIPT, "--data", data, "--steps", str(steps),
                          "--batch", "32", "--no-eval", "--trace", path], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return p, path


def test_stop_and_resume_at_the_checkpoint(start_psd, tmpdir_short):
    data, ckpt = synth(tmpdir_short), os.path.join(tmpdir_short, "ckpt")
    os.mkdir(ckpt, 0o700)
    ps = start_psd(1, "--checkpoint-dir", ckpt)
    p, first = worker(ps, data, tmpdir_short, "trace1", 100000)
    deadline = time.time() + 60
    while not (os.path.exists(first) and len(trace(first)) >= 5):  # it trains
        assert p.poll() is None and time.time() < deadline, p.stdout.read().decode()
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)  # the library's handler: stop after a checkpoint
    out = p.communicate(timeout=60)[0].decode()
    assert p.returncode == 75, out
    assert ps[0].wait() == 75, ps[0].logtext()
    saved = [int(n.split("-")[1]) for n in os.listdir(ckpt) if n.startswith("step-")]
    assert saved, os.listdir(ckpt)
    stop = max(saved)
    ps = start_psd(1, "--checkpoint-dir", ckpt)
    p, second = worker(ps, data, tmpdir_short, "trace2", stop + 3)
    out = p.communicate(timeout=60)[0].decode()
    assert p.returncode == 0, out
    before, after = trace(first), trace(second)
    assert sorted(after) == [stop, stop + 1, stop + 2], (stop, after)
    # The resumed step is the one the first run took from the same state.
    assert after[stop] == before[stop], (stop, before, after)
