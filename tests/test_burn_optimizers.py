"""burn 0.22's LAMB, Lion, Adafactor and Muon replayed in burn's arithmetic (``statekit.optim.burn_extra``).

Three references, none of them statekit's own output:

* burn's own ``#[test]`` numbers (``lamb.rs``, ``lion.rs``, ``adafactor/tests.rs``, ``muon.rs``),
  at burn's tolerances (``Tolerance::absolute``);
* ``tests/burn_transcription.py``, a line-by-line numpy transcription of each optimizer's Rust
  source, bit for bit over 50 steps;
* the records under ``fixtures/burn-optim/`` (``scripts/make_burn_optim_fixtures.py``), checked
  against that transcription.

and ``verify-resume`` on each: exit 0 on a copy, 1 on a state with two same-shape moments swapped.
"""

import importlib.util
import math

import burn_transcription as tr
import numpy as np
import pytest
from conftest import ROOT

from statekit.errors import UsageError
from statekit.formats.burnpack import PackTensor, Scalar, write_burnpack
from statekit.io import open_checkpoint
from statekit.optim import registry
from statekit.tensor import TensorRef

F = np.float32
FIX = ROOT / "fixtures" / "burn-optim"


def step(name, p, g, s, t, **hp):
    return registry.step(name, np.asarray(p, F), np.asarray(g, F), s, t, hp, "burn")


def close(actual, expected, tol):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64), rtol=0, atol=tol)


# ---------------------------------------------------------------------------------- burn's tests


def test_lion_two_steps_with_weight_decay():  # lion.rs
    p, s, t = step("lion", [1.0, -2.0, 3.0], [0.5, -0.25, 0.0], {}, 0, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.1)
    close(p, [0.89, -1.88, 2.97], 1e-6)
    close(s["exp_avg"], [0.005, -0.0025, 0.0], 1e-6)
    p, s, t = step("lion", p, [-0.1, 0.5, -2.0], s, t, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.1)
    close(p, [0.9811, -1.9612, 3.0403], 1e-6)
    close(s["exp_avg"], [0.00395, 0.002525, -0.02], 1e-6)


def test_lamb_matches_pytorch_reference_for_two_steps():  # lamb.rs
    hp = dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.1)
    p, s, t = step("lamb", [1.0, -2.0, 3.0], [0.1, -0.2, 0.3], {}, 0, **hp)
    close(p, [0.9802435, -1.9784473, 2.9766512], 1e-6)
    p, s, t = step("lamb", p, [-0.4, 0.5, -0.6], s, t, **hp)
    close(p, [1.0127187, -1.9956441, 2.9814672], 1e-6)
    assert t == 2
    close(s["exp_avg"], [-0.031, 0.032, -0.033], 1e-7)
    close(s["exp_avg_sq"], [0.00016999, 0.00028996, 0.00044991], 1e-8)


def test_lamb_zero_norm_uses_unit_trust_ratio():
    p, _, _ = step("lamb", [0.0, 0.0], [0.0, 0.0], {}, 0, lr=0.01, weight_decay=0.1)
    assert np.array_equal(p, np.zeros(2, F))


def test_lamb_can_disable_trust_ratio():
    p, _, _ = step("lamb", [1.0, -2.0, 3.0], [0.1, -0.2, 0.3], {}, 0, lr=0.01, eps=1e-6, weight_decay=0.1,
                   use_trust_ratio=False)
    close(p, [0.9890001, -1.988, 2.987], 1e-6)


REF = dict(epsilon_1=0.01, d=0.75, relative_step=False, scale_parameter=False)  # the "scalar reference" config


def test_adafactor_vector_matches_scalar_reference_for_two_steps():  # adafactor/tests.rs
    p, s, t = step("adafactor", [1.0, -2.0, 3.0], [0.2, -0.4, 0.7], {}, 0, lr=0.2, **REF)
    close(p, [0.8591300, -1.8472050, 2.8440855], 1e-6)
    p, s, t = step("adafactor", p, [-0.1, 0.8, -0.5], s, t, lr=0.2, **REF)
    close(p, [0.9511715, -2.0468662, 2.982519], 1e-6)
    assert t == 2 and set(s) == {"variance"} and s["variance"].shape == (3,)
    close(s["variance"], [0.032769524, 0.4456876, 0.3621562], 1e-7)


