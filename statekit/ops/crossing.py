"""State that changes in value, not only in name, when it crosses burn ⇄ torch.

Three optimizers exist in both frameworks with state that is the same algorithm but not the same
numbers (``shared/docs/optimizers-burn-torch.md`` §3):

- **Adafactor**: burn adds ε₁ (1e-30) to g² *before* averaging, so its second moments are torch's
  plus ε₁ (the EMA weights sum to 1); torch uses its eps[0] as a clamp instead. burn's
  ``relative_step = false`` and ``scale_parameter = false`` have no torch counterpart, nor a
  ``clip_threshold`` below 1 (torch requires ``d ≥ 1``).
- **Muon**: burn's velocity is a sum (``v₁ = g``, ``v = μv + g``), torch's buffer an average
  (``buf = μ·buf + (1 − μ)g``): ``momentum_buffer = (1 − μ) · velocity``, only with burn's
  dampening 0 (burn's first step ignores dampening; torch has none). torch runs Newton–Schulz in
  bfloat16, burn in float32: a resumed run tracks the other, never bit for bit.
- **L-BFGS**: one global state of flat vectors (:mod:`statekit.ops.lbfgs`).

The plan records each transform (:class:`Transform`); :mod:`statekit.ops.execute` applies them
piece by piece while writing. Optimizers one framework lacks are refused here, once, by name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from statekit.errors import MappingError

# The optimizer each framework lacks, and why (torch 2.13 torch/optim/__init__.py __all__; burn
# 0.22 crates/burn-optim/src/optim/).
NO_COUNTERPART: dict[str, dict[str, str]] = {
    "torch": {  # burn → torch
        "lamb": "torch.optim 2.13 has no LAMB",
        "lion": "torch.optim 2.13 has no Lion",
        "adan": "torch.optim 2.13 has no Adan",
    },
    "burn": {  # torch → burn
        "nadam": "burn 0.22 has no NAdam",
        "radam": "burn 0.22 has no RAdam",
        "adamax": "burn 0.22 has no Adamax",
        "adadelta": "burn 0.22 has no Adadelta",
        "asgd": "burn 0.22 has no ASGD",
        "rprop": "burn 0.22 has no Rprop",
        "sparseadam": "burn 0.22 has no SparseAdam",
    },
    "candle": {},
}

#: torch's second moments plus ε₁ and minus it again give the same float32 bits for 0 and every
#: entry at least this large (checked over every float32 from 2^-84 to 2^-60); a smaller entry
#: moves by at most one unit in its last place
EPS1_EXACT_FROM = 2.0**-74
BURN_EPS1 = 1e-30


def refuse_missing(family: str, src_fw: str, dst_fw: str, source: str | None = None) -> None:
    """A MappingError naming the optimizer and the reason when ``dst_fw`` has no ``family``."""
    reason = NO_COUNTERPART.get(dst_fw, {}).get(family)
    if reason and src_fw != dst_fw:
        from statekit.frameworks.torch_families import class_name

        label = f"{class_name(family)} ({family})" if src_fw == "torch" else f"burn {family}"
        raise MappingError(f"{label} state cannot move to {dst_fw}: {reason}, and statekit does not approximate "
                           "one optimizer by another", source)


@dataclass
class Transform:
    """One value change applied to a slot of every parameter of a group while writing:
    ``op`` ``add``, ``mul`` or ``div`` by ``value``, one rounding in the slot's dtype."""

    group: int
    slot: str
    op: str
    value: float
    text: str

    def to_json(self) -> dict:
        return asdict(self)


def _say(value: float) -> str:
    return f"{value:.7g}"


def transforms(family: str, src_fw: str, dst_fw: str, values: dict, group: int) -> list[Transform]:
    """The value changes for ``family`` crossing ``src_fw`` → ``dst_fw`` with the group's
    hyperparameters ``values`` (the target's, already checked by :func:`target_values`)."""
    if {src_fw, dst_fw} != {"burn", "torch"}:
        return []
    if family == "adafactor":
        eps1 = float(values.get("epsilon_1", BURN_EPS1))
        burn = {"row_var": "second_moment", "col_var": "column_second_moment", "variance": "second_moment"}
        if dst_fw == "burn":
            return [Transform(group, slot, "add", eps1,
                              f"{burn[slot]} = {slot} + ε₁ ({_say(eps1)}): burn adds ε₁ to g² before averaging, torch "
                              "clamps instead") for slot in burn]
        return [Transform(group, slot, "add", -eps1,
                          f"{slot} = {burn[slot]} − ε₁ ({_say(eps1)}): burn added ε₁ to g² before averaging")
                for slot in burn]
    if family == "muon":
        mu = float(values.get("momentum", 0.95))
        if dst_fw == "torch":
            text = (f"momentum_buffer = (1 − μ) · velocity, μ = {_say(mu)}: burn's velocity sums (v = μv + g), "
                    "torch's buffer averages (buf = μ·buf + (1 − μ)g)")
            return [Transform(group, "momentum_buffer", "mul", 1.0 - mu, text)]
        text = (f"velocity = momentum_buffer / (1 − μ), μ = {_say(mu)}: torch's buffer averages, burn's velocity "
                "sums")
        return [Transform(group, "momentum_buffer", "div", 1.0 - mu, text)]
    return []


