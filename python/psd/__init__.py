"""psd: Python front end of the psd parameter server.

Workers written in Python (NumPy, or PyTorch through psd.torch) talk to
the same psd servers as C workers, launched the same way::

    psrun --local -n 3 --ps 1 -- python3 train.py        # one machine
    srun --ntasks=4 psrun --ps=1 python3 train.py         # Slurm

A minimal worker::

    import psd
    with psd.Client.from_env() as client:
        w = client.variable("w", (784, 10), init=psd.GlorotUniform(seed=1),
                            optimizer=psd.SGD(lr=0.1, momentum=0.9))
        step = client.pull()                 # 0, or where a resumed job is
        while step < 1000:
            w.grad[:] = gradient(w.data, batch(step))
            step = client.step()             # push, then the next parameters

Client, Variable, Table and Request wrap the C library (libpsclient)
through ctypes; every error raises a subclass of psd.Error named after its
PS_E* code; psd.Stopped means the job stopped after a checkpoint (exit
75, and run it again to resume). See docs/python.md.
"""
from ._version import VERSION as __version__
from ._lib import lib as _clib
from .client import Client, Request, Variable
from .config import (SGD, Adagrad, Adam, AdamW, Constant, Cosine, ExponentialDecay,
                     GlorotNormal, GlorotUniform, Init, Mean, Normal, NotTrainable, Optimizer,
                     RMSprop, Schedule, StepDecay, TableAdagrad, TableAdam, TableFTRL,
                     TableOptimizer, TableSGD, TruncatedNormal, Uniform, Warmup, Zeros)
from .errors import *  # noqa: F401,F403  (Error and one class per PS_E* code)
from .errors import Error, Stopped
from .table import Table

#: Exit status of a worker that stopped on request after a checkpoint.
EXIT_STOPPED = 75

library_path = _clib.path  # the libpsclient this package loaded
library_version = _clib.ps_version().decode()  # its ps_version(), "0.2.6"
