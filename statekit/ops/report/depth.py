"""Where each tensor sits along depth: its layer index and module kind, from its name alone.

The rule is framework-neutral: the first dotted component of a name that is a decimal number is
a layer index; what comes before it is the *stack* (``model.layers``, ``transformer.h``, ``blocks``,
``encoder.layer``), what comes after it is the *kind* (``self_attn.q_proj.weight``). So
``model.layers.17.mlp.down_proj.weight`` is layer 17 of ``model.layers``, kind
``mlp.down_proj.weight``, and the same kind in every layer is one series along depth. A name with
no such component (``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``, a
ParamId or ``#index`` label) is off the layer pattern: no layer, no kind.

The order along depth (``depth``, 0-based) follows the state's own order where it says something
about depth and fixes it where it does not: a stack sits where its first tensor does, its layers in
index order; within a layer, kinds go module by module in the order each module first appears (an
optimizer's groups put every weight before every bias: ``q_proj.bias`` still sits beside
``q_proj.weight``); a tensor off the pattern keeps its own place (the embedding before the layers,
the final norm and the head after them).
"""

from __future__ import annotations


def place(path: str) -> tuple[str, int, str] | None:
    """``(stack, layer, kind)`` of a tensor's name, or None when it is off the layer pattern."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isascii() and part.isdigit():
            return ".".join(parts[:i]), int(part), ".".join(parts[i + 1 :])
    return None


def places(paths: list[str]) -> list[dict]:
    """Per name (in the state's order): ``{"stack", "layer", "kind", "depth"}`` (the first three None
    off the layer pattern)."""
    found = [place(p) for p in paths]
    stack_at: dict[str, int] = {}
    module_at: dict[tuple[str, str], int] = {}
    kind_at: dict[tuple[str, str], int] = {}
    for i, f in enumerate(found):
        if f is None:
            continue
        stack, _, kind = f
        stack_at.setdefault(stack, i)
        module_at.setdefault((stack, kind.rpartition(".")[0]), i)
        kind_at.setdefault((stack, kind), i)

    def key(i: int) -> tuple:
        f = found[i]
        if f is None:
            return (i, 0, 0, 0, 0, i)
        stack, layer, kind = f
        return (stack_at[stack], 1, layer, module_at[(stack, kind.rpartition(".")[0])], kind_at[(stack, kind)], i)

    depth = {i: d for d, i in enumerate(sorted(range(len(found)), key=key))}
    return [{"stack": f[0] if f else None, "layer": f[1] if f else None, "kind": f[2] if f else None,
             "depth": depth[i]} for i, f in enumerate(found)]
