"""The README's PyTorch lines and the example they point to.

README.md's "PyTorch: one line changed" names only what exists: the
backend's name, the psrun line's script, psd.torch.Checkpoint's one line and
Horovod's import. The whole DistributedModule example (docs/python.md,
"PyTorch") is run as written (fewer steps, and a batch function of its
own) through psrun --local: it trains, and SIGTERM stops it after a
checkpoint with exit 75, and the same command resumes it."""
import inspect
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


def section(path, heading):
    """The text of the file's section under `## heading` (to the next ## )."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"^## %s$(.*?)(?=^## |\Z)" % re.escape(heading), text, re.M | re.S)
    assert m, "%s has no section %r" % (path, heading)
    return m.group(1)


def readme_example(steps):
    # The whole script of docs/python.md's PyTorch section (its later
    # blocks are fragments: no_decay, averaged())
    code = [c for c in re.findall(r"```python\n(.*?)```", section("docs/python.md", "PyTorch"),
                                  re.S) if "while step < 5000" in c]
    assert len(code) == 1, code
    return BATCH + code[0].replace("5000", str(steps))


def test_readme_lines_are_the_real_ones():
    text = section("README.md", "PyTorch: one line changed")
    python = "".join(re.findall(r"```python\n(.*?)```", text, re.S))
    assert 'dist.init_process_group("psd")' in python
    scripts = re.findall(r"\b(examples/python/\S+\.py)", text)
    assert scripts == ["examples/python/train_ddp_psd.py"], scripts
    with open(os.path.join(ROOT, scripts[0]), encoding="utf-8") as f:
        assert re.search(r'^BACKEND = "psd"', f.read(), re.M)
    import psd.torch
    call = re.search(r"psd\.torch\.Checkpoint\(([^)]*)\)", python)
    assert call, python
    args = [a.strip() for a in call.group(1).split(",")]
    inspect.signature(psd.torch.Checkpoint).bind(*args)  # TypeError if the line is stale
    hvd = re.search(r"`(import psd\.horovod as hvd)`", text)
    assert hvd, text
    exec(hvd.group(1), {})
    assert "DistributedModule" in text and "docs/python.md" in text


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
