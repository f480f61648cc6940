"""The README's PyTorch example, run as written (fewer steps, and a batch
function of its own) through psrun --local: it trains, and SIGTERM stops
it after a checkpoint with exit 75, and the same command resumes it."""
import os
import re
import signal
import subprocess
import time

from conftest import BIN, ROOT

BATCH = '''import torch
def batch(step, worker):
    g = torch.Generator().manual_seed(step * 8 + worker)
    return torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
'''


def readme_example(steps):
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## Python and PyTorch", 1)[1]
    # The DistributedModule example (the section opens with DDP's two lines)
    code = [c for c in re.findall(r"```python\n(.*?)```", section, re.S)
            if "DistributedModule" in c][0]
    assert "5000" in code
    return BATCH + code.replace("5000", str(steps))


def psrun(script, tmp, *extra):
    path = os.path.join(tmp, "train.py")
    with open(path, "w") as f:
        f.write(script)
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    return subprocess.Popen([os.path.join(BIN, "psrun"), "--local", "-n", "3", "--ps", "1"] +
                            list(extra) + ["--", "/usr/bin/python3", path], env=env, cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def test_readme_example_trains(tmpdir_short):
    p = psrun(readme_example(20), tmpdir_short)
    out = p.communicate(timeout=180)[0].decode()
    assert p.returncode == 0, out


def test_sigterm_stops_after_a_checkpoint_and_resumes(tmpdir_short):
    ckpt = os.path.join(tmpdir_short, "ckpt")
    script = readme_example(100000).replace(
        "step = model.step()", "step = model.step(); print('step', step, flush=True)")
    p = psrun(script, tmpdir_short, "--checkpoint-dir", ckpt)
    for line in iter(p.stdout.readline, b""):  # training has started
        if b"step 20" in line:
            break
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=120)[0].decode()
    assert p.returncode == 75, out
    assert any(n.startswith("step-") for n in os.listdir(ckpt)), os.listdir(ckpt)
    stopped_at = max(int(n.split("-")[1]) for n in os.listdir(ckpt) if n.startswith("step-"))
    # The same command resumes at the checkpoint (and is stopped again).
    p = psrun(script, tmpdir_short, "--checkpoint-dir", ckpt)
    first = None
    t0 = time.time()
    for line in iter(p.stdout.readline, b""):
        m = re.search(rb"\] step (\d+)$", line.strip()) or re.match(rb"step (\d+)", line.strip())
        if m:
            first = int(m.group(1))
            break
        assert time.time() - t0 < 120
    os.killpg(p.pid, signal.SIGTERM)
    p.communicate(timeout=120)
    assert first == stopped_at + 1, (first, stopped_at)
