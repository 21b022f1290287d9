"""Rename and transpose rules shared by ``convert`` and ``remap``.

Rename rules are ordered ``REGEX=REPLACEMENT`` pairs applied in sequence to each path (like
burn-store's KeyRemapper); ``$1`` in a replacement is the first group. Transpose rules are
shell-style globs over target paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from statekit.errors import UsageError
from statekit.state import matches

# burn's norm layers call their affine parameters gamma/beta; torch calls them weight/bias.
# Anchored: an unanchored leading ``(.*)`` is retried at every position, quadratic in the path length.
NORM_PRESET = (("^(.*)\\.gamma$", "$1.weight"), ("^(.*)\\.beta$", "$1.bias"))


@dataclass
class RenameRule:
    pattern: str
    replacement: str
    origin: str = "user"  # "user" or "preset"
    matches: int = 0
    regex: re.Pattern = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self.regex = re.compile(_anchored(self.pattern))
        except re.error as exc:
            raise UsageError(f"rename rule {self.pattern!r}: {exc}") from None
        self._python = re.sub(r"\$(\d+)", r"\\g<\1>", self.replacement)
        try:  # the replacement is compiled now (a bad escape, a group the pattern lacks), not at the first match
            self.regex.sub(self._python, "")
        except (re.error, IndexError) as exc:
            raise UsageError(f"rename rule {self.pattern!r}={self.replacement!r}: replacement: {exc}") from None

    @classmethod
    def parse(cls, text: str, origin: str = "user") -> RenameRule:
        if "=" not in text:
            raise UsageError(f"rename rule {text!r} is not REGEX=REPLACEMENT")
        pattern, replacement = text.split("=", 1)
        return cls(pattern, replacement, origin)

    def apply(self, path: str) -> str:
        new, count = self.regex.subn(self._python, path)
        if count:
            self.matches += 1
        return new

    def to_json(self) -> dict:
        return {"pattern": self.pattern, "replacement": self.replacement, "origin": self.origin,
                "matches": self.matches}


def _anchored(pattern: str) -> str:
    """A pattern that starts with a greedy ``.*`` matches from the start of the path when it matches at
    all, and leaves nothing after its match for a second one; anchoring it changes no result but
    spares the regex engine a retry at every position (quadratic time on a long path)."""
    for lead in ("(.*)", ".*"):
        if pattern.startswith(lead) and pattern[len(lead) : len(lead) + 1] not in ("?", "*", "+", "{"):
            return "^(?:" + pattern + ")"
    return pattern


def read_rules_file(path: str) -> list[str]:
    """Rules one per line (``#`` comments and blank lines ignored)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    except OSError as exc:
        raise UsageError(f"{path}: cannot read rules: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: rules are not UTF-8 text (byte {exc.object[exc.start]:#04x} at {exc.start})") from None


def rename(path: str | None, rules: list[RenameRule]) -> str | None:
    if path is None:
        return None
    for rule in rules:
        path = rule.apply(path)
    return path


def matches_any(path: str | None, globs: list[str]) -> bool:
    """Whether a path is one of ``globs`` (the one matcher, :func:`statekit.state.matches`)."""
    return path is not None and any(matches(g, path=path) for g in globs)
