"""Value-identical candidates settled by names and structure alone — never by a guess.

Untrained norms (all ones), zero biases, tied copies: the weights cannot tell which old tensor a new
one came from, yet their optimizer states differ. A candidate is chosen only when exactly one of them
has the target's own path; else exactly one is renamed to it by the rules (the user's ``--rename``
and the cross-framework presets); else exactly one lies in the old module that every already-mapped
sibling of the target came from. Anything else is ambiguous and refused, naming the candidates.
"""

from __future__ import annotations

from collections.abc import Callable


def settle(target: str, candidates: list[str], names: Callable[[str], set[str]] | None,
           known: dict[str, list[str]]) -> tuple[str | None, str]:
    """``(chosen, how)``; ``chosen`` None when the names and the structure do not settle it.
    ``names(old path)``: what the rules rename it to (one name per chain of rules)."""
    same = [c for c in candidates if c == target]
    if len(same) == 1:
        return same[0], "their own paths"
    if names is not None:
        renamed = [c for c in candidates if target in names(c)]
        if len(renamed) == 1:
            return renamed[0], "the rename rules"
    module = target.rpartition(".")[0]
    for _ in range(2):  # the target's module, then the one above it
        if not module:
            break
        prefix = module + "."
        sources = [s for t, ss in known.items() if t.startswith(prefix) and t != target for s in ss]
        home = _common_module(sources)
        if home:
            inside = [c for c in candidates if c.startswith(home + ".")]
            if len(inside) == 1:
                return inside[0], "the module their siblings came from"
            if inside:
                break
        module = module.rpartition(".")[0]
    return None, ""


def _common_module(paths: list[str]) -> str:
    """The longest module path every one of ``paths`` lies in ('' when none, or no paths)."""
    if not paths:
        return ""
    parts = [p.split(".")[:-1] for p in paths]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)
