"""Import Megatron-Bridge 0.6.2's training modules on Python 3.11 / CPU (work in progress, issue 35 item 1).

Imported by the (not yet written) Bridge fixture generator inside a megatron-core 0.19.2 venv, after
``mcore_cpu_shim.install()``; never by statekit (used by ``make_megatron_bridge_fixtures.py``, which adds the
training-loop patches). ``megatron.bridge.training.checkpointing`` (and with it ``training.config``,
``training.state``) imports with what follows.

Bridge's wheel declares Python >= 3.12 and, among others, Transformer Engine, flashinfer, nvidia-resiliency-ext,
datasets, wandb. Its modules compile on 3.11 (``py_compile`` of training/{checkpointing,state,config,pretrain,
train,setup,initialize,gpt_step,optim}.py and models/gpt_provider.py). The wheel is unzipped (``pip download
megatron-bridge==0.6.2 --no-deps --python-version 3.12 --only-binary=:all:``, then ``unzip``) and put on
``megatron.__path__``; the few pure-Python packages Bridge's checkpoint path imports are installed with
``pip install --target EXTRA --no-deps``: omegaconf, hydra-core, antlr4-python3-runtime, nvidia-modelopt 0.47.0
(the real one: ``save_sharded_modelopt_state`` runs on every save and writes nothing for a model with no
ModelOpt state), einops, requests, urllib3, certifi, pulp, scipy, pillow, tensorboard, protobuf, absl-py.

What stands in for what, and why none of it changes what a save writes:

* **Package ``__init__`` files not run** (``EMPTY``): ``megatron.bridge``, ``.models`` (but for the two
  providers ``training/config.py`` imports from it, ``GPTModelProvider`` and ``T5ModelProvider``, re-exported
  from their own modules), ``.peft``, ``.models.conversion``, ``.models.hf_pretrained``. They only re-export,
  and import every model bridge / LoRA layer (Transformer Engine, HF modelling files of transformers <= 5.12).
  The submodules themselves load from the wheel unchanged.
* **``nvidia_resiliency_ext.inprocess.CallWrapper``**: an empty class. ``pretrain.py`` names it in a type
  annotation; in-process restart, fault tolerance and NVRx async saves are off.
* **``datasets``, ``megatron.energon``**: modules whose every attribute raises when called. Only the HF-SFT and
  Energon data builders use them; a mock GPT dataset uses neither.
* **``megatron.bridge.models.conversion.peft_bridge``**: any attribute is an empty class (as in
  ``make_megatron_bridge_reference.py``): its LoRA half needs Transformer Engine; never called.

"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

EMPTY = {
    "megatron.bridge",
    "megatron.bridge.models",
    "megatron.bridge.peft",
    "megatron.bridge.models.conversion",
    "megatron.bridge.models.hf_pretrained",
}


class _EmptyPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The packages in EMPTY, with their directory as search path and their ``__init__`` not run."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, name, path, target=None):
        if name not in EMPTY:
            return None
        d = os.path.join(self.root, *name.split("."))
        if not os.path.exists(os.path.join(d, "__init__.py")):
            return None
        spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
        spec.submodule_search_locations = [d]
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        if module.__name__ == "megatron.bridge.models":  # the two names training/config.py imports from it
            from megatron.bridge.models.gpt_provider import GPTModelProvider
            from megatron.bridge.models.t5_provider import T5ModelProvider

            module.GPTModelProvider, module.T5ModelProvider = GPTModelProvider, T5ModelProvider


class _Unused(types.ModuleType):
    """A module whose every attribute raises when called (a dependency of a code path never taken)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def _never(*a, **k):
            raise RuntimeError(f"{self.__name__}.{name} is a stand-in and must not be called")

        return _never


class _Anything(types.ModuleType):
    """A module whose every attribute is an empty class (Bridge's LoRA half, never called)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def install(bridge_root: str) -> None:
    """Make ``megatron.bridge`` importable from the unzipped wheel at ``bridge_root``."""
    sys.meta_path.insert(0, _EmptyPackages(bridge_root))
    import megatron

    megatron.__path__.append(os.path.join(bridge_root, "megatron"))
    nvrx = types.ModuleType("nvidia_resiliency_ext")
    nvrx.__path__ = []
    inprocess = types.ModuleType("nvidia_resiliency_ext.inprocess")
    inprocess.CallWrapper = type("CallWrapper", (), {})
    sys.modules["nvidia_resiliency_ext"] = nvrx
    sys.modules["nvidia_resiliency_ext.inprocess"] = inprocess
    for name in ("datasets", "megatron.energon"):
        mod = _Unused(name)
        mod.__path__ = []
        sys.modules[name] = mod
    name = "megatron.bridge.models.conversion.peft_bridge"
    sys.modules[name] = _Anything(name)


if __name__ == "__main__":  # python scripts/bridge_cpu_imports.py BRIDGE_ROOT: how far the import gets
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mcore_cpu_shim

    mcore_cpu_shim.install()
    install(sys.argv[1])
    import megatron.bridge.training.checkpointing  # noqa: F401

    print("megatron.bridge.training.checkpointing imported")
