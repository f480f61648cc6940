"""psrun puts this directory first on its workers' PYTHONPATH: a script
that imports torch.distributed then finds the backend "psd" registered,
so that init_process_group("psd") is the only line a DDP script changes
(torch 1.13 knows a third-party backend only once its module is imported,
and nothing in the script would import psd).

It installs an import hook and nothing else: torch and psd are imported
by the script's own `import torch.distributed` (the hook registers the
backend right after that module has run). Then it runs the
sitecustomize it shadows, if the environment has one."""
import importlib
import importlib.abc
import importlib.util
import os
import sys


def _register() -> None:
    try:
        from psd import c10d
        c10d.register()
    except Exception as e:  # noqa: BLE001 (the script may not want psd at all)
        print("psd: could not register the torch.distributed backend \"psd\" (%s: %s); "
              "`import psd.torch` in the script says more" % (type(e).__name__, e),
              file=sys.stderr)


class _AfterTorchDistributed(importlib.abc.MetaPathFinder):
    """Finds torch.distributed with the other finders and registers the
    backend once its module has run."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch.distributed":
            return None
        sys.meta_path.remove(self)  # once; the others find it
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


def _chain() -> None:
    """Imports the next sitecustomize on the path (this one shadows it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved_path, saved_mod = list(sys.path), sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        importlib.import_module("sitecustomize")
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved_path
        if "sitecustomize" not in sys.modules and saved_mod is not None:
            sys.modules["sitecustomize"] = saved_mod


if os.environ.get("PS_HOSTS") and "torch.distributed" not in sys.modules:
    sys.meta_path.insert(0, _AfterTorchDistributed())
_chain()
