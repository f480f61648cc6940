"""The servers' update rules of psd 0.2.6 against torch.optim: the same
gradients pushed to a real psd and given to torch's optimizer, 100 steps,
every parameter equal to 1e-6 relative; DistributedModule's no_decay and
per-parameter rules against torch's param groups; an older psd refuses
the new rules by name."""
import numpy as np
import pytest
import torch

import psd
import psd.torch  # noqa: F401 (psd.torch.DistributedModule)
from conftest import hosts

STEPS = 100
RTOL = 1e-6
N = 257  # not a multiple of any vector width

# name: (psd's rule, torch's optimizer over a parameter list)
RULES = {
    "adam_torch_epsilon": (
        psd.Adam(0.01, epsilon=1e-3, weight_decay=0.01, torch_epsilon=True),
        lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-3, weight_decay=0.01)),
    "adamw": (
        psd.AdamW(0.01, beta1=0.8, beta2=0.99, weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)),
    "adagrad": (
        psd.Adagrad(0.05, initial_accumulator=0.1, weight_decay=0.01),
        lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1,
                                       weight_decay=0.01)),
    "rmsprop": (
        psd.RMSprop(0.001),
        lambda ps: torch.optim.RMSprop(ps, lr=0.001)),
    "rmsprop_centered_momentum": (
        psd.RMSprop(0.001, alpha=0.9, epsilon=1e-6, momentum=0.9, centered=True,
                    weight_decay=0.01),
        lambda ps: torch.optim.RMSprop(ps, lr=0.001, alpha=0.9, eps=1e-6, momentum=0.9,
                                       centered=True, weight_decay=0.01)),
    "rmsprop_centered": (
        psd.RMSprop(0.001, centered=True),
        lambda ps: torch.optim.RMSprop(ps, lr=0.001, centered=True)),
    "rmsprop_momentum_decoupled": (
        psd.RMSprop(0.001, momentum=0.5, weight_decay=0.1, decoupled_weight_decay=True),
        None),  # torch has no decoupled RMSprop: checked against AdamW's rule below
    "sgd_nesterov_lr_scale": (
        psd.SGD(0.004, momentum=0.9, nesterov=True, weight_decay=0.01, lr_scale=0.5),
        lambda ps: torch.optim.SGD(ps, lr=0.004 * 0.5, momentum=0.9, nesterov=True,
                                   weight_decay=0.01)),
}


def _decoupled_rmsprop(ps):
    """torch's RMSprop after AdamW's decay step: w *= 1 - lr * wd first."""
    opt = torch.optim.RMSprop(ps, lr=0.001, momentum=0.5)

    def step():
        with torch.no_grad():
            for p in ps:
                p.mul_(1 - 0.001 * 0.1)
        opt.step()
    return step


def _inputs(seed=7):
    """Initial values of magnitude 2 to 3 (no element nears 0, so a
    relative error means something) and STEPS gradients of both signs."""
    rng = np.random.default_rng(seed)
    w0 = (rng.choice([-1.0, 1.0], N) * rng.uniform(2.0, 3.0, N)).astype(np.float32)
    grads = rng.normal(0.0, 1.0, (STEPS, N)).astype(np.float32)
    return w0, grads


def _torch_run(name, w0, grads):
    p = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    make = RULES[name][1]
    step = make([p]).step if make else _decoupled_rmsprop([p])
    for g in grads:
        p.grad = torch.from_numpy(g.copy())
        step()
    return p.detach().numpy()


def test_rules_match_torch_optim(start_psd):
    """Each rule as its own variable of one job: after 100 steps every
    element equals torch's to 1e-6 relative (only torch's fused
    multiply-adds round differently). Prints the largest error per rule."""
    w0, grads = _inputs()
    ps = start_psd(1)
    with psd.Client(hosts=hosts(ps), telemetry="off") as c:
        vs = {n: c.variable(n, (N,), optimizer=rule, values=w0) for n, (rule, _) in RULES.items()}
        assert c.pull() == 0
        for g in grads:
            for v in vs.values():
                v.grad[:] = g
            c.step()
        got = {n: v.data.copy() for n, v in vs.items()}
    worst, bad = {}, []
    for name in RULES:
        want = _torch_run(name, w0, grads)
        assert np.abs(want - w0).max() > 0.05, "%s barely moved: the test says nothing" % name
        assert np.abs(want).min() > 0.5, "%s: an element neared 0" % name
        rel = np.abs(got[name].astype(np.float64) - want) / np.abs(want)
        worst[name] = float(rel.max())
        if worst[name] > RTOL:
            i = int(rel.argmax())
            bad.append("%s: element %d is %.9g, torch %.9g" % (name, i, got[name][i], want[i]))
    print("max relative error vs torch.optim over %d steps: %s" % (STEPS, ", ".join(
        "%s %.2g" % kv for kv in worst.items())))
    assert not bad, bad
    assert ps[0].wait() == 0


