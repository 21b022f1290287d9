"""The resume guard: catch optimizer state lost or misplaced at the moment a run resumes.

At save, :func:`save_fingerprint` writes a small JSON file beside the checkpoint: per parameter
its name, shape, step and, for every state tensor, a few statistics and a digest of
:data:`SAMPLE` elements taken at fixed positions; each param group's hyperparameters and members;
the LR scheduler's position. Right after the load, :func:`check_resume` fingerprints the live
optimizer (and scheduler) the same way and compares: state that is empty or all zero where it
was not, steps reset or changed, groups reordered or with another lr, and a parameter holding
the state saved for another one (its digest is the other's). It raises :class:`ResumeError`
naming the parameters (or warns, ``on_problem="warn"``). ``expect="fresh"`` checks the opposite
intent: a weights-only resume after which the optimizer holds state anyway.

Parameters are named from ``model`` (``named_parameters()``), else from the groups'
``param_names`` (torch >= 2.6 with named parameters), else by position (``#3``): without names,
a changed order cannot be seen, only lost or reset state.

Ready-made: :mod:`statekit.guard.hf` (a transformers ``TrainerCallback``),
:mod:`statekit.guard.accelerate` (Accelerate's save/load state hooks),
:mod:`statekit.guard.lightning` (a Lightning ``Callback``). torch is imported here only when a
function runs, and statekit never imports this package at start-up.
"""

from statekit.guard.check import EXPECTS, check_fingerprint, check_resume, compare
from statekit.guard.fingerprint import (
           FILE,
           SAMPLE,
           VERSION,
           fingerprint,
           fingerprint_path,
           load_fingerprint,
           save_fingerprint,
)
from statekit.guard.report import KINDS, Problem, Report, ResumeError, ResumeWarning

__all__ = ["EXPECTS", "FILE", "KINDS", "SAMPLE", "VERSION", "Problem", "Report", "ResumeError", "ResumeWarning",
           "check_fingerprint", "check_resume", "compare", "fingerprint", "fingerprint_path", "load_fingerprint",
           "save_fingerprint"]
