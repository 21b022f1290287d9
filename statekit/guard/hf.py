"""The resume guard for the transformers ``Trainer``: ``ResumeGuardCallback``.

``trainer = Trainer(..., callbacks=[ResumeGuardCallback()])``. At every save it writes the
fingerprint into the checkpoint folder (``checkpoint-N/statekit-guard.json``, after the Trainer
wrote ``optimizer.pt`` and ``scheduler.pt``); at the start of a resumed ``train()`` (after the
Trainer loaded, or silently skipped, the optimizer and scheduler) it checks them against the
fingerprint of ``output_dir/checkpoint-<global step>``, or of ``checkpoint`` when the run resumes
from a folder elsewhere. A checkpoint without a fingerprint (saved before the guard) is warned
about, not checked.
"""

from __future__ import annotations

import os
import warnings

from transformers import TrainerCallback

from statekit import guard
from statekit.errors import UsageError


class ResumeGuardCallback(TrainerCallback):
    def __init__(self, checkpoint: str | os.PathLike | None = None, *, expect: str = "state",
                 on_problem: str = "raise", allow: tuple[str, ...] = ()):
        if expect not in guard.EXPECTS:
            raise UsageError(f"expect={expect!r}: say 'state' (a full resume) or 'fresh' (weights only)")
        self.checkpoint = None if checkpoint is None else os.fspath(checkpoint)
        self.expect, self.on_problem, self.allow = expect, on_problem, tuple(allow)
        self.report: guard.Report | None = None

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if optimizer is not None and os.path.isdir(folder):
            guard.save_fingerprint(optimizer, folder, scheduler=lr_scheduler, model=model)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self.checkpoint is None and not state.global_step:
            return  # a fresh start: nothing was loaded
        folder = self.checkpoint or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.exists(guard.fingerprint_path(folder)):
            warnings.warn(f"{folder}: no statekit guard fingerprint (saved without ResumeGuardCallback): the "
                          "resume is not checked", guard.ResumeWarning, stacklevel=2)
            return
        self.report = guard.check_resume(optimizer, folder, scheduler=lr_scheduler, model=model, expect=self.expect,
                                         on_problem=self.on_problem, allow=self.allow)
