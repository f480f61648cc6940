"""Optimizers, learning-rate schedules and initializers: small classes
that fill the C library's sized structs (ps_optimizer, ps_init,
ps_table_config). Defaults come from the library's own init functions, so
there is one place that decides them."""
import copy
from typing import Optional

from . import _lib
from ._lib import lib

# Enum values of psclient.h.
_OPT_SGD, _OPT_MOMENTUM, _OPT_ADAM, _OPT_NONE, _OPT_MEAN, _OPT_ADAGRAD, _OPT_RMSPROP = range(7)
_DECAY_NONE, _DECAY_EXP, _DECAY_STEP, _DECAY_COSINE = 0, 1, 2, 3
# ps_average: the moving averages the servers keep (psd 0.2.7).
_AVERAGES = {None: 0, "none": 0, "ema": 1, "ema_num_updates": 2, "polyak": 3}
_TOPT = {"sgd": 0, "adagrad": 1, "adam": 2, "ftrl": 3}


def count(name: str, value, limit: int = 2**64 - 1) -> int:
    """``value`` as an integer in [0, limit]; ValueError naming ``name``
    otherwise (ctypes would wrap a negative number silently)."""
    v = int(value)
    if v != value or not 0 <= v <= limit:
        raise ValueError("%s must be an integer in [0, %d], got %r" % (name, limit, value))
    return v


# ---------------------------------------------------------------- schedules

class Schedule:
    """A learning-rate schedule run on the servers (ps_optimizer.decay).
    ``warmup_steps``: linear warm-up first, with any schedule."""

    def __init__(self, warmup_steps: int = 0):
        self.warmup_steps = count("warmup_steps", warmup_steps)

    def _fill(self, o):
        o.warmup_steps = self.warmup_steps

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__,
                           ", ".join("%s=%r" % kv for kv in vars(self).items()))


class Warmup(Schedule):
    """Only the linear warm-up: lr * (step + 1) / steps until ``steps``."""

    def __init__(self, steps: int):
        super().__init__(steps)


class ExponentialDecay(Schedule):
    """lr * rate ** (step / steps)."""
    _kind = _DECAY_EXP

    def __init__(self, rate: float, steps: int, warmup_steps: int = 0):
        super().__init__(warmup_steps)
        self.rate, self.steps = float(rate), count("steps", steps)

    def _fill(self, o):
        super()._fill(o)
        o.decay, o.decay_rate, o.decay_steps = self._kind, self.rate, self.steps


class StepDecay(ExponentialDecay):
    """lr * rate ** floor(step / steps) (staircase)."""
    _kind = _DECAY_STEP


class Cosine(Schedule):
    """From lr at the end of the warm-up down to lr * min_lr_factor at
    ``total_steps`` along a half cosine, constant after."""

    def __init__(self, total_steps: int, warmup_steps: int = 0, min_lr_factor: float = 0.0):
        super().__init__(warmup_steps)
        self.total_steps = count("total_steps", total_steps)
        self.min_lr_factor = float(min_lr_factor)

    def _fill(self, o):
        super()._fill(o)
        o.decay, o.total_steps, o.min_lr_factor = _DECAY_COSINE, self.total_steps, \
            self.min_lr_factor


# --------------------------------------------------------------- optimizers

