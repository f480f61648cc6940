"""The NumPy layer against real psd processes: variables as views of the
library's buffers, steps, tables, early pushes and the error mapping."""
import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import psd
from conftest import ROOT, hosts


def client(tasks, **kw):
    kw.setdefault("telemetry", "off")
    return psd.Client(hosts=hosts(tasks), **kw)


def test_variable_views_and_step(start_psd):
    ps = start_psd(2)
    with client(ps) as c:
        w = c.variable("w", (3, 4), init=psd.Constant(1.0), optimizer=psd.SGD(lr=0.5))
        assert w.data.shape == (3, 4) and w.data.dtype == np.float32
        assert np.all(w.data == 1)
        assert c.pull() == 0
        w.grad[:] = np.arange(12, dtype=np.float32).reshape(3, 4)
        assert c.step() == 1 and c.current_step == 1
        np.testing.assert_allclose(w.data, 1 - 0.5 * np.arange(12).reshape(3, 4))
        assert c.variable("w", (3, 4), init=psd.Constant(1.0),
                          optimizer=psd.SGD(lr=0.5)) is w
    for p in ps:
        assert p.wait() == 0


def test_errors_carry_code_name_and_message(start_psd):
    ps = start_psd(1)
    with client(ps) as c:
        c.variable("w", (3, 4))
        with pytest.raises(psd.ShapeError) as e:
            c.variable("w", (3, 5))
        assert e.value.code == -12 and e.value.name == "PS_ESHAPE"
        assert "3" in e.value.message and "5" in e.value.message
        with pytest.raises(psd.ConfigMismatch):
            c.variable("w", (3, 4), optimizer=psd.Adam())
        with pytest.raises(ValueError):
            c.variable("bad", (0, 3))
        with pytest.raises(ValueError):
            psd.Cosine(total_steps=-1)
    with pytest.raises(psd.ConnectError) as e:
        psd.Client(hosts=["127.0.0.1:1"], connect_timeout_ms=300, telemetry="off")
    assert "127.0.0.1:1" in str(e.value)


def test_every_library_code_has_its_class():
    code = -1
    while psd._clib.ps_err_name(code).decode() != "PS_UNKNOWN":
        cls = psd.errors._BY_CODE.get(code)
        assert cls is not None, "no class for %s" % psd._clib.ps_err_name(code)
        assert cls(message="x").name == psd._clib.ps_err_name(code).decode()
        code -= 1
    assert len(psd.errors._BY_CODE) == -code - 1
    assert issubclass(psd.Stopped, psd.Error)


def test_step_push_sends_part_early(start_psd):
    ps = start_psd(2)
    with client(ps) as c:
        a = c.variable("a", (5,), init=psd.Constant(1), optimizer=psd.SGD(lr=0.5))
        b = c.variable("b", (5,), init=psd.Constant(1), optimizer=psd.SGD(lr=0.5))
        a.grad[:] = 1
        b.grad[:] = 2
        c.step_push([a])
        with pytest.raises(psd.InvalidArgument, match="already pushed"):
            c.step_push([a])
        assert c.step() == 1
        assert np.all(a.data == 0.5) and np.all(b.data == 0)


def test_table_pull_add_grad(start_psd):
    ps = start_psd(2)
    with client(ps) as c:
        t = c.table("emb", dim=4, capacity=100, optimizer=psd.TableSGD(0.5),
                    init=psd.Constant(2.0))
        rows = t.pull([1, 2, 2, -5])
        assert rows.shape == (4, 4) and np.all(rows == 2)
        t.add_grad(np.array([1, -5, 1]), np.ones((3, 4)))
        assert c.step() == 1
        rows = t.pull([1, -5, 3])
        np.testing.assert_allclose(rows, [[1] * 4, [1.5] * 4, [2] * 4])
        with pytest.raises(ValueError, match="gradient values"):
            t.add_grad([1], np.ones(3))
        with pytest.raises(TypeError):
            t.pull([1.5])


def test_table_lr_schedule(start_psd):
    """TableSGD(schedule=psd.StepDecay(0.5, 2)): the rate halves every 2 of
    the table's steps, as a variable's would (psd 0.2.8); FTRL takes none."""
    ps = start_psd(1)
    with client(ps) as c:
        t = c.table("s", dim=2, capacity=10,
                    optimizer=psd.TableSGD(0.5, schedule=psd.StepDecay(0.5, 2)))
        t.pull([3])
        for s, want in enumerate([-0.5, -1.0, -1.25, -1.5]):
            t.add_grad(np.array([3]), np.ones((1, 2)))
            assert c.step() == s + 1
            np.testing.assert_allclose(t.pull([3]), [[want, want]])
        with pytest.raises(TypeError):  # its rate is per element
            psd.TableFTRL(0.5, schedule=psd.Warmup(2))
        with pytest.raises(TypeError, match="schedule must be a psd schedule"):
            psd.TableAdam(schedule=0.5)


def sockets():
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink("/proc/self/fd/" + f).startswith("socket:")
        except FileNotFoundError:  # listdir's own descriptor, closed since
            pass
    return n


