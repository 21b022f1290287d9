"""statekit: see, move and replay optimizer state (burn, PyTorch, candle/safetensors).

The Python API (:mod:`statekit.api`) mirrors the command line: ``statekit.open``,
``statekit.inspect``, ``statekit.convert``, ``statekit.remap``, ``statekit.diff``,
``statekit.merge``, ``statekit.split``, ``statekit.fit``, ``statekit.doctor``, ``statekit.report``, ``statekit.verify_resume``, ``statekit.replay``; the compute core is
``statekit.optim``. Nothing heavy is imported until used.
"""

__version__ = "0.1.0"

_API = ("open", "inspect", "convert", "remap", "diff", "merge", "split", "fit", "doctor", "report", "verify_resume", "replay")
__all__ = [*_API, "__version__"]


def __getattr__(name: str):
    if name in _API:
        from statekit import api

        return getattr(api, name)
    raise AttributeError(f"module 'statekit' has no attribute {name!r}")
