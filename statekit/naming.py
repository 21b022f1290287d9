"""Every framework's names for optimizer state, in one table.

statekit's framework-neutral slot names are PyTorch's (``exp_avg``, ``exp_avg_sq``, …). Each
framework maps its own field names onto them here, and nowhere else: readers, writers and
converters look names up in :data:`FAMILIES` instead of testing names in code.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layout:
    """One optimizer family's per-parameter state in one framework.

    ``slots``: native field name → neutral slot name. ``required``: native names that must all be
    present for a parameter to belong to this family. ``step``: native name of the step counter.
    """

    family: str
    slots: dict[str, str]
    required: frozenset[str]
    step: str | None = None
    also: tuple[str, ...] = ()  # other families with byte-identical state (cannot be told apart)
    derived: frozenset[str] = field(default_factory=frozenset)  # slots recomputable from others
    # family → the parameter ranks it can hold (burn's Muon takes only 2-D parameters): a parameter
    # of another rank cannot be that family, whatever its fields
    ranks: dict[str, frozenset[int]] = field(default_factory=dict)
    # neutral slots stored under a field ``slots`` already maps, for parameters of fewer than two
    # dimensions: burn Adafactor keeps a vector's full second moment (torch's ``variance``) in
    # ``second_moment``, the field of a matrix's row factor (torch's ``row_var``)
    alias: dict[str, str] = field(default_factory=dict)

    def slot_of(self, native: str, rank: int | None) -> str:
        """The neutral slot of field ``native`` for a parameter of ``rank``."""
        if rank is not None and rank < 2:
            for neutral, field_name in self.alias.items():
                if field_name == native:
                    return neutral
        return self.slots[native]

    def native_of(self) -> dict[str, str]:
        """neutral slot → field (aliases included)."""
        return {**{neutral: native for native, neutral in self.slots.items()}, **self.alias}

    def candidates(self, rank: int | None) -> tuple[str, ...]:
        """The families this layout can be for a parameter of ``rank`` (None: unknown, all)."""
        return tuple(f for f in (self.family, *self.also)
                     if rank is None or f not in self.ranks or rank in self.ranks[f])


BURN: tuple[Layout, ...] = (
    Layout(
        "adam",
        {"momentum.moment_1": "exp_avg", "momentum.moment_2": "exp_avg_sq",
         "momentum.max_moment_2": "max_exp_avg_sq"},
        frozenset({"momentum.moment_1", "momentum.moment_2", "momentum.time"}),
        step="momentum.time",
        also=("adamw",),
    ),
    Layout(
        "adan",
        {"momentum.exp_avg": "exp_avg", "momentum.exp_avg_sq": "exp_avg_sq",
         "momentum.exp_avg_diff": "exp_avg_diff", "momentum.neg_pre_grad": "neg_pre_grad"},
        frozenset({"momentum.exp_avg", "momentum.exp_avg_sq", "momentum.exp_avg_diff",
                   "momentum.neg_pre_grad", "momentum.time"}),
        step="momentum.time",
    ),
    Layout(
        "sgd",
        {"momentum.velocity": "momentum_buffer"},
        frozenset({"momentum.velocity"}),
        also=("muon",),
        ranks={"muon": frozenset({2})},  # MuonState is SgdState's layout; Muon's step asserts D == 2
    ),
    Layout("adagrad", {"lr_decay.sum": "sum"}, frozenset({"lr_decay.sum", "lr_decay.time"}),
           step="lr_decay.time"),
    Layout(
        "rmsprop",
        {"square_avg.square_avg": "square_avg", "centered.grad_avg": "grad_avg",
         "centered.avg": "avg", "momentum.buf": "momentum_buffer"},
        frozenset({"square_avg.square_avg", "centered.avg"}),
        derived=frozenset({"avg"}),
    ),
    # burn 0.22's LAMB, Lion and Adafactor (optimizers-burn-torch.md §1.2–1.4): fields directly
    # under the parameter id, no ``momentum.`` level.
    Layout("lamb", {"moment_1": "exp_avg", "moment_2": "exp_avg_sq"},
           frozenset({"moment_1", "moment_2", "time"}), step="time"),
    Layout("lion", {"momentum": "exp_avg"}, frozenset({"momentum"})),
    # Adafactor: ``second_moment`` is the EMA of g² + ε₁ (ε₁ = 1e-30 inside, unlike torch's row_var /
    # variance: statekit.ops.crossing), reduced over the last axis for D ≥ 2 ([..., rows, 1], torch's
    # row_var), full for D = 1 (torch's variance); ``column_second_moment`` [..., 1, cols] only for D ≥ 2
    Layout("adafactor", {"second_moment": "row_var", "column_second_moment": "col_var"},
           frozenset({"second_moment", "time"}), step="time", alias={"variance": "second_moment"}),
)

#: burn families that first shipped in burn 0.22 (no burn <= 0.21 legacy record holds them)
BURN_022_FAMILIES = frozenset({"lamb", "lion", "adafactor"})

#: factored second moments: (row slot [..., rows, 1], column slot [..., 1, cols]) → parameter shape
#: [..., rows, cols] (torch's Adafactor, burn's Adafactor)
FACTORED: tuple[tuple[str, str], ...] = (("row_var", "col_var"),)

# burn's SGD without momentum keeps no state at all: each parameter only has ``__rank``.
BURN_STATELESS = "sgd"
BURN_RANK = "__rank"
BURN_GLOBAL_FAMILIES = {
    # L-BFGS flattens one global state with an empty prefix (no param ids, no __rank).
    "lbfgs": frozenset({"history_s.len", "history_y.len", "g_iter"}),
}
#: burn L-BFGS's global state (LBFGSState, lbfgs.rs): the vector lists (``<name>.len`` plus
#: ``<name>.<i>``), the optional vectors and the scalars, each with what it holds
BURN_LBFGS = {
    "history_s": "s_k = t·d, the accepted steps, oldest first",
    "history_y": "y_k = g_k − g_{k−1}, the gradient differences, oldest first",
    "d": "the last search direction",
    "prev_flat_grad": "the flat gradient at the start of the last iteration",
    "t": "the last step size",
    "prev_loss": "the loss after the last evaluation",
    "g_iter": "the global iteration count",
}
BURN_LBFGS_LISTS = ("history_s", "history_y")
BURN_LBFGS_STEP = "g_iter"

TORCH: tuple[Layout, ...] = (
    Layout("adam", {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "max_exp_avg_sq": "max_exp_avg_sq"},
           frozenset({"exp_avg", "exp_avg_sq", "step"}), step="step", also=("adamw",)),
    Layout("nadam", {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "mu_product": "mu_product"},
           frozenset({"exp_avg", "exp_avg_sq", "mu_product", "step"}), step="step"),
    Layout("radam", {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
           frozenset({"exp_avg", "exp_avg_sq", "step"}), step="step"),
    Layout("adadelta", {"square_avg": "square_avg", "acc_delta": "acc_delta"},
           frozenset({"square_avg", "acc_delta", "step"}), step="step"),
    Layout("adamax", {"exp_avg": "exp_avg", "exp_inf": "exp_inf"},
           frozenset({"exp_avg", "exp_inf", "step"}), step="step"),
    Layout("adafactor", {"row_var": "row_var", "col_var": "col_var", "variance": "variance"},
           frozenset({"step"}), step="step"),
    Layout("rmsprop", {"square_avg": "square_avg", "grad_avg": "grad_avg", "momentum_buffer": "momentum_buffer"},
           frozenset({"square_avg", "step"}), step="step"),
    Layout("adagrad", {"sum": "sum"}, frozenset({"sum", "step"}), step="step"),
    Layout("sgd", {"momentum_buffer": "momentum_buffer"}, frozenset({"momentum_buffer"})),
    Layout("asgd", {"eta": "eta", "mu": "mu", "ax": "ax"}, frozenset({"eta", "mu", "ax", "step"}), step="step"),
    Layout("rprop", {"prev": "prev", "step_size": "step_size"}, frozenset({"prev", "step_size", "step"}),
           step="step"),
    # after SGD: the same single field (torch_families tells them apart by their group keys)
    Layout("muon", {"momentum_buffer": "momentum_buffer"}, frozenset({"momentum_buffer"})),
)

# candle-nn keeps AdamW's moments per variable and one optimizer-wide ``step_t`` (statekit's
# safetensors layout for it, docs/candle.md, names the tensors ``first_moment.<var>`` …).
CANDLE: tuple[Layout, ...] = (
    Layout("adamw", {"first_moment": "exp_avg", "second_moment": "exp_avg_sq"},
           frozenset({"first_moment", "second_moment", "step_t"}), step="step_t"),
)

#: the slot of a mixed-precision optimizer's fp32 master copy of a parameter (Megatron's ``param`` /
#: ``fp32_param`` / ``fp32_from_fp16_params``): state beside the optimizer's own, not Adam's arithmetic
MASTER_SLOT = "fp32_master"

FRAMEWORKS = {"burn": BURN, "torch": TORCH, "candle": CANDLE}

# An Adafactor's factored second moment: row and column factors, not of the parameter's shape
# (torch: row_var [..., n, 1], col_var [..., 1, m]; transformers: exp_avg_sq_row [..., n], exp_avg_sq_col [..., m])
FACTORED_SLOTS = frozenset({"row_var", "col_var", "exp_avg_sq_row", "exp_avg_sq_col"})

def layout(framework: str, family: str) -> Layout:
    for item in FRAMEWORKS[framework]:  # a family's own layout first (torch's muon), then one it shares
        if item.family == family:
            return item
    for item in FRAMEWORKS[framework]:
        if family in item.also:
            return item
    raise KeyError(f"{framework} has no optimizer family {family!r}")


def classify(framework: str, fields: set[str], exclude: frozenset[str] = frozenset()) -> Layout | None:
    """The first layout whose required fields are all present and that explains every field
    (``exclude``: families that cannot be there, e.g. those newer than the record's format)."""
    for item in FRAMEWORKS[framework]:
        if item.family in exclude:
            continue
        known = set(item.slots) | ({item.step} if item.step else set())
        if item.required <= fields and fields <= known:
            return item
    return None


def derived_slots(family: str) -> frozenset[str]:
    """Slots of ``family`` that some framework stores but that are recomputed from the others
    (burn RMSProp's ``avg``): a target without them drops them, burn recomputes them."""
    return frozenset(s for layouts in FRAMEWORKS.values() for lay in layouts if lay.family == family
                     for s in lay.derived)