def test_arrays_outlive_close(start_psd):
    ps = start_psd(1)
    c = client(ps)
    w = c.variable("w", (1000,), init=psd.Constant(3.0))
    view = w.data[10:20]
    c.finish()
    before = sockets()
    c.close()
    assert sockets() == before - 1  # closed now, although a view is alive
    del w
    gc.collect()
    assert np.all(view == 3)  # the buffer lives as long as a view of it
    with pytest.raises(psd.StateError, match="closed"):
        c.step()


def rss_kib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4


def test_memory_flat_over_10k_steps(start_psd):
    """No reference or buffer leaks per step: resident memory after 10k
    steps (with a table, early pushes and async requests) within 2 MiB of
    where it was after 1k."""
    ps = start_psd(1)
    with client(ps) as c:
        w = c.variable("w", (256,), optimizer=psd.SGD(lr=0.001))
        t = c.table("t", dim=8, capacity=1000, optimizer=psd.TableSGD(0.01))
        keys = np.arange(16)
        g = np.full((16, 8), 1e-3, np.float32)
        step = c.pull()
        for i in range(10000):
            if i == 1000:
                gc.collect()
                base = rss_kib()
            w.grad[:] = 1e-3
            if i % 2:
                c.step_push([w])
            t.add_grad(keys, g)
            rows = t.pull(keys)
            step = c.step()
            r = c.pull_async([w], step)
            assert r.wait() == step and rows.shape == (16, 8)
        gc.collect()
        grown = rss_kib() - base
        assert grown < 2048, "resident memory grew %d KiB over 9000 steps" % grown


def test_gil_released_while_waiting(start_psd):
    """A thread blocked in a psd wait lets other Python threads run."""
    import threading
    import time
    ps = start_psd(1)
    c0 = client(ps, worker_index=0, num_workers=2)
    c1 = client(ps, worker_index=1, num_workers=2)
    v0 = c0.variable("w", (4,))
    ticks = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    th = threading.Thread(target=spin)
    th.start()
    t0 = time.time()
    done = threading.Thread(target=lambda: c1.variable("w", (4,)))
    done.start()
    v0.grad[:] = 1
    stepper = threading.Thread(target=c0.step)  # waits for worker 1's push
    stepper.start()
    time.sleep(0.3)
    assert stepper.is_alive()
    n = len(ticks)
    done.join()
    c1.step()
    stepper.join()
    stop.set()
    th.join()
    assert n > 50, "only %d ticks in %.2f s while a call waited" % (n, time.time() - t0)
    c0.finish()
    c1.finish()
    c0.close()
    c1.close()


def test_hosts_as_one_comma_separated_string(start_psd):
    """hosts="h:p,h:p" is the same as a list (it was split into characters)."""
    ps = start_psd(2)
    c = psd.Client(hosts=",".join(hosts(ps)), telemetry="off")
    assert c.num_ps == 2
    c.finish()
    c.close()


def test_bad_shapes_and_names_stop_before_c(start_psd):
    """A dimension past int64 used to wrap in ctypes (2**64 + 1 created a
    variable of 1 element on the servers, then failed), 2.7 became 2, and
    a NUL in a name cut it short in C ('a\\0b' attached to 'a')."""
    ps = start_psd(1)
    with client(ps) as c:
        for shape in [(2**64 + 1,), (2**63,), (4, 2.7), ("3",)]:
            with pytest.raises(ValueError, match="shape"):
                c.variable("v", shape)
        with pytest.raises(ValueError, match="NUL"):
            c.variable("a\0b", 3)
        with pytest.raises(ValueError, match="NUL"):
            c.table("t\0u", 4, 10)
        with pytest.raises(TypeError, match="name"):
            c.variable(None, 3)
        assert c.variables == {}
        a = c.variable("a", 3, init=psd.Constant(1))
        assert a.shape == (3,) and np.all(a.data == 1)


def test_request_wait_timeouts_and_after_release(start_psd):
    """wait(timeout) past 2**31 ms wrapped in ctypes (4294968 s waited
    0.7 s), inf raised OverflowError, and a released request raised an
    InvalidArgument carrying an earlier call's message."""
    import threading
    import time
    ps = start_psd(1)
    c0 = client(ps, worker_index=0, num_workers=2)
    c1 = client(ps, worker_index=1, num_workers=2)
    w0 = c0.variable("w", 3)
    c1.variable("w", 3)
    r = c0.pull_async()
    assert r.wait(timeout=float("inf")) == 0
    r.release()
    with pytest.raises(psd.StateError, match="released"):
        r.wait()
    with pytest.raises(ValueError, match="timeout"):
        c0.pull_async().wait(timeout=float("nan"))
    w0.grad[:] = 1
    c0.push_async().wait()
    late = threading.Timer(1.5, c1.step)  # completes step 1 in 1.5 s
    late.start()
    t0 = time.time()
    r = c0.pull_async([w0], min_step=1)
    assert r.done(0.05) is False and r.step is None  # in flight: False, no exception
    waker = threading.Timer(0.2, c0.wake)  # another thread ends a long wait at once
    waker.start()
    t1 = time.time()
    assert r.done(30) is False and time.time() - t1 < 1.0
    waker.join()
    assert r.wait(timeout=2**32 / 1000 + 0.704) == 1
    assert time.time() - t0 > 1
    assert r.done(0) is True and r.step == 1
    late.join()
    for c in (c0, c1):
        c.finish()
        c.close()


