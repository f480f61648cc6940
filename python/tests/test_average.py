"""Moving averages on the servers (psd 0.2.7): the averages pulled equal
an EMA (plain, TensorFlow's num_updates form) and a Polyak mean computed
in NumPy over the parameters pulled after each step; the parameters stay
as they were; DistributedModule.averaged() swaps the module's parameters
for the averages and restores them; an older psd refuses by name."""
import numpy as np
import pytest
import torch

import psd
import psd.torch  # noqa: F401 (psd.torch.DistributedModule)
from conftest import hosts

STEPS = 30
N = 257  # not a multiple of any vector width


def _reference(kind, decay, params):
    """The average after each of params[1:], from params[0] (the initial
    values), in float64."""
    a = params[0].astype(np.float64)
    for t, w in enumerate(params[1:], start=1):
        if kind == "polyak":
            a = np.mean(np.stack(params[1:t + 1]).astype(np.float64), axis=0)
            continue
        d = min(decay, (1.0 + t) / (10.0 + t)) if kind == "ema_num_updates" else decay
        a = d * a + (1 - d) * w.astype(np.float64)
    return a


def test_averages_match_numpy(start_psd):
    """Three variables, one per form, trained 30 steps with random
    gradients: each pulled average equals the NumPy reference to 1e-5
    relative (float32 on the servers), ``data`` still holds the
    parameters, and the averages include all 30 steps."""
    rng = np.random.default_rng(11)
    w0 = rng.uniform(-2.0, 2.0, N).astype(np.float32)
    forms = {"ema": 0.9, "ema_num_updates": 0.99, "polyak": 0.0}
    ps = start_psd(1)
    with psd.Client(hosts=hosts(ps), telemetry="off") as c:
        vs = {k: c.variable(k, (N,), optimizer=psd.SGD(0.1, momentum=0.5, average=k,
                                                       average_decay=d), values=w0)
              for k, d in forms.items()}
        plain = c.variable("plain", (N,), optimizer=psd.SGD(0.1), values=w0)
        assert c.pull() == 0
        start = c.pull_average(vs.values())
        for k in forms:
            np.testing.assert_array_equal(start[k], w0)  # the initial values, exactly
        seen = {k: [vs[k].data.copy()] for k in forms}
        for _ in range(STEPS):
            g = rng.normal(0.0, 1.0, N).astype(np.float32) + 0.3  # a drift
            for v in list(vs.values()) + [plain]:
                v.grad[:] = g
            c.step()
            for k in forms:
                seen[k].append(vs[k].data.copy())
        before = {k: v.data.copy() for k, v in vs.items()}
        got = c.pull_average(vs.values())
        assert c.average_step == STEPS and c.current_step == STEPS
        for k, d in forms.items():
            want = _reference(k, d, seen[k])
            np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-6, err_msg=k)
            np.testing.assert_array_equal(vs[k].data, before[k])  # parameters untouched
            assert np.abs(got[k] - vs[k].data).max() > 1e-2, "%s: the average is the value" % k
        with pytest.raises(psd.InvalidArgument, match="variable 'plain' keeps no moving average"):
            c.pull_average([plain])
        c.step()  # training goes on from the parameters
    assert ps[0].wait() == 0


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.fc1 = torch.nn.Linear(6, 5)
        self.fc2 = torch.nn.Linear(5, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _train(model, steps):
    gen = torch.Generator().manual_seed(6)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 2, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        model.step()


def test_distributed_module_averaged(start_psd):
    """Inside averaged() the module's parameters are the servers'
    averages (and the forward pass uses them); after it, the parameters
    again, bit for bit, and training continues without step() taking the
    swap for an outside edit."""
    ps = start_psd(1)
    with psd.Client(hosts=hosts(ps), telemetry="off") as c:
        net = _Net()
        model = psd.torch.DistributedModule(
            net, c, optimizer=psd.SGD(0.1, average="ema_num_updates", average_decay=0.99))
        model.start()
        _train(model, 8)
        params = {n: p.detach().clone() for n, p in net.named_parameters()}
        x = torch.randn(4, 6)
        with torch.no_grad():
            out_params = net(x)
        with model.averaged(), torch.no_grad():
            avg = c.pull_average(model.variables.values())
            assert c.average_step == 8
            for n, p in net.named_parameters():
                np.testing.assert_array_equal(p.numpy(), avg[n].reshape(p.shape), err_msg=n)
                assert not torch.equal(p, params[n]), n
            assert not torch.equal(net(x), out_params)
        for n, p in net.named_parameters():
            assert torch.equal(p.detach(), params[n]), n
        with pytest.raises(RuntimeError, match="boom"):
            with model.averaged():
                raise RuntimeError("boom")
        for n, p in net.named_parameters():
            assert torch.equal(p.detach(), params[n]), n
        _train(model, 2)
    assert ps[0].wait() == 0


def test_average_errors(start_psd):
    """An unknown form is a ValueError (given or through replace()); a psd
    of protocol 2.6 refuses an average by name before the variable is
    registered; averaged() on a module whose rules keep none names the
    parameter."""
    with pytest.raises(ValueError, match="average must be"):
        psd.SGD(0.1, average="mean")
    ps = start_psd(1, "--protocol-minor", "6")
    with psd.Client(hosts=hosts(ps), telemetry="off") as c:
        with pytest.raises(psd.Unsupported,
                           match=r"a moving average \(optimizer average\) needs protocol 2\.7"):
            c.variable("a", (4,), optimizer=psd.SGD(0.1, average="ema"))
        c.variable("s", (4,), optimizer=psd.SGD(0.1))
    assert ps[0].wait() == 0
    ps = start_psd(1)
    with psd.Client(hosts=hosts(ps), telemetry="off") as c:
        with pytest.raises(ValueError, match="average must be"):
            c.variable("r", (4,), optimizer=psd.SGD(0.1).replace(average="mean"))
        model = psd.torch.DistributedModule(_Net(), c, optimizer=psd.SGD(0.1))
        model.start()
        with pytest.raises(psd.InvalidArgument, match="keeps no moving average"):
            with model.averaged():
                pass
    assert ps[0].wait() == 0