class Optimizer:
    """An update rule the servers run per variable (ps_optimizer). The
    servers check the values when the variable is created.

    Every rule takes ``weight_decay`` (L2 added to the gradient, or with
    ``decoupled_weight_decay=True`` w -= lr * weight_decay * w before the
    rule, as torch.optim.AdamW; needs psd 0.2.6) and ``lr_scale``, this
    variable's multiplier of the (scheduled) learning rate (0.2.6 unless
    1). ``replace(weight_decay=0.0)`` gives a copy with fields changed: one
    rule per variable, such as no decay for biases.

    ``average`` keeps a moving average of the parameters on the servers
    (psd 0.2.7), read by Client.pull_average and
    DistributedModule.averaged() for evaluation: ``"ema"`` (a = d*a +
    (1-d)*w with d = ``average_decay``), ``"ema_num_updates"``
    (TensorFlow's form: d = min(average_decay, (1+t)/(10+t)) at step t) or
    ``"polyak"`` (the mean of the parameters after each step); None (the
    default) keeps none. It starts at the initial values and costs the
    training steps no traffic."""
    _kind = _OPT_SGD

    def __init__(self, lr: float, weight_decay: float = 0.0,
                 schedule: Optional[Schedule] = None, *, decoupled_weight_decay: bool = False,
                 lr_scale: float = 1.0, average: Optional[str] = None,
                 average_decay: float = 0.999):
        self.lr, self.weight_decay, self.schedule = float(lr), float(weight_decay), schedule
        self.decoupled_weight_decay, self.lr_scale = bool(decoupled_weight_decay), float(lr_scale)
        if average not in _AVERAGES:
            raise ValueError("average must be None, 'ema', 'ema_num_updates' or 'polyak', "
                             "got %r" % (average,))
        self.average, self.average_decay = average, float(average_decay)

    def replace(self, **changes) -> "Optimizer":
        """A copy with the attributes named changed (``weight_decay=0.0``,
        ``lr_scale=0.1``); an attribute it lacks is a TypeError."""
        new = copy.copy(self)
        for k, v in changes.items():
            if k not in vars(self):
                raise TypeError("%s has no field %r (it has %s)"
                                % (type(self).__name__, k, ", ".join(sorted(vars(self)))))
            old = getattr(self, k)
            setattr(new, k, bool(v) if isinstance(old, bool) else
                    float(v) if isinstance(old, float) else v)
        return new

    def _struct(self):
        o = _lib.sized(_lib.Optimizer, lib.ps_optimizer_default_sized, self.lr)
        o.kind, o.weight_decay = self._kind, self.weight_decay
        o.decoupled_weight_decay, o.lr_scale = int(self.decoupled_weight_decay), self.lr_scale
        if self.average not in _AVERAGES:  # set through replace()
            raise ValueError("average must be None, 'ema', 'ema_num_updates' or 'polyak', "
                             "got %r" % (self.average,))
        o.average = _AVERAGES[self.average]
        o.average_decay = self.average_decay if o.average else 0.0
        if self.schedule is not None:
            self.schedule._fill(o)
        return o

    def __repr__(self):
        return "%s(%s)" % (type(self).__name__,
                           ", ".join("%s=%r" % kv for kv in vars(self).items()))


class SGD(Optimizer):
    """w -= lr * g; with momentum m: v = m*v + g, w -= lr * v (Nesterov:
    w -= lr * (g + m*v))."""

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0, schedule: Optional[Schedule] = None, **kw):
        super().__init__(lr, weight_decay, schedule, **kw)
        self.momentum, self.nesterov = float(momentum), bool(nesterov)

    def _struct(self):
        o = super()._struct()
        if self.momentum or self.nesterov:
            o.kind, o.momentum, o.nesterov = _OPT_MOMENTUM, self.momentum, int(self.nesterov)
        return o


class Adam(Optimizer):
    """Adam, bias-corrected: TensorFlow's epsilon-hat form, or with
    ``torch_epsilon=True`` epsilon where torch.optim.Adam puts it,
    m_hat / (sqrt(v_hat) + epsilon) (needs psd 0.2.6)."""
    _kind = _OPT_ADAM

    def __init__(self, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, weight_decay: float = 0.0,
                 schedule: Optional[Schedule] = None, torch_epsilon: bool = False, **kw):
        super().__init__(lr, weight_decay, schedule, **kw)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        self.torch_epsilon = bool(torch_epsilon)

    def _struct(self):
        o = super()._struct()
        o.beta1, o.beta2, o.epsilon = self.beta1, self.beta2, self.epsilon
        o.torch_epsilon = int(self.torch_epsilon)
        return o


class AdamW(Adam):
    """torch.optim.AdamW on the servers: Adam with decoupled weight decay
    (w -= lr * weight_decay * w first) and PyTorch's epsilon, with torch's
    defaults (needs psd 0.2.6)."""

    def __init__(self, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8, weight_decay: float = 0.01,
                 schedule: Optional[Schedule] = None, torch_epsilon: bool = True, **kw):
        kw.setdefault("decoupled_weight_decay", True)
        super().__init__(lr, beta1, beta2, epsilon, weight_decay, schedule, torch_epsilon, **kw)


class Adagrad(Optimizer):
    """torch.optim.Adagrad on the servers: a += g*g (a starts at
    ``initial_accumulator``), w -= lr * g / (sqrt(a) + epsilon); torch's
    defaults (needs psd 0.2.6)."""
    _kind = _OPT_ADAGRAD

    def __init__(self, lr: float = 0.01, initial_accumulator: float = 0.0,
                 epsilon: float = 1e-10, weight_decay: float = 0.0,
                 schedule: Optional[Schedule] = None, **kw):
        super().__init__(lr, weight_decay, schedule, **kw)
        self.initial_accumulator, self.epsilon = float(initial_accumulator), float(epsilon)

    def _struct(self):
        o = super()._struct()
        o.initial_accumulator, o.epsilon = self.initial_accumulator, self.epsilon
        return o


