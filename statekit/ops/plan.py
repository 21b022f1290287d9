"""Plans: what a ``convert`` or ``remap`` will do, as plain data, before anything is written.

A :class:`Plan` lists, per target parameter, where its state comes from and every change made on
the way (rename, new id or position, transpose, resize, cast, step reset), plus the optimizer
family, the hyperparameters (and which were assumed), the rules and how often each matched.
``--dry-run`` prints it; ``--plan-out`` saves it as JSON; :mod:`statekit.ops.execute` carries it
out, and a saved plan applied to the same input gives byte-identical output.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from statekit.errors import UsageError

PLAN_VERSION = 1


@dataclass
class ParamAction:
    """One parameter's fate. ``action`` is ``keep``, ``rename``, ``new`` (no state), ``drop``,
    ``assemble`` (a new tensor built from pieces of several, or of a part of one) or ``into`` (a
    source read by assembled targets, not written itself)."""

    action: str
    src_key: str | None = None
    src_path: str | None = None
    src_shape: list[int] | None = None
    dst_path: str | None = None
    dst_id: str | None = None  # burn ParamId, decimal (JSON has no u64)
    dst_index: int | None = None  # torch position
    dst_shape: list[int] | None = None
    transpose: bool = False
    resize: bool = False
    cast: str | None = None
    reset_step: bool = False
    group: int = 0
    notes: list[str] = field(default_factory=list)
    # structural moves (statekit.structure): what the target is (fused, stacked, permuted, …); for
    # ``assemble``, the source parameters it reads ({key, path, shape}) and its affine pieces
    structure: str | None = None
    sources: list[dict] | None = None
    pieces: list[dict] | None = None
    new_elements: int = 0

    def label(self) -> str:
        return self.dst_path or self.src_path or (f"#{self.src_key}" if self.src_key else "?")


@dataclass
class Plan:
    operation: str  # "convert" | "remap"
    source: str
    source_format: str
    target: str
    target_format: str
    family: str | None
    hyperparams: list[dict] = field(default_factory=list)  # one dict per target param group
    assumed: list[str] = field(default_factory=list)
    rules: list[dict] = field(default_factory=list)
    params: list[ParamAction] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    step_policy: str | None = None  # candle: "max" writes the largest of differing steps
    allow_nonfinite: bool = False  # write NaN/Inf state instead of refusing it
    names_from: str | None = None  # how a torch source's positions were named (torch_names), when they were
    # value changes applied while writing (statekit.ops.crossing.Transform as dicts) and what they
    # promise about a resumed run
    transforms: list[dict] = field(default_factory=list)
    exactness: str | None = None
    group_families: list[str] | None = None  # per target group, when groups hold different optimizers
    # L-BFGS: each parameter's segment of the flat vectors, in the target's order
    # ({path, src_offset, numel, src_shape, transpose}; statekit.ops.lbfgs)
    segments: list[dict] | None = None
    layouts_from: str | None = None  # where transposes and norm renames were decided (module classes)
    training_args: dict | None = None  # an HF TrainingArguments' optimizer settings (the source folder's)
    structure: dict | None = None  # a structural map's origin ("weights" or "rules") and notes
    version: int = PLAN_VERSION

    # ------------------------------------------------------------------ views
    def count(self, action: str) -> int:
        return sum(1 for p in self.params if p.action == action)

    def summary(self) -> str:
        moved = [p for p in self.params if p.action in ("keep", "rename")]
        parts = [f"{len(moved) + self.count('assemble')} parameters with state"]
        words = {"rename": "renamed", "assemble": "assembled", "into": "read into others"}
        for action in ("rename", "assemble", "into", "new", "drop"):
            if self.count(action):
                parts.append(f"{self.count(action)} {words.get(action, action)}")
        for flag, word in (("transpose", "transposed"), ("resize", "resized"), ("reset_step", "step reset")):
            n = sum(1 for p in self.params if getattr(p, flag))
            if n:
                parts.append(f"{n} {word}")
        casts = sum(1 for p in self.params if p.cast)
        if casts:
            parts.append(f"{casts} cast")
        return ", ".join(parts)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        return asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            raise UsageError(f"not a statekit plan of version {PLAN_VERSION}")
        fields = dict(data)
        fields["params"] = [ParamAction(**p) for p in data.get("params", [])]
        # JSON has no tuples; torch's hyperparameters (betas, Adafactor's eps) are tuples
        fields["hyperparams"] = [{k: tuple(v) if isinstance(v, list) else v for k, v in g.items()}
                                 for g in data.get("hyperparams", [])]
        try:
            return cls(**fields)
        except TypeError as exc:
            raise UsageError(f"malformed plan: {exc}") from None

    @classmethod
    def load(cls, path: str) -> Plan:
        try:
            with open(path, encoding="utf-8") as fh:
                return cls.from_json(json.load(fh))
        except OSError as exc:
            raise UsageError(f"{path}: cannot read plan: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: plan is not JSON: {exc}") from None
