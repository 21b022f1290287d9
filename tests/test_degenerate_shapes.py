"""Every torch optimizer's state of degenerate parameters through ``.pt → .bpk → .pt`` (issue 27).

A dimension of 1 (``[1, n]``, ``[n, 1]``, ``[1, 1]``, ``[1]``), a scalar parameter (``[]``) and an
empty tensor (``[0]``, ``[0, 3]``, ``[3, 0]``) are where a layout is easy to take for another:
torch's Adafactor keeps a ``[1, n]`` weight's column factor in the weight's own shape, so a factor
told by its shape was transposed as if it were the weight (the ``.bpk`` then could not be read
back). Real torch 2.13 steps each optimizer on seeded gradients; statekit converts its state to
burn and back with no flags but the names and ``--transpose '*'`` (every matrix a Linear weight);
the result must be torch's own file again, tensor for tensor and group for group. An optimizer burn
does not have is refused in one line, writing nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import statekit
from statekit.errors import StatekitError

torch = pytest.importorskip("torch")

SHAPES = [(), (0,), (1,), (5,), (1, 1), (1, 5), (5, 1), (0, 3), (3, 0), (2, 1, 4)]


def _make(name: str):
    """(factory(params), steps need a closure, only matrices, converts to burn)"""
    o = torch.optim
    table = {
        "adam": (lambda ps: o.Adam(ps, lr=0.01), False, False, True),
        "adam-amsgrad": (lambda ps: o.Adam(ps, lr=0.01, amsgrad=True, weight_decay=0.1), False, False, True),
        "adamw": (lambda ps: o.AdamW(ps, lr=0.01), False, False, True),
        "sgd": (lambda ps: o.SGD(ps, lr=0.01), False, False, True),
        "sgd-momentum": (lambda ps: o.SGD(ps, lr=0.01, momentum=0.9), False, False, True),
        "rmsprop": (lambda ps: o.RMSprop(ps, lr=0.01), False, False, True),
        "rmsprop-centered": (lambda ps: o.RMSprop(ps, lr=0.01, centered=True, momentum=0.5), False, False, True),
        "adagrad": (lambda ps: o.Adagrad(ps, lr=0.01), False, False, True),
        "adafactor": (lambda ps: o.Adafactor(ps, lr=0.01), False, False, True),
        "muon": (lambda ps: o.Muon(ps, lr=0.01), False, True, True),
        "lbfgs": (lambda ps: o.LBFGS(ps, lr=0.1, history_size=3, max_iter=2), True, False, True),
        "nadam": (lambda ps: o.NAdam(ps, lr=0.01), False, False, False),
        "radam": (lambda ps: o.RAdam(ps, lr=0.01), False, False, False),
        "adamax": (lambda ps: o.Adamax(ps, lr=0.01), False, False, False),
        "adadelta": (lambda ps: o.Adadelta(ps), False, False, False),
        "asgd": (lambda ps: o.ASGD(ps, lr=0.01), False, False, False),
        "rprop": (lambda ps: o.Rprop(ps, lr=0.01), False, False, False),
    }
    return table[name]


OPTIMIZERS = ["adam", "adam-amsgrad", "adamw", "sgd", "sgd-momentum", "rmsprop", "rmsprop-centered", "adagrad",
              "adafactor", "muon", "lbfgs", "nadam", "radam", "adamax", "adadelta", "asgd", "rprop"]


class Unsteppable(Exception):
    """torch itself fails to step this optimizer on these shapes (nothing to convert)."""


def stepped(name: str, shapes, seed: int, path) -> str:
    """Real torch: parameters of ``shapes`` stepped twice on seeded gradients, the state saved to ``path``;
    returns a names file (``p0 [1, 5]`` per line) beside it."""
    factory, closure, matrices_only, _ = _make(name)
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = factory(params)
    for _ in range(2):
        grads = [torch.randn(s, generator=gen) + 0.5 for s in shapes]  # away from 0: no denormal moments

        def fill(grads=grads):
            opt.zero_grad()
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            return torch.tensor(float(sum(float((p.detach() * g).sum()) for p, g in zip(params, grads, strict=True))))

        try:
            opt.step(fill) if closure else (fill(), opt.step())
        except (ZeroDivisionError, RuntimeError) as exc:  # torch 2.13's Adafactor and LBFGS on an empty tensor
            if not any(0 in s for s in shapes):
                raise
            raise Unsteppable(f"torch's {name} cannot step parameters of shapes {shapes}: {exc}") from None
    torch.save(opt.state_dict(), path)
    names = path.parent / "names.txt"  # the names with their shapes (L-BFGS's flat state needs them)
    names.write_text("".join(f"p{i} [{', '.join(map(str, s))}]\n" for i, s in enumerate(shapes)))
    return str(names)


def same_state(a: dict, b: dict, rescaled: tuple[str, ...] = ()) -> None:
    """``b`` is ``a`` tensor for tensor; ``rescaled`` fields within the two float32 roundings of a
    documented rescale (Muon's buffer is divided by 1 − μ for burn and multiplied back)."""
    assert a["param_groups"] == b["param_groups"]
    assert list(a["state"]) == list(b["state"])
    for key, entry in a["state"].items():
        # L-BFGS's "al" is the two-loop recursion's scratch list, written before it is read: torch makes
        # a new one when a loaded state lacks it, and statekit does not carry it (torch_state.LBFGS_SCRATCH)
        entry = {k: v for k, v in entry.items() if k != "al"}
        other = b["state"][key]
        assert sorted(entry) == sorted(other), key
        for field, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == other[field].dtype and value.shape == other[field].shape, (key, field)
                if field in rescaled:
                    torch.testing.assert_close(value, other[field], rtol=4e-7, atol=0)
                else:
                    assert torch.equal(value, other[field]), (key, field)
            elif isinstance(value, list):  # L-BFGS's history: lists of tensors
                assert len(value) == len(other[field]) and all(torch.equal(x, y) for x, y in zip(
                    value, other[field], strict=True)), (key, field)
            else:
                assert value == other[field], (key, field)


def round_trip(name: str, shapes, seed: int, tmp) -> None:
    factory, closure, matrices_only, converts = _make(name)
    src, bpk, back = tmp / "opt.pt", tmp / "opt.bpk", tmp / "back.pt"
    for p in (src, bpk, back):
        p.unlink(missing_ok=True)
    names = stepped(name, shapes, seed, src)
    if not converts:
        with pytest.raises(StatekitError, match="burn 0.22 has no") as err:
            statekit.convert(str(src), str(bpk), names=names, transpose=["*"])
        assert "\n" not in str(err.value)
        assert not bpk.exists()
        return
    statekit.convert(str(src), str(bpk), names=names, transpose=["*"])
    with statekit.open(str(bpk)) as ckpt:  # the .bpk reads back as the optimizer it is
        assert ckpt.optimizer.family not in (None, "mixed"), ckpt.optimizer.family_label
    statekit.convert(str(bpk), str(back))
    same_state(torch.load(src, weights_only=True), torch.load(back, weights_only=True),
               rescaled=("momentum_buffer",) if name == "muon" else ())


def _allowed(name: str, shapes) -> bool:
    return not _make(name)[2] or all(len(s) == 2 for s in shapes)  # torch's Muon takes matrices only


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_and_degenerate_shape_round_trips(name, shape, tmp_path):
    if not _allowed(name, [shape]):
        pytest.skip("torch's Muon optimizes matrices only")
    try:
        round_trip(name, [shape], 0, tmp_path)
    except Unsteppable as exc:
        pytest.skip(str(exc))


def test_adafactor_factors_of_a_row_and_a_column_weight_are_told_by_name(tmp_path):
    """The reported case: torch Adafactor on Linear(8, 1) (weight [1, 8]: its col_var is [1, 8] too)."""
    names = stepped("adafactor", [(1, 8), (8, 1)], 3, tmp_path / "opt.pt")
    statekit.convert(str(tmp_path / "opt.pt"), str(tmp_path / "opt.bpk"), names=names, transpose=["*"])
    with statekit.open(str(tmp_path / "opt.bpk")) as ckpt:
        by = {p.path: p for p in ckpt.optimizer.params}
        # burn's [8, 1] weight: row factor [8, 1] (torch's column factor), column factor [1, 1]
        assert tuple(by["p0"].slots["row_var"].shape) == (8, 1) and tuple(by["p0"].slots["col_var"].shape) == (1, 1)
        assert tuple(by["p1"].slots["row_var"].shape) == (1, 1) and tuple(by["p1"].slots["col_var"].shape) == (1, 8)
    statekit.convert(str(tmp_path / "opt.bpk"), str(tmp_path / "back.pt"))
    same_state(torch.load(tmp_path / "opt.pt", weights_only=True), torch.load(tmp_path / "back.pt", weights_only=True))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(OPTIMIZERS), shapes=st.lists(st.sampled_from(SHAPES), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_models_of_mixed_degenerate_parameters_round_trip(name, shapes, seed, tmp_path):
    if not _allowed(name, shapes):
        shapes = [s for s in shapes if len(s) == 2] or [(1, 5)]
    try:
        round_trip(name, shapes, seed, tmp_path)
    except Unsteppable:
        assume(False)