def test_table_pull_out_must_be_writable(start_psd):
    """A read-only out (an array over a bytes object) was written into by
    C: the 'immutable' bytes changed under Python."""
    ps = start_psd(1)
    with client(ps) as c:
        t = c.table("t", 2, 10, init=psd.Constant(5.0))
        frozen = bytes(16)
        ro = np.frombuffer(frozen, dtype=np.float32).reshape(2, 2)
        with pytest.raises(ValueError, match="writable"):
            t.pull([1, 2], out=ro)
        assert frozen == bytes(16)
        with pytest.raises(ValueError, match="out must"):
            t.pull([1], out=[0.0, 0.0])
        out = np.zeros((2, 2), np.float32)
        assert t.pull([1, 2], out=out) is out and np.all(out == 5)


def test_close_waits_for_another_thread_s_call(start_psd):
    """close() from another thread ran ps_client_close while a wait was
    driving the same connections (a ps_client is not thread-safe): it
    now takes the client's lock like every other call."""
    import threading
    import time
    ps = start_psd(1)
    c = client(ps, worker_index=0, num_workers=2)
    w = c.variable("w", 3)
    got = []

    def waiter():
        try:
            c.pull_async([w], min_step=1).wait(timeout=1.0)  # nobody steps
        except psd.Error as e:
            got.append(e)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.3)
    t0 = time.time()
    c.close()
    th.join()
    assert time.time() - t0 > 0.4
    assert len(got) == 1 and isinstance(got[0], psd.Timeout), got
    with pytest.raises(psd.StateError, match="closed"):
        c.pull()


def test_assigning_grad_instead_of_filling_it_raises(start_psd):
    """`w.grad = g` replaced the attribute and step() silently pushed the
    library's buffer (zeros) instead of g."""
    ps = start_psd(1)
    with client(ps) as c:
        w = c.variable("w", 3, init=psd.Constant(1), optimizer=psd.SGD(lr=1))
        c.pull()
        with pytest.raises(AttributeError, match=r"w\.grad\[:\]"):
            w.grad = np.ones(3, np.float32)
        with pytest.raises(AttributeError, match=r"w\.data\[:\]"):
            w.data = np.ones(3, np.float32)
        w.grad[:] = 1
        c.step()
        assert np.all(w.data == 0)


def test_wire_dtype_and_transport_keywords(start_psd):
    """push_dtype/pull_dtype reach the library (a bf16 pull rounds the
    values psd keeps in float32) and transport picks TCP or shared memory;
    bad names stop before C."""
    ps, ps2 = start_psd(1), start_psd(1)
    v = 1.0 + 2.0 ** -10  # not a bfloat16: 8 significant bits
    with client(ps, transport="tcp", pull_dtype="bf16") as c:
        assert c.transport(0) == "tcp"
        w = c.variable("w", (4,), init=psd.Constant(v), optimizer=psd.NotTrainable())
        assert c.pull() == 0
        assert np.all(w.data == 1.0)  # rounded to nearest even on the wire
    with client(ps2, transport="shm", pull_dtype="bf16") as c:
        assert c.transport(0) == "shm"
        w = c.variable("w", (4,), init=psd.Constant(v), optimizer=psd.NotTrainable())
        assert c.pull() == 0
        assert np.all(w.data == np.float32(v))  # 16-bit travels over TCP only
        with pytest.raises(IndexError):
            c.transport(1)
    for bad in ({"transport": "udp"}, {"push_dtype": "f64"}):
        with pytest.raises(ValueError):
            client(ps2, **bad)
    for p in ps + ps2:
        assert p.wait() == 0


def test_variable_only_one_worker_creates_is_named(start_psd, tmpdir_short):
    """A typo in one worker's variable name waited silently for the whole
    request timeout: now that worker says within seconds which variable it
    waits for, and the error names it."""
    ps = start_psd(1)
    code = ("import sys; sys.path.insert(0, %r); import psd\n"
            "c = psd.Client(hosts=%r, worker_index=1, num_workers=2, request_timeout_ms=6000,"
            " telemetry='off')\n"
            "try:\n"
            "    c.variable('fc.weigth', 4)\n"
            "except psd.Timeout as e:\n"
            "    print('timeout:', e)\n"
            % (os.path.join(ROOT, "python"), ",".join(hosts(ps))))
    chief = psd.Client(hosts=hosts(ps), worker_index=0, num_workers=2, telemetry="off")
    chief.variable("fc.weight", 4)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    chief.close()
    import re
    assert re.search(r"still waiting after \d+ s for the chief \(worker 0\) to create "
                     r"variable 'fc.weigth'", p.stderr), p.stderr
    assert "variable 'fc.weigth': the chief (worker 0) did not create it" in p.stdout, p.stdout