class RMSprop(Optimizer):
    """torch.optim.RMSprop on the servers: s = alpha*s + (1-alpha)*g*g,
    d = sqrt(s) + epsilon (``centered``: sqrt(s - mean(g)^2) + epsilon);
    w -= lr * g / d, or with ``momentum`` b = momentum*b + g/d, w -= lr*b;
    torch's defaults (needs psd 0.2.6)."""
    _kind = _OPT_RMSPROP

    def __init__(self, lr: float = 0.01, alpha: float = 0.99, epsilon: float = 1e-8,
                 momentum: float = 0.0, centered: bool = False, weight_decay: float = 0.0,
                 schedule: Optional[Schedule] = None, **kw):
        super().__init__(lr, weight_decay, schedule, **kw)
        self.alpha, self.epsilon, self.momentum = float(alpha), float(epsilon), float(momentum)
        self.centered = bool(centered)

    def _struct(self):
        o = super()._struct()
        o.alpha, o.epsilon, o.momentum = self.alpha, self.epsilon, self.momentum
        o.centered = int(self.centered)
        return o


class NotTrainable(Optimizer):
    """No gradients: the values change only by the chief's assign
    (batch-norm statistics, counters)."""
    _kind = _OPT_NONE

    def __init__(self):
        super().__init__(1.0)


# ps_aggregate: which gradients complete a step (psd 0.2.8).
_AGGREGATES = {"job": 0, "all": 1, "first": 2}


class Mean(Optimizer):
    """No update rule: at each step the servers average the workers'
    gradients and the variable's value becomes that mean (PS_OPT_MEAN,
    needs psd 0.2.5), times ``scale`` (the number of workers gives the
    sum). For optimizers that run on the workers: push a gradient in
    ``grad``, and after step() ``data`` holds the mean.

    ``aggregate`` (psd 0.2.8) says which gradients complete a step:
    ``"job"`` (the job's replicas_to_aggregate: with backup workers the
    first N - K), ``"all"`` (every worker's, backups or not) or ``"first"``
    (the first alone: one worker pushes, the others only pull)."""
    _kind = _OPT_MEAN

    def __init__(self, scale: float = 1.0, aggregate: str = "job"):
        super().__init__(1.0)
        if aggregate not in _AGGREGATES:
            raise ValueError("aggregate must be 'job', 'all' or 'first', got %r" % (aggregate,))
        self.scale = float(scale)
        self.aggregate = aggregate

    def _struct(self):
        o = super()._struct()
        o.mean_scale = self.scale
        o.aggregate = _AGGREGATES[self.aggregate]
        return o


# ------------------------------------------------------------- initializers

class Init:
    """How the chief initializes a variable (or a table row), seeded:
    the seed is combined with the variable's name."""
    _kind = 0

    def __init__(self, a: float = 0.0, b: float = 0.0, seed: int = 0):
        self.a, self.b, self.seed = float(a), float(b), count("seed", seed)

    def _struct(self):
        s = _lib.sized(_lib.Init, lib.ps_init_init_sized)
        s.kind, s.a, s.b, s.seed = self._kind, self.a, self.b, self.seed
        return s

    def __repr__(self):
        return "%s(a=%r, b=%r, seed=%r)" % (type(self).__name__, self.a, self.b, self.seed)


class Zeros(Init):
    """Every element 0."""

    def __init__(self, seed: int = 0):
        super().__init__(seed=seed)


class Constant(Init):
    """Every element ``value``."""
    _kind = 1

    def __init__(self, value: float, seed: int = 0):
        super().__init__(value, 0.0, seed)


class Uniform(Init):
    """U[low, high)."""
    _kind = 2

    def __init__(self, low: float = -0.05, high: float = 0.05, seed: int = 0):
        super().__init__(low, high, seed)


class Normal(Init):
    """N(mean, std)."""
    _kind = 3

    def __init__(self, mean: float = 0.0, std: float = 0.05, seed: int = 0):
        super().__init__(mean, std, seed)


class TruncatedNormal(Normal):
    """N(mean, std), redrawn beyond two standard deviations."""
    _kind = 4


class GlorotUniform(Init):
    """U(+-sqrt(6 / (fan_in + fan_out))); fans from the shape (last dim is
    fan_out), as TensorFlow does."""
    _kind = 5

    def __init__(self, seed: int = 0):
        super().__init__(seed=seed)


