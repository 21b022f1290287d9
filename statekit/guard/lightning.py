"""The resume guard for Lightning: ``ResumeGuard``, a ``Callback``.

``Trainer(callbacks=[ResumeGuard()])``. Lightning builds each checkpoint as one dict, so the
fingerprint travels inside it (under ``"statekit_guard"``, written by ``on_save_checkpoint`` with the
optimizer states of that moment) instead of in a file beside it. ``on_load_checkpoint`` takes it
back; ``on_train_start``, after Lightning restored the optimizers and LR schedulers, checks them.
Tested with lightning 2.6 (``tests/test_guard.py``, in a venv that has it).
"""

from __future__ import annotations

import warnings

from lightning.pytorch import Callback

from statekit import guard

KEY = "statekit_guard"


class ResumeGuard(Callback):
    def __init__(self, *, expect: str = "state", on_problem: str = "raise", allow: tuple[str, ...] = ()):
        self.expect, self.on_problem, self.allow = expect, on_problem, tuple(allow)
        self.saved: dict | None = None
        self.report: guard.Report | None = None

    @staticmethod
    def _live(trainer):
        return trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs]

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        optimizers, schedulers = self._live(trainer)
        checkpoint[KEY] = guard.fingerprint(optimizers, scheduler=schedulers, model=pl_module)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        self.saved = checkpoint.get(KEY)
        if self.saved is None:
            warnings.warn("the checkpoint holds no statekit guard fingerprint (saved without ResumeGuard): the "
                          "resume is not checked", guard.ResumeWarning, stacklevel=2)

    def on_train_start(self, trainer, pl_module):
        if self.saved is None:
            return
        optimizers, schedulers = self._live(trainer)
        saved, self.saved = self.saved, None
        self.report = guard.check_fingerprint(saved, optimizers, scheduler=schedulers, model=pl_module,
                                              expect=self.expect, on_problem=self.on_problem, allow=self.allow,
                                              where=trainer.ckpt_path or "the checkpoint")
