"""What the resume guard found: the problem kinds, :class:`Problem`, :class:`Report` and the
error and warning that carry them."""

from __future__ import annotations

from dataclasses import dataclass, field

from statekit.errors import StatekitError

MAX_NAMED = 8  # parameters named in one problem's line

KINDS = {
    "empty": "no optimizer state after the load: moments and step restart from zero",
    "zero": "moments all zero after the load (the sampled elements were not at save)",
    "step": "step counter differs from the one saved",
    "moved": "holds the state saved for another parameter (a changed order)",
    "values": "moments differ from those saved",
    "layout": "parameters differ from those saved",
    "groups": "param groups differ from those saved",
    "hyper": "param group hyperparameters differ from those saved",
    "scheduler": "LR scheduler position differs from the one saved",
    "restored": "a weights-only resume, but the optimizer holds state",
}

class ResumeError(StatekitError):
    """The live optimizer (or scheduler) does not hold what was saved: ``problems`` name the parameters."""

    def __init__(self, message: str, path: str | None = None, problems: list[Problem] | None = None):
        super().__init__(message, path)
        self.problems = problems or []


class ResumeWarning(UserWarning):
    """What :class:`ResumeError` says, as a warning (``on_problem="warn"``)."""


@dataclass
class Problem:
    kind: str
    params: list[str] = field(default_factory=list)
    detail: str = ""

    def line(self) -> str:
        who = ""
        if self.params:
            more = f" (+{len(self.params) - MAX_NAMED} more)" if len(self.params) > MAX_NAMED else ""
            who = f" [{', '.join(self.params[:MAX_NAMED])}{more}]"
        return f"{self.kind}: {self.detail or KINDS[self.kind]}{who}"


@dataclass
class Report:
    """What :func:`check_resume` found; ``ok`` when nothing (or only what ``allow`` lets through)."""

    path: str
    problems: list[Problem] = field(default_factory=list)
    allowed: list[Problem] = field(default_factory=list)
    checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def message(self) -> str:
        n = len(self.problems)
        return (f"the resume does not hold the optimizer state saved beside it ({n} problem{'s' if n > 1 else ''}): "
                + "; ".join(p.line() for p in self.problems))