def test_adafactor_matrix_matches_scalar_reference_for_two_steps():
    p, s, t = step("adafactor", [[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]], [[0.2, -0.4, 0.6], [0.8, -1.0, 1.2]], {}, 0,
                   lr=0.2, **REF)
    close(p, [[0.90609723, -1.8553506, 2.8252919], [-4.1636004, 5.157508, -6.152191]], 1e-6)
    p, s, t = step("adafactor", p, [[-0.5, 0.25, 1.0], [0.125, -0.75, 0.375]], s, t, lr=0.2, **REF)
    close(p, [[1.109898, -1.929492, 2.5945199], [-4.202498, 5.3273153, -6.218259]], 1e-6)
    assert t == 2 and s["row_var"].shape == (2, 1) and s["col_var"].shape == (1, 3)
    close(s["row_var"], [[0.34073257], [0.584606]], 1e-7)
    close(s["col_var"], [[0.23100203, 0.43636158, 0.72064424]], 1e-7)


def test_adafactor_higher_rank_factors_preserve_independent_batches():
    g = [[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], [[2.0, -1.0, 4.0], [0.5, 3.0, -2.0]]]
    p, s, _ = step("adafactor", np.zeros((2, 2, 3)), g, {}, 0, lr=0.2, **{**REF, "d": 10.0})
    close(p, [[[-0.12350519, -0.1891674, -0.22781561], [-0.21083567, -0.20182975, -0.19445199]],
              [[-0.24725027, 0.080702476, -0.22837506], [-0.077785276, -0.30466932, 0.1436942]]], 1e-6)
    assert s["row_var"].shape == (2, 2, 1) and s["col_var"].shape == (2, 1, 3)
    close(s["row_var"], [[[4.6766667], [25.676666]], [[7.01], [4.4266667]]], 3e-6)
    close(s["col_var"], [[[8.51, 14.51, 22.51]], [[2.135, 5.01, 10.01]]], 3e-6)


def test_adafactor_relative_step_caps_supplied_learning_rate_and_decays_with_time():
    kw = dict(scale_parameter=False)
    p, _, _ = step("adafactor", [2.0, -2.0], [1.0, 1.0], {}, 0, lr=0.1, **kw)
    close(p, [1.9, -2.1], 1e-6)
    p, s, t = step("adafactor", [2.0, -2.0], [1.0, 1.0], {}, 0, lr=2.0, **kw)
    assert np.array_equal(p, np.array([1.0, -3.0], F))
    p, _, _ = step("adafactor", p, [1.0, 1.0], s, t, lr=2.0, **kw)
    close(p, [0.29289323, -3.7071068], 1e-6)


def test_adafactor_absolute_step_uses_supplied_learning_rate_without_a_cap():
    p, _, _ = step("adafactor", [2.0, -2.0], [1.0, 1.0], {}, 0, lr=2.0, relative_step=False, scale_parameter=False)
    assert np.array_equal(p, np.array([0.0, -4.0], F))


def test_adafactor_parameter_scale_uses_rms_with_an_epsilon_floor():
    p, _, _ = step("adafactor", [3.0, 4.0], [1.0, 1.0], {}, 0, lr=0.01, epsilon_2=0.1)
    close(p, [2.9646447, 3.9646447], 1e-6)
    p, _, _ = step("adafactor", [0.0, 0.0], [1.0, 1.0], {}, 0, lr=0.2, epsilon_2=0.1)
    close(p, [-0.02, -0.02], 1e-7)


def test_adafactor_update_clipping_limits_update_rms():
    p, _, _ = step("adafactor", [1.0, -2.0], [1.0, -1.0], {}, 0, lr=0.2, d=0.25, scale_parameter=False)
    close(p, [0.95, -1.95], 1e-6)


def test_adafactor_weight_decay_uses_supplied_learning_rate_and_original_parameter():
    p, _, _ = step("adafactor", [3.0, 4.0], [1.0, 1.0], {}, 0, lr=2.0, weight_decay=0.1)
    close(p, [-1.1355339, -0.33553392], 1e-6)


def test_adafactor_zero_gradients_remain_finite_in_both_state_representations():
    for shape in ((3,), (2, 3)):
        p, s, t = step("adafactor", np.zeros(shape), np.zeros(shape), {}, 0, lr=0.1)
        p, _, _ = step("adafactor", p, np.zeros(shape), s, t, lr=0.1)
        assert np.array_equal(p, np.zeros(shape, F))


