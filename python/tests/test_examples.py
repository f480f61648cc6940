"""The PyTorch CIFAR-10 example on synthetic data of CIFAR-10's format,
through psrun --local, against the same network trained by
DistributedDataParallel (cifar10_ddp.py): the same losses and accuracy
after the same steps."""
import json
import os
import subprocess

from conftest import BIN, ROOT

EX = os.path.join(ROOT, "examples", "python")
ARGS = ["--steps", "6", "--batch", "16", "--lr", "0.05", "--momentum", "0.9"]


def summaries(out):
    """The summary JSON lines of a run, by worker (psrun prefixes "[wN] ")."""
    got = {}
    for line in out.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[w") else line
        if line.startswith("{") and '"steps"' in line:
            s = json.loads(line)
            got[s["worker"] if "worker" in s else 0] = s
    return got


def synth(tmp):
    data = os.path.join(tmp, "cifar")
    subprocess.run([os.path.join(BIN, "cifar_synth"), "--out", data, "--train", "640",
                    "--test", "100", "--seed", "3"], check=True, capture_output=True)
    return data


def test_cifar10_torch_through_psrun_equals_ddp(tmpdir_short):
    data = synth(tmpdir_short)
    env = dict(os.environ)
    env.pop("PSD_LIBPSCLIENT", None)  # the checkout's package finds its build/lib
    p = subprocess.run([os.path.join(BIN, "psrun"), "--local", "-n", "3", "--ps", "1", "--",
                        "/usr/bin/python3", os.path.join(EX, "cifar10_torch.py"), "--data",
                        data] + ARGS, capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    ps = summaries(p.stdout + p.stderr)
    d = subprocess.run(["/usr/bin/python3", os.path.join(EX, "cifar10_ddp.py"), "--nproc", "2",
                        "--data", data] + ARGS, capture_output=True, text=True, timeout=180)
    assert d.returncode == 0, d.stdout + d.stderr
    ddp = summaries(d.stdout + d.stderr)
    assert set(ps) == set(ddp) == {0, 1}, (ps, ddp)
    for w in (0, 1):
        assert ps[w]["steps"] == ddp[w]["steps"] == 6
        assert abs(ps[w]["loss"] - ddp[w]["loss"]) < 1e-3, (ps[w], ddp[w])
    assert 0 <= ps[0]["test_accuracy"] <= 1
    assert abs(ps[0]["test_accuracy"] - ddp[0]["test_accuracy"]) <= 0.02