def exactness(family: str, src_fw: str, dst_fw: str) -> str | None:
    """What the plan promises about a resumed run, for the families whose state changes value."""
    if {src_fw, dst_fw} != {"burn", "torch"}:
        return None
    if family == "adafactor":
        return ("exact back: converting this output to the source framework again gives the source's float32 "
                f"bits (second moments of 0 or ≥ {EPS1_EXACT_FROM:.2g}); resumed in the other framework it tracks, "
                "not bit for bit: burn adds ε₁ to g² where torch clamps, and orders the update differently")
    if family == "muon":
        return ("tracks, not bit-identical: the buffer is rescaled in float32, and torch runs Newton–Schulz in "
                "bfloat16, burn in float32")
    return None


def target_values(family: str, src_fw: str, dst_fw: str, values: dict, assumed: list[str]) -> dict:
    """The target group's hyperparameters for ``family`` from the source's ``values``; settings
    the target cannot express are refused, naming them."""
    if {src_fw, dst_fw} != {"burn", "torch"} or family not in ("adafactor", "muon", "lbfgs"):
        return values
    out = dict(values)
    if dst_fw == "torch":
        if family == "adafactor":
            off = [k for k in ("relative_step", "scale_parameter") if out.get(k) is False]
            if off:
                raise MappingError(
                    f"burn Adafactor with {' and '.join(f'{k} = false' for k in off)}: torch's Adafactor always "
                    "takes the relative step min(lr, 1/√t) and scales by the parameter's RMS, so no torch optimizer "
                    "continues this state")
            if float(out.get("d", 1.0)) < 1.0:
                raise MappingError(f"burn Adafactor clip_threshold {out['d']}: torch's Adafactor requires d ≥ 1")
            eps2 = out.pop("epsilon_2", None)
            if "eps" not in out:
                out["eps"] = (None, eps2 if eps2 is not None else 1e-3)
                if "epsilon_2" in assumed:
                    assumed.append("eps")
            for key in ("epsilon_1", "relative_step", "scale_parameter"):
                out.pop(key, None)
        elif family == "muon":
            damp = float(out.pop("dampening", 0.0) or 0.0)
            if damp != 0.0:
                raise MappingError(
                    f"burn Muon with dampening {damp}: torch's Muon has no dampening (and burn's first step "
                    "ignores it), so no torch buffer continues this state")
        for key in ("epsilon_1", "epsilon_2", "relative_step", "scale_parameter", "dampening"):
            if key in assumed:
                assumed.remove(key)
        return out
    if out.get("maximize"):
        raise MappingError(f"torch {family} with maximize=True: burn's {family} has no maximize")
    return out


def apply(ref, op: str, value: float):
    """``ref`` with ``op value`` applied element-wise, piece by piece when written (one rounding in
    the tensor's own dtype: the value is first rounded to it, as torch rounds a scalar weight)."""
    from statekit import stream
    from statekit.lazy import numpy as np

    def fn(piece):
        scalar = piece.dtype.type(value)
        if op == "add":
            return piece + scalar
        if op == "mul":
            return piece * scalar
        return piece / scalar

    if op not in ("add", "mul", "div"):
        raise MappingError(f"unknown transform {op!r} in the plan")
    return stream.combine([ref], lambda piece: np.asarray(fn(piece), dtype=piece.dtype), ref.dtype)


def muon_scale_differs(family: str, src_fw: str, dst_fw: str, actions, values: dict) -> str | None:
    """Muon's "original" learning-rate adjustment √max(1, rows/cols) reads the weight in its own
    framework's layout (torch [out, in], burn [d_in, d_out]): a transposed non-square weight is
    stepped at another scale in the other framework. The warning naming them, or None."""
    import math

    if family != "muon" or {src_fw, dst_fw} != {"burn", "torch"} or values.get("adjust_lr_fn") == "match_rms_adamw":
        return None
    differ = []
    for a in actions:
        src, dst = a.src_shape, a.dst_shape
        if a.transpose and src and dst and len(src) == 2 and src[0] != src[1] and 0 not in src:
            differ.append(f"{a.label()} ×{math.sqrt(max(1, src[0] / src[1])):.3g} → ×{math.sqrt(max(1, dst[0] / dst[1])):.3g}")
    if not differ:
        return None
    more = f" (+{len(differ) - 4} more)" if len(differ) > 4 else ""
    return ("Muon's original learning-rate adjustment √max(1, rows/cols) reads each weight in its framework's layout "
            f"(torch [out, in], burn [d_in, d_out]), so the resumed run steps these weights at another scale: "
            f"{', '.join(differ[:4])}{more}; the state moves exactly as the plan says, but only adjust_lr_fn "
            "match_rms_adamw (0.2·√max(rows, cols)) or square weights give the same update in both")