def test_adafactor_settings_burn_rejects_are_refused():
    for bad in (dict(epsilon_1=0.0), dict(epsilon_2=-1.0), dict(d=math.nan), dict(beta2_decay=0.0),
                dict(weight_decay=math.inf)):
        with pytest.raises(UsageError, match="burn panics"):
            step("adafactor", [1.0], [1.0], {}, 0, lr=0.1, **bad)


def test_muon_adjust_lr_fn():  # muon.rs: test_adjust_lr_fn_original / _match_rms_adamw (TOLERANCE 1e-8)
    from statekit.optim.burn_extra import adjust_ratio

    for shape, want in (((512, 512), 1.0), ((1024, 512), math.sqrt(2.0)), ((512, 1024), 1.0)):
        assert abs(adjust_ratio("original", shape) - want) < 1e-8
    for shape, want in (((1024, 512), 0.2 * math.sqrt(1024.0)), ((512, 512), 0.2 * math.sqrt(512.0))):
        assert abs(adjust_ratio("match_rms_adamw", shape) - want) < 1e-8


def test_muon_1d_tensor_refused():  # burn panics: "Newton-Schulz iteration requires 2D tensors, got 1D"
    with pytest.raises(UsageError, match="matrices only"):
        step("muon", np.zeros(512), np.ones(512), {}, 0, lr=0.01)


def test_newton_schulz_orthogonalization():
    from statekit.optim.burn_extra import newton_schulz

    o = newton_schulz(np.array([[1.0, 0.5], [0.5, 1.0]], F), (3.4445, -4.775, 2.0315), 5, 1e-7)
    product = o @ o.T
    assert abs(product[0, 0] - 1.0) < 0.1 and abs(product[1, 1] - 1.0) < 0.1


