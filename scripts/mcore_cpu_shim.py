"""Run megatron-core's real training and checkpoint code on a CPU, for fixtures.

Imported by ``scripts/make_megatron_fixtures.py`` inside a megatron-core venv
(never by statekit). megatron-core assumes a CUDA device; this module redirects
only device placement, CUDA streams/events/synchronisation and the CUDA RNG to
the CPU. What each redirect is, and why it changes no layout of what is saved:

* ``DeviceToCPU`` (a ``TorchFunctionMode``): every ``device=`` argument that
  names CUDA (``"cuda"``, ``"cuda:N"``, an int, a ``torch.device('cuda')``) and
  every ``tensor.to('cuda')`` / ``.cuda()`` is rewritten to the CPU. Shapes,
  dtypes, element order and the values computed are those Megatron asked for;
  only where the bytes live changes. ``pin_memory=True`` (page-locked host
  memory for faster copies to a GPU; RoPE's CP slicing asks for it) becomes
  False: the same tensor, not page-locked.
* ``torch.cuda.current_device`` returns 0 (then rewritten to the CPU by the
  mode); ``device_count`` returns 1 so that Megatron sets up its model-parallel
  RNG tracker as on a GPU; ``set_device`` does nothing.
* ``get_device_capability``/``get_device_properties`` describe an sm_90 device
  (H100): ``validate_args`` asks for the architecture only to decide whether to
  warn about ``CUDA_DEVICE_MAX_CONNECTIONS`` with tensor parallelism.
* Streams, events, ``synchronize``, ``empty_cache``, memory statistics: no-ops
  (on the CPU every op is already complete when it returns). They order work,
  never place or shape it.
* ``Tensor.type()`` with no argument answers ``torch.cuda.<T>Tensor`` for a CPU
  tensor: Megatron's optimizers check parameter types against the CUDA names
  (``distrib_optimizer.py``, ``optimizer.py``) before deciding which get fp32
  masters; the answer is the same dtype that a GPU run reports.
* CUDA RNG (``torch.cuda.manual_seed/get_rng_state/set_rng_state`` and
  Megatron's ``_get_cuda_rng_state``/``_set_cuda_rng_state``): served by one
  CPU ``torch.Generator`` kept here. Only random values (initialisation,
  dropout, which is 0 in the fixtures) depend on it; the saved ``rng_state``
  object has the same structure as on a GPU (a CPU generator's state bytes in
  the ``cuda_rng_state`` slot).
* ``typing.override`` (Python 3.12) is defined as the identity on 3.11, as
  ``typing_extensions.override`` does: megatron-core 0.19's wheel needs
  Python >= 3.12 only for this decorator in ``megatron/training/models``.

Nothing here touches what Megatron computes, names or writes.

One more, only for the context-parallel fixtures (``local_cp_attention``, called
by the fixture generator when a case sets ``--context-parallel-size``): the
local spec's ``DotProductAttention`` asserts ``context_parallel_size == 1``
("only supported by TEDotProductAttention"; TE's ring attention needs CUDA).
The shim builds it as if CP were 1, so each CP rank computes causal attention
over its own sequence chunks only, **not** the ring attention a TE run does
across the CP group: the activations, losses and gradients (hence the values
of the weights and moments) differ from a GPU run's. The model's parameters,
the DDP buffers and buckets, the distributed optimizer's sharding over the
DP x CP group and everything saved are built by Megatron's unchanged code from
the real ``context_parallel_size``: the optimizer layout does not depend on the
attention math. The manifest says so for each such case (``attention_math``).
"""

from __future__ import annotations

import contextlib
import types
import typing

if not hasattr(typing, "override"):  # Python 3.11: megatron 0.19 imports it

    def _override(f):
        try:
            f.__override__ = True
        except (AttributeError, TypeError):
            pass
        return f

    typing.override = _override

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

_CPU = torch.device("cpu")


def _is_cuda(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class DeviceToCPU(TorchFunctionMode):
    """Rewrite every CUDA device argument to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):  # page-locked host memory needs CUDA; same values unpinned
            kwargs["pin_memory"] = False
        name = getattr(func, "__name__", "")
        if name == "to" and args:
            args = tuple(_CPU if (i > 0 and _is_cuda(a)) else a for i, a in enumerate(args))
        elif name == "cuda":
            return args[0]
        return func(*args, **kwargs)


class _NullStream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _NullEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


_RNG = torch.Generator()
_RNG.manual_seed(0)
_ORIG_TYPE = torch.Tensor.type


def _tensor_type(self, *args, **kwargs):
    out = _ORIG_TYPE(self, *args, **kwargs)
    if not args and not kwargs and isinstance(out, str) and out.startswith("torch.") and not out.startswith("torch.cuda."):
        return "torch.cuda." + out[len("torch."):]
    return out


def install() -> DeviceToCPU:
    """Apply every redirect; return the (entered) device mode."""
    c = torch.cuda
    c.current_device = lambda: 0
    c.device_count = lambda: 1
    c.set_device = lambda *a, **k: None
    c.get_device_capability = lambda *a, **k: (9, 0)
    c.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=9, minor=0, name="cpu (mcore_cpu_shim)", total_memory=80 << 30,
        multi_processor_count=132)
    c.synchronize = lambda *a, **k: None
    c.empty_cache = lambda *a, **k: None
    c.Stream = _NullStream
    c.Event = _NullEvent
    c.current_stream = lambda *a, **k: _NullStream()
    c.default_stream = lambda *a, **k: _NullStream()
    c.set_stream = lambda *a, **k: None
    c.stream = lambda *a, **k: contextlib.nullcontext()
    c.memory_stats = lambda *a, **k: {}
    c.memory_allocated = lambda *a, **k: 0
    c.max_memory_allocated = lambda *a, **k: 0
    c.memory_reserved = lambda *a, **k: 0
    c.max_memory_reserved = lambda *a, **k: 0
    c.reset_peak_memory_stats = lambda *a, **k: None
    c.manual_seed = lambda seed: _RNG.manual_seed(int(seed))
    c.manual_seed_all = lambda seed: _RNG.manual_seed(int(seed))
    c.get_rng_state = lambda *a, **k: _RNG.get_state()
    c.set_rng_state = lambda state, *a, **k: _RNG.set_state(state)
    c.random.get_rng_state = c.get_rng_state
    c.random.set_rng_state = c.set_rng_state
    torch.Tensor.type = _tensor_type
    torch.Tensor.cuda = lambda self, *a, **k: self

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: _RNG.get_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: _RNG.set_state(state)

    mode = DeviceToCPU()
    mode.__enter__()
    return mode


def local_cp_attention() -> None:
    """Let the local spec's DotProductAttention be built under context parallelism (see the
    module docstring: attention within each CP rank's own chunk; the layout is unchanged)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    orig = DotProductAttention.__init__

    def init(self, config, *a, **k):
        cp = config.context_parallel_size
        config.context_parallel_size = 1  # the assert only; reset before anything else reads it
        try:
            orig(self, config, *a, **k)
        finally:
            config.context_parallel_size = cp

    DotProductAttention.__init__ = init