class GlorotNormal(GlorotUniform):
    """Truncated N(0, sqrt(2 / (fan_in + fan_out)))."""
    _kind = 6


# ------------------------------------------------------------ table rules

class TableOptimizer:
    """A per-row update rule of a sparse table (ps_table_config.opt).
    ``schedule`` (psd 0.2.8): a learning-rate schedule over the table's
    step, as a variable's (Warmup, ExponentialDecay, StepDecay, Cosine);
    not for TableFTRL, whose rate is per element."""
    _rule = "sgd"

    def __init__(self, lr: float, schedule: Optional[Schedule] = None, **fields):
        if schedule is not None and not isinstance(schedule, Schedule):
            raise TypeError("schedule must be a psd schedule (psd.Cosine(...), "
                            "psd.StepDecay(...)), got %r" % (schedule,))
        self.lr, self.fields = float(lr), {k: float(v) for k, v in fields.items()}
        self.schedule = schedule

    def _fill(self, cfg):
        cfg.opt, cfg.lr = _TOPT[self._rule], self.lr
        for k, v in self.fields.items():
            setattr(cfg, k, v)
        if self.schedule is not None:
            self.schedule._fill(cfg)

    def __repr__(self):
        extra = "".join(", %s=%r" % kv for kv in self.fields.items())
        if self.schedule is not None:
            extra += ", schedule=%r" % (self.schedule,)
        return "%s(lr=%r%s)" % (type(self).__name__, self.lr, extra)


class TableSGD(TableOptimizer):
    """w -= lr * g, per row."""


class TableAdagrad(TableOptimizer):
    """Adagrad per row; ``initial_accumulator`` (0.1), ``epsilon``."""
    _rule = "adagrad"

    def __init__(self, lr: float, initial_accumulator: float = 0.1, epsilon: float = 0.0,
                 schedule: Optional[Schedule] = None):
        super().__init__(lr, schedule, initial_accumulator=initial_accumulator, epsilon=epsilon)


class TableAdam(TableOptimizer):
    """Lazy Adam: a row's moments advance only when it gets a gradient."""
    _rule = "adam"

    def __init__(self, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 0.0, schedule: Optional[Schedule] = None):
        super().__init__(lr, schedule, beta1=beta1, beta2=beta2, epsilon=epsilon)


class TableFTRL(TableOptimizer):
    """FTRL-proximal per element (l1, l2, ftrl_beta)."""
    _rule = "ftrl"

    def __init__(self, lr: float, l1: float = 0.0, l2: float = 0.0, ftrl_beta: float = 1.0):
        super().__init__(lr, None, l1=l1, l2=l2, ftrl_beta=ftrl_beta)


def init_struct(init: Optional[Init]):
    """The ps_init of ``init`` (None: the library's default, zeros)."""
    if init is None:
        return _lib.sized(_lib.Init, lib.ps_init_init_sized)
    if not isinstance(init, Init):
        raise TypeError("init must be a psd initializer (psd.Zeros(), psd.Normal(...)), "
                        "got %r" % (init,))
    return init._struct()


def optimizer_struct(opt: Optional[Optimizer]):
    """The ps_optimizer of ``opt`` (None: SGD at lr 0.01, as in C)."""
    if opt is None:
        return _lib.sized(_lib.Optimizer, lib.ps_optimizer_default_sized, 0.01)
    if not isinstance(opt, Optimizer):
        raise TypeError("optimizer must be a psd optimizer (psd.SGD(lr), psd.Adam()), "
                        "got %r" % (opt,))
    return opt._struct()


def table_struct(dim, capacity, optimizer, init, admit_count, admit_prob,
                 evict_after_steps):
    """The ps_table_config of a table (the library checks the values)."""
    cfg = _lib.sized(_lib.TableConfig, lib.ps_table_config_init_sized)
    cfg.dim = count("dim", dim, 2**32 - 1)
    cfg.capacity = count("capacity", capacity)
    if init is not None:
        cfg.init = init_struct(init)
    if optimizer is not None:
        if not isinstance(optimizer, TableOptimizer):
            raise TypeError("a table's optimizer is a psd.TableSGD, TableAdagrad, TableAdam "
                            "or TableFTRL, got %r" % (optimizer,))
        optimizer._fill(cfg)
    cfg.admit_count = count("admit_count", admit_count, 2**32 - 1)
    cfg.admit_prob = float(admit_prob)
    cfg.evict_after_steps = count("evict_after_steps", evict_after_steps)
    return cfg

