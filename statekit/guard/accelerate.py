"""The resume guard for Accelerate: its save/load state hooks.

``handle = guard_accelerator(accelerator)`` after ``prepare``. ``accelerator.save_state(dir)``
then writes the fingerprint of the prepared optimizers and schedulers into ``dir`` (through
``register_save_state_pre_hook``; the state it describes is the one saved); ``accelerator.load_state
(dir)`` records ``dir`` (``register_load_state_pre_hook``) and, once the load returned, checks the
live optimizers and schedulers against it. Accelerate has no hook after a load, so the guard wraps
this accelerator's ``load_state``; ``handle.remove()`` undoes all three.
"""

from __future__ import annotations

import os

from statekit import guard


class AcceleratorGuard:
    def __init__(self, accelerator, *, expect: str = "state", on_problem: str = "raise", allow: tuple[str, ...] = ()):
        self.accelerator = accelerator
        self.expect, self.on_problem, self.allow = expect, on_problem, tuple(allow)
        self.loaded_from: str | None = None
        self.report: guard.Report | None = None
        self._handles = [accelerator.register_save_state_pre_hook(self._save),
                         accelerator.register_load_state_pre_hook(self._load)]
        self._original = accelerator.load_state
        accelerator.load_state = self._load_state

    def _save(self, models, weights, output_dir):
        acc = self.accelerator
        guard.save_fingerprint(acc._optimizers, output_dir, scheduler=acc._schedulers, model=acc._models)

    def _load(self, models, input_dir):
        self.loaded_from = os.fspath(input_dir)

    def _load_state(self, *args, **kwargs):
        out = self._original(*args, **kwargs)
        acc = self.accelerator
        self.report = guard.check_resume(acc._optimizers, self.loaded_from, scheduler=acc._schedulers,
                                         model=acc._models, expect=self.expect, on_problem=self.on_problem,
                                         allow=self.allow)
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self.accelerator.load_state = self._original


def guard_accelerator(accelerator, **options) -> AcceleratorGuard:
    """Fingerprint at every ``save_state``, check after every ``load_state`` (options: :func:`statekit.guard.check_resume`'s)."""
    return AcceleratorGuard(accelerator, **options)