def test_tall_matrix_transpose():
    from statekit.optim.burn_extra import newton_schulz

    tall = np.array([[1.0, 0.5, 0.3, 0.2], [0.5, 1.0, 0.4, 0.1], [0.3, 0.4, 1.0, 0.5], [0.2, 0.1, 0.5, 1.0],
                     [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.2, 0.4, 0.1, 0.3], [0.3, 0.1, 0.4, 0.2]], F)
    o = newton_schulz(tall, (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert o.shape == (8, 4) and not np.array_equal(o, tall)
    assert newton_schulz(np.ascontiguousarray(tall.T), (3.4445, -4.775, 2.0315), 5, 1e-7).shape == (4, 8)


def test_muon_zero_gradient():
    m = np.array([[1.0, 0.5, 0.3, 0.2], [0.5, 1.0, 0.4, 0.1], [0.3, 0.4, 1.0, 0.5], [0.2, 0.1, 0.5, 1.0]], F)
    p, s, _ = step("muon", m, np.zeros((4, 4)), {}, 0, lr=0.01)
    assert set(s) == {"momentum_buffer"} and np.all(np.abs(p - m) < 1e-6) and not np.isnan(p).any()
    p, _, _ = step("muon", m, np.zeros((4, 4)), {}, 0, lr=0.01, weight_decay=0.01)
    assert not np.isnan(p).any() and np.all(np.abs(p) < np.abs(m))


# ------------------------------------------------------------------- line-by-line transcription

# statekit's hyperparameter names → the transcription's (burn's config fields)
CONFIGS = {
    "lamb": [dict(lr=1e-2), dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.05),
             dict(lr=1e-2, weight_decay=0.01, use_trust_ratio=False)],
    "lion": [dict(lr=1e-3), dict(lr=3e-4, beta1=0.95, beta2=0.98, weight_decay=0.5)],
    "adafactor": [dict(lr=1e-2), dict(lr=0.3, weight_decay=0.01), dict(lr=0.05, relative_step=False),
                  dict(lr=0.05, scale_parameter=False, d=0.5, epsilon_1=1e-3, beta2_decay=-0.5),
                  dict(lr=0.02, relative_step=False, scale_parameter=False, epsilon_2=0.01)],
    "muon": [dict(lr=2e-2), dict(lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
             dict(lr=1e-2, momentum=0.9, dampening=0.1, nesterov=False),
             dict(lr=1e-2, ns_steps=3, eps=1e-5, ns_coefficients=(2.0, -1.5, 0.5))],
}


def burn_config(name, hp):
    """The transcription's config (burn's field names) for statekit's hyperparameters."""
    if name == "lamb":
        return dict(beta_1=hp.get("beta1", 0.9), beta_2=hp.get("beta2", 0.999), epsilon=hp.get("eps", 1e-6),
                    weight_decay=hp.get("weight_decay", 0.0), use_trust_ratio=hp.get("use_trust_ratio", True))
    if name == "lion":
        return dict(beta_1=hp.get("beta1", 0.9), beta_2=hp.get("beta2", 0.99), weight_decay=hp.get("weight_decay", 0.0))
    if name == "adafactor":
        keys = {"epsilon_1": "epsilon_1", "epsilon_2": "epsilon_2", "d": "clip_threshold", "beta2_decay": "decay_rate",
                "relative_step": "relative_step", "scale_parameter": "scale_parameter", "weight_decay": "weight_decay"}
        return {keys[k]: v for k, v in hp.items() if k in keys}
    out = {k: hp[k] for k in ("momentum", "dampening", "nesterov", "ns_steps", "ns_coefficients") if k in hp}
    if "eps" in hp:
        out["epsilon"] = hp["eps"]
    if hp.get("weight_decay"):
        out["weight_decay_penalty"] = hp["weight_decay"]
    out["adjust_lr_fn"] = {"match_rms_adamw": "MatchRmsAdamW"}.get(hp.get("adjust_lr_fn"), "Original")
    return out


def to_slots(name, state, shape):
    """The transcription's state in statekit's slot names."""
    if state is None:
        return {}
    if name == "lamb":
        return {"exp_avg": state["moment_1"].a, "exp_avg_sq": state["moment_2"].a}
    if name == "lion":
        return {"exp_avg": state["momentum"].a}
    if name == "muon":
        return {"momentum_buffer": state["velocity"].a}
    if len(shape) >= 2:
        return {"row_var": state["second_moment"].a, "col_var": state["column_second_moment"].a}
    return {"variance": state["second_moment"].a}


SHAPES = {"lamb": [(5, 7), (13,), (2, 3, 4), (1,)], "lion": [(5, 7), (13,), (2, 3, 4)],
          "adafactor": [(5, 7), (13,), (2, 3, 4), (6, 1), (1,)], "muon": [(5, 7), (9, 3), (1, 6), (4, 4)]}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bit_for_bit_with_the_transcription_over_50_steps(name):
    rng = np.random.default_rng(18)
    for hp in CONFIGS[name]:
        cfg = burn_config(name, hp)
        lr = hp["lr"]
        for shape in SHAPES[name]:
            p0 = rng.normal(size=shape).astype(F)
            ours, slots, t = p0.copy(), {}, 0
            theirs, state = tr.T(p0), None
            for k in range(50):
                scale = 10.0 ** rng.uniform(-4, 1)
                g = (rng.normal(size=shape) * scale).astype(F)
                if k == 7:
                    g[...] = 0  # a zero gradient
                ours, slots, t = registry.step(name, ours, g, slots, t, hp, "burn")
                theirs, state = tr.STEPS[name](cfg, lr, theirs, tr.T(g), state)
                assert ours.tobytes() == theirs.a.tobytes(), (name, hp, shape, k)
                want = to_slots(name, state, shape)
                assert set(slots) == set(want)
                for key, value in want.items():
                    assert slots[key].tobytes() == value.tobytes(), (name, hp, shape, k, key)
                if name in ("lamb", "adafactor"):
                    assert t == state["time"]


# ------------------------------------------------------------------------ fixtures vs transcription

_spec = importlib.util.spec_from_file_location("make_fixtures", ROOT / "scripts" / "make_fixtures.py")
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)

# what scripts/make_burn_optim_fixtures.py trained each record with (its docstring's configs)
FIXTURE_RUNS = {
    "adafactor.bpk": ("adafactor", 1e-2, {}),
    "lamb.bpk": ("lamb", 1e-2, dict(weight_decay=0.01)),
    "lion.bpk": ("lion", 1e-3, dict(weight_decay=0.1)),
    "muon.bpk": ("muon", 2e-2, dict(weight_decay=0.01)),
}
MATRICES = ("l1.weight", "l2.weight")
FIXTURE_STEPS = 7


def _train(rules, order):
    w = base.init_model()
    states = {p: None for p in order}
    data = base.batches()
    for _ in range(FIXTURE_STEPS):
        x, y = next(data)
        grads = base.gradients(w, x, y)
        for path in order:
            name, lr, hp = rules[path]
            new, states[path] = tr.STEPS[name](burn_config(name, hp), lr, tr.T(w[path]), tr.T(grads[path]),
                                               states[path])
            w[path] = new.a
    return states


def _fixture_slots(name):
    with open_checkpoint(str(FIX / name)) as ckpt:
        return {p.path: ({k: v.numpy() for k, v in p.slots.items()}, p.step) for p in ckpt.optimizer.params}


@pytest.mark.parametrize("name", sorted(FIXTURE_RUNS))
def test_fixture_records_equal_the_transcription(name):
    algorithm, lr, hp = FIXTURE_RUNS[name]
    order = MATRICES if algorithm == "muon" else base.ORDER
    states = _train({p: (algorithm, lr, hp) for p in order}, order)
    got = _fixture_slots(name)
    assert set(got) == set(order)
    for path in order:
        slots, time = got[path]
        want = to_slots(algorithm, states[path], base.init_model()[path].shape)
        assert set(slots) == set(want)
        for key, value in want.items():
            assert slots[key].tobytes() == value.tobytes(), (name, path, key)
        if algorithm in ("lamb", "adafactor"):
            assert time == states[path]["time"] == FIXTURE_STEPS


def test_muon_adamw_record_muon_part_equals_the_transcription():
    """The Muon group of the two-group record; its AdamW group is burn AdamW's (statekit's burn flavor,
    checked elsewhere against burn's own arithmetic)."""
    w = base.init_model()
    states, slots, steps = {p: None for p in MATRICES}, {p: {} for p in base.ORDER}, {p: 0 for p in base.ORDER}
    data = base.batches()
    for _ in range(FIXTURE_STEPS):
        x, y = next(data)
        grads = base.gradients(w, x, y)
        for path in base.ORDER:
            if path in MATRICES:
                new, states[path] = tr.muon_step(burn_config("muon", dict(weight_decay=0.01)), 2e-2, tr.T(w[path]),
                                                 tr.T(grads[path]), states[path])
                w[path] = new.a
            else:
                w[path], slots[path], steps[path] = registry.step(
                    "adamw", w[path], grads[path], slots[path], steps[path], dict(lr=1e-2), "burn")
    got = _fixture_slots("muon-adamw.bpk")
    for path in MATRICES:
        assert got[path][0]["momentum_buffer"].tobytes() == states[path]["velocity"].a.tobytes()
    for path in ("l1.bias", "l2.bias"):
        assert got[path][1] == FIXTURE_STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            assert got[path][0][key].tobytes() == slots[path][key].tobytes()


# ------------------------------------------------------------------------------- verify-resume

FIELDS = {"lamb": [("moment_1", "moment_1"), ("moment_2", "moment_2")], "lion": [("momentum", "momentum")],
          "muon": [("momentum.velocity", "velocity")]}
TWIN = {"a.weight": 101, "b.weight": 202, "c.bias": 303}  # a and b share a shape: their moments can be swapped


def _write_record(path, name, states, shapes, swap=False):
    tensors, scalars, meta = [], {}, {}
    arrays = {}
    for p in TWIN:
        st = states[p]
        if name == "adafactor":
            fields = [("second_moment", st["second_moment"].a)]
            if st.get("column_second_moment") is not None:
                fields.append(("column_second_moment", st["column_second_moment"].a))
        else:
            fields = [(native, st[key].a) for native, key in FIELDS[name]]
        arrays[p] = fields
    if swap:
        arrays["a.weight"], arrays["b.weight"] = arrays["b.weight"], arrays["a.weight"]
    for p, pid in TWIN.items():
        for native, arr in arrays[p]:
            tensors.append(PackTensor(f"{pid}.{native}", TensorRef.from_array(np.ascontiguousarray(arr)), param_id=pid))
        scalars[f"{pid}.__rank"] = Scalar("UInt", len(shapes[p]))
        if name in ("lamb", "adafactor"):
            scalars[f"{pid}.time"] = Scalar("UInt", states[p]["time"])
        meta[str(pid)] = p
    write_burnpack(str(path), tensors, meta, scalars)


@pytest.mark.parametrize("name", ["lamb", "lion", "adafactor", "muon"])
def test_verify_resume_copy_0_swapped_same_shape_moment_1(name, tmp_path, cli):
    rng = np.random.default_rng(5)
    shapes = {"a.weight": (6, 4), "b.weight": (6, 4), "c.bias": (4,) if name != "muon" else (4, 3)}
    cfg, lr = burn_config(name, {}), 1e-2
    states = {}
    for p, shape in shapes.items():
        theta, st = tr.T(rng.normal(size=shape)), None
        for _ in range(4):
            theta, st = tr.STEPS[name](cfg, lr, theta, tr.T(rng.normal(size=shape)), st)
        states[p] = st
    _write_record(tmp_path / "orig.bpk", name, states, shapes)
    _write_record(tmp_path / "swapped.bpk", name, states, shapes, swap=True)
    (tmp_path / "copy.bpk").write_bytes((tmp_path / "orig.bpk").read_bytes())
    extra = ["--optimizer", "muon"] if name == "muon" else []
    ok = cli("verify-resume", tmp_path / "orig.bpk", tmp_path / "copy.bpk", "--lr", "0.01", *extra)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "bit-exact" in ok.stdout
    bad = cli("verify-resume", tmp_path / "orig.bpk", tmp_path / "swapped.bpk", "--lr", "0.01", *extra)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "a.weight" in bad.stdout and "b.weight" in bad.stdout


def test_adan_fixture_equals_burns_adan_flavor():
    """The Adan record (the rest of burn's 11 beside the hand-optim-* records) against statekit's
    burn Adan flavor, itself checked against hand-computed values in test_optim_frameworks."""
    w = base.init_model()
    slots, steps = {p: {} for p in base.ORDER}, {p: 0 for p in base.ORDER}
    data = base.batches()
    for _ in range(FIXTURE_STEPS):
        x, y = next(data)
        grads = base.gradients(w, x, y)
        for path in base.ORDER:
            w[path], slots[path], steps[path] = registry.step("adan", w[path], grads[path], slots[path], steps[path],
                                                              dict(lr=1e-2), "burn")
    got = _fixture_slots("adan.bpk")
    for path in base.ORDER:
        assert got[path][1] == FIXTURE_STEPS
        assert set(got[path][0]) == set(slots[path])
        for key, value in slots[path].items():
            assert got[path][0][key].tobytes() == value.tobytes(), (path, key)


GRADIENT_SCRIPT = r"""
import hashlib, importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("make_fixtures", sys.argv[1])
base = importlib.util.module_from_spec(spec)
spec.loader.exec_module(base)
w, data = base.init_model(), base.batches()
ours, blas = hashlib.sha256(), hashlib.sha256()
for _ in range(4):
    x, y = next(data)
    for g in base.gradients(w, x, y).values():
        ours.update(g.tobytes())
    h = np.maximum(x @ w["l1.weight"], np.float32(0))
    blas.update((x.T @ h).tobytes() + (h @ w["l2.weight"]).tobytes())
print(ours.hexdigest(), blas.hexdigest())
"""


def test_fixture_gradients_do_not_depend_on_the_blas_kernel():
    """The training gradients behind every fixture (``scripts/make_fixtures.py``'s ``gradients``,
    which this file's transcription runs too) are the same bits whichever kernel OpenBLAS runs:
    numpy's own ``@`` differs between them (the fixtures once failed on an AVX2 machine because of
    it), the fixed-order products do not. OpenBLAS's kernel is pinned with ``OPENBLAS_CORETYPE``
    in a subprocess, for the kernels every x86-64 CPU can run."""
    import os
    import subprocess
    import sys

    hashes = {}
    for core in ("Haswell", "SandyBridge", "Nehalem", "Prescott"):
        env = dict(os.environ, OPENBLAS_CORETYPE=core, OPENBLAS_NUM_THREADS="1")
        done = subprocess.run([sys.executable, "-c", GRADIENT_SCRIPT, str(ROOT / "scripts" / "make_fixtures.py")],
                              env=env, capture_output=True, text=True, check=True)
        hashes[core] = done.stdout.split()
    assert len({ours for ours, _ in hashes.values()}) == 1, hashes
    assert len({blas for _, blas in hashes.values()}) > 1, "the BLAS kernels should round differently"