class _Net(torch.nn.Module):
    """A linear layer, a norm layer and another linear layer: weights of 2
    dimensions, biases and norm scales and shifts of 1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc1 = torch.nn.Linear(6, 5)
        self.norm = torch.nn.LayerNorm(5)
        self.fc2 = torch.nn.Linear(5, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _train(model, step, steps=20):
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen)
        y = torch.randn(16, 2, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        step()


@pytest.mark.parametrize("how", ["no_decay", "function"])
def test_distributed_module_rules_per_parameter(start_psd, how):
    """no_decay=True leaves biases and the norm's parameters without weight
    decay, as torch.optim.AdamW with two param groups; a function of (name,
    parameter) gives each its rule, here lr_scale 0.1 for the biases, as a
    param group of a tenth of the lr."""
    ref = _Net()
    decay = [p for p in ref.parameters() if p.dim() > 1]
    rest = [p for p in ref.parameters() if p.dim() <= 1]
    if how == "no_decay":
        rule, extra = psd.AdamW(0.01, weight_decay=0.5), {"no_decay": True}
        topt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                                 lr=0.01, weight_decay=0.5)
    else:
        def rule(name, p):
            return psd.AdamW(0.01, weight_decay=0.5, lr_scale=0.1 if "bias" in name else 1.0)
        extra = {}
        biases = [p for n, p in ref.named_parameters() if "bias" in n]
        others = [p for n, p in ref.named_parameters() if "bias" not in n]
        topt = torch.optim.AdamW([{"params": others}, {"params": biases, "lr": 0.01 * 0.1}],
                                 lr=0.01, weight_decay=0.5)

    def tstep():
        topt.step()
        topt.zero_grad()
    _train(ref, tstep)
    ps = start_psd(1)
    with psd.Client(hosts=hosts(ps), telemetry="off") as c:
        net = _Net()
        model = psd.torch.DistributedModule(net, c, optimizer=rule, **extra)
        model.start()
        _train(model, model.step)
        for (n, p), q in zip(net.named_parameters(), ref.parameters()):
            np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5,
                                       atol=1e-6, err_msg=n)
    assert ps[0].wait() == 0


def test_distributed_module_rule_errors(start_psd):
    """no_decay with a torch.optim optimizer (its param groups do that) is
    a ValueError; a rule function that gives no psd.Optimizer is a
    TypeError naming the parameter; replace() of a field a rule lacks is a
    TypeError naming the fields it has."""
    ps = start_psd(1)
    with psd.Client(hosts=hosts(ps), telemetry="off") as c:
        net = _Net()
        with pytest.raises(ValueError, match="param groups"):
            psd.torch.DistributedModule(net, c, optimizer=torch.optim.SGD(net.parameters(), 0.1),
                                        no_decay=True)
        with pytest.raises(TypeError, match="fc1.weight"):
            psd.torch.DistributedModule(net, c, optimizer=lambda name, p: 0.1)
    with pytest.raises(TypeError, match="weight_decay"):
        psd.SGD(0.1).replace(betas=0.9)
    assert psd.AdamW().replace(weight_decay=0).weight_decay == 0.0
    ps[0].kill()


def test_old_server_refuses_new_rules_by_name(start_psd):
    """A psd of protocol 2.5 (--protocol-minor 5): the client refuses to
    send Adagrad, naming the rule and the server, before it registers."""
    ps = start_psd(1, "--protocol-minor", "5")
    with psd.Client(hosts=hosts(ps), telemetry="off") as c:
        with pytest.raises(psd.Unsupported, match=r"optimizer adagrad needs protocol 2\.6"):
            c.variable("a", (4,), optimizer=psd.Adagrad())
        with pytest.raises(psd.Unsupported, match="decoupled weight decay needs protocol 2.6"):
            c.variable("w", (4,), optimizer=psd.AdamW())
        c.variable("s", (4,), optimizer=psd.SGD(0.1))
    assert ps[0].wait() == 0
