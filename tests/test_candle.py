"""candle: VarMap model files and the candle AdamW state layout (docs/candle.md)."""

from __future__ import annotations

import importlib.util
import json
import warnings
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from conftest import ROOT
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from statekit import io
from statekit.errors import FormatError, MappingError
from statekit.frameworks import burn_legacy_io, candle, safetensors_io
from statekit.state import ModelInfo, ModelParam, OptimizerState, ParamGroup, ParamState
from statekit.tensor import TensorRef

CANDLE = ROOT / "fixtures" / "candle"
LEGACY = ROOT / "fixtures" / "legacy"
NAMES = ["l1.bias", "l1.weight", "l2.bias", "l2.weight"]
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _script():
    spec = importlib.util.spec_from_file_location("make_candle_fixtures", ROOT / "scripts" / "make_candle_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


S = _script()
WEIGHTS, M, V = S.train()


def make_state(steps: dict[str, int] | None = None, dtype=np.float32, **kw) -> OptimizerState:
    params = []
    for name in NAMES:
        params.append(ParamState(key=name, path=name, rank=M[name].ndim, step=(steps or {}).get(name, 21),
                                 family="adamw", slots={"exp_avg": TensorRef.from_array(M[name].astype(dtype)),
                                                        "exp_avg_sq": TensorRef.from_array(V[name].astype(dtype))}))
    state = OptimizerState(family="adamw", candidates=("adamw",), params=params, framework="candle",
                           groups=[ParamGroup(dict(HYPER), list(NAMES))], hyperparams_stored=True,
                           notes=[candle.ONE_STEP_NOTE])
    return replace(state, **kw)


def assert_same_state(a: OptimizerState, b: OptimizerState) -> None:
    assert (a.family, a.candidates, a.framework, a.hyperparams_stored) == (b.family, b.candidates, b.framework,
                                                                           b.hyperparams_stored)
    assert [g.hyperparams for g in a.groups] == [g.hyperparams for g in b.groups]
    assert [g.keys for g in a.groups] == [g.keys for g in b.groups]
    assert len(a.params) == len(b.params)
    for p, q in zip(a.params, b.params, strict=True):
        assert (p.key, p.id, p.path, p.rank, p.step, type(p.step), p.family) == (
            q.key, q.id, q.path, q.rank, q.step, type(q.step), q.family)
        assert list(p.slots) == list(q.slots)
        for slot in p.slots:
            x, y = p.slots[slot], q.slots[slot]
            assert (x.dtype, tuple(x.shape)) == (y.dtype, tuple(y.shape))
            assert bytes(x.raw()) == bytes(y.raw())


# ----------------------------------------------------------------------------- fixtures


def test_fixtures_match_the_script(tmp_path):
    assert S.main(["--check"]) == 0


def test_read_candle_state_fixture():
    with io.open_checkpoint(CANDLE / "optimizer.safetensors") as ckpt:
        assert (ckpt.format, ckpt.kind, ckpt.version) == ("candle", "optimizer", 1)
        assert ckpt.n_tensors == 9 and ckpt.metadata["format"] == "statekit.candle_adamw"
        state = ckpt.optimizer
        assert (state.framework, state.family, state.candidates) == ("candle", "adamw", ("adamw",))
        assert state.hyperparams_stored and state.groups[0].hyperparams == HYPER
        assert [p.path for p in state.params] == NAMES == state.groups[0].keys
        for p in state.params:
            assert (p.key, p.step, p.rank, p.id) == (p.path, 21, M[p.path].ndim, None)
            np.testing.assert_array_equal(p.slots["exp_avg"].numpy(), M[p.path])
            np.testing.assert_array_equal(p.slots["exp_avg_sq"].numpy(), V[p.path])
        assert state.find("l1.weight").shape == (16, 4)  # candle Linear: [out, in]


def test_read_candle_state_without_metadata():
    with io.open_checkpoint(CANDLE / "optimizer-nometa.safetensors") as ckpt:
        assert ckpt.format == "candle" and not ckpt.optimizer.hyperparams_stored
        assert ckpt.optimizer.groups[0].hyperparams == {}
        assert any("no statekit metadata" in n for n in ckpt.optimizer.notes)
        assert [p.step for p in ckpt.optimizer.params] == [21] * 4


def test_varmap_model_files(tmp_path):
    with io.open_checkpoint(CANDLE / "model.safetensors") as ckpt:
        assert (ckpt.format, ckpt.kind, ckpt.n_tensors, ckpt.nbytes) == ("safetensors", "model", 4, 388)
        model = ckpt.model
        assert [(p.path, p.shape, p.dtype, p.id, p.buffer) for p in model.params] == [
            (n, WEIGHTS[n].shape, "F32", None, False) for n in NAMES
        ]
        for p in model.params:
            np.testing.assert_array_equal(p.tensor.numpy(), WEIGHTS[p.path])
        out = tmp_path / "m.safetensors"
        size = safetensors_io.save_model(model, str(out))
        assert size == out.stat().st_size
        assert out.read_bytes() == (CANDLE / "model.safetensors").read_bytes()  # as the safetensors writer
    with io.open_checkpoint(CANDLE / "model-bf16.safetensors") as ckpt:
        w = ckpt.model.by_path()["l1.weight"]
        assert w.dtype == "BF16" and w.tensor.numpy().dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(w.tensor.numpy(), WEIGHTS["l1.weight"].astype(ml_dtypes.bfloat16))
        assert w.tensor.nbytes == 128 and len(bytes(w.tensor.raw())) == 128
        out = tmp_path / "b.safetensors"
        safetensors_io.save_model(ckpt.model, str(out))
        assert out.read_bytes() == (CANDLE / "model-bf16.safetensors").read_bytes()


def test_integer_and_empty_model_files(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"emb.weight": np.ones((3, 2), np.float16), "bn.num_batches_tracked": np.array(5, np.int64),
               "mask": np.array([True, False])}, str(path), metadata={"format": "pt"})
    with io.open_checkpoint(path) as ckpt:
        by = ckpt.model.by_path()
        assert ckpt.kind == "model" and ckpt.metadata == {"format": "pt"}
        assert (by["bn.num_batches_tracked"].buffer, by["bn.num_batches_tracked"].shape) == (True, ())
        assert by["mask"].dtype == "Bool" and by["mask"].tensor.numpy().tolist() == [True, False]
        assert by["emb.weight"].dtype == "F16" and not by["emb.weight"].buffer
    save_file({}, str(path))
    with io.open_checkpoint(path) as ckpt:
        assert ckpt.kind == "empty" and ckpt.model.params == []


# ----------------------------------------------------------------------------- round trips


def test_candle_layout_round_trips_bit_exactly(tmp_path):
    state = make_state()
    out = tmp_path / "optimizer.safetensors"
    size = candle.save_optimizer(state, str(out), family="adamw", groups=[dict(HYPER)], metadata={})
    assert size == out.stat().st_size
    with io.open_checkpoint(out) as ckpt:
        assert ckpt.format == "candle"
        assert_same_state(ckpt.optimizer, state)
    # safetensors.numpy loads it with the documented names and dtypes
    loaded = load_file(str(out))
    assert set(loaded) == {"step_t"} | {f"first_moment.{n}" for n in NAMES} | {f"second_moment.{n}" for n in NAMES}
    assert loaded["step_t"].dtype == np.int64 and loaded["step_t"].shape == () and int(loaded["step_t"]) == 21
    for n in NAMES:
        np.testing.assert_array_equal(loaded[f"first_moment.{n}"], M[n])
        np.testing.assert_array_equal(loaded[f"second_moment.{n}"], V[n])
    with safe_open(str(out), framework="np") as f:
        meta = f.metadata()
        assert list(f.offset_keys())[0] == "step_t"  # writers order by dtype alignment, then name
    assert meta == S.metadata()  # the fixture's metadata: format tag, optimizer, step_t, five values, source
    assert meta["lr"] == "0.01" and meta["eps"] == "1e-08" and float(meta["beta2"]) == 0.999
    assert S.content(out) == S.content(CANDLE / "optimizer.safetensors")  # same content as the fixture


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_candle_layout_keeps_dtypes(tmp_path, dtype):
    state = make_state(dtype=dtype)
    out = tmp_path / "o.safetensors"
    candle.save_optimizer(state, str(out), groups=[dict(HYPER)])
    with io.open_checkpoint(out) as ckpt:
        assert_same_state(ckpt.optimizer, state)
    assert load_file(str(out))["first_moment.l1.weight"].dtype == np.dtype(dtype)


def test_legacy_burn_state_to_candle(tmp_path):
    """burn [in, out] Linear moments, transposed to candle's [out, in], written and read back."""
    with burn_legacy_io.open_checkpoint(str(LEGACY / "adam_full.mpk"), model=str(LEGACY / "model-21.mpk")) as ckpt:
        src = ckpt.optimizer
        moved = []
        for p in src.params:
            t = p.path.endswith(".weight")
            slots = {k: TensorRef.from_array(np.ascontiguousarray(r.numpy().T) if t else r.numpy())
                     for k, r in p.slots.items()}
            moved.append(replace(p, slots=slots))
        state = replace(src, params=moved)
        out = tmp_path / "o.safetensors"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            candle.save_optimizer(state, str(out), family="adam", groups=[{"lr": 1e-3, "weight_decay": 0.0}],
                                  metadata={"converted_from": "adam_full.mpk"})
        assert any("beta1=0.9" in str(w.message) and "eps=1e-08" in str(w.message) for w in caught)
    truth = np.load(LEGACY / "truth.npz")
    with io.open_checkpoint(out) as back:
        st = back.optimizer
        assert back.metadata["source"] == "burn adam" and back.metadata["converted_from"] == "adam_full.mpk"
        assert st.groups[0].hyperparams["weight_decay"] == 0.0
        for pid, path in zip(truth["ids"].tolist(), truth["paths"].tolist(), strict=True):
            p = st.find(path)
            want = truth[f"{pid}.momentum.moment_1"]
            np.testing.assert_array_equal(p.slots["exp_avg"].numpy(), want.T if path.endswith("weight") else want)
            assert p.step == 21


@pytest.mark.slow
def test_torch_adamw_to_candle(tmp_path):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("l1", torch.nn.Linear(4, 16))
    model.add_module("act", torch.nn.ReLU())
    model.add_module("l2", torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    pt = tmp_path / "optim.pt"
    torch.save(opt.state_dict(), pt)
    names = [n for n, _ in model.named_parameters()]
    with io.open_checkpoint(pt) as ckpt:
        state = ckpt.optimizer
        for p, name in zip(state.params, names, strict=True):
            p.path = name
        out = tmp_path / "o.safetensors"
        candle.save_optimizer(state, str(out), family=state.family, groups=[g.hyperparams for g in state.groups])
    with io.open_checkpoint(out) as back:
        st = back.optimizer
        h = st.groups[0].hyperparams
        assert (h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"]) == (1e-2, 0.9, 0.999, 1e-8, 0.05)
        sd = opt.state_dict()["state"]
        for i, name in enumerate(names):
            p = st.find(name)
            assert p.step == 5 and isinstance(p.step, int)
            assert bytes(p.slots["exp_avg"].raw()) == sd[i]["exp_avg"].numpy().tobytes()
            assert bytes(p.slots["exp_avg_sq"].raw()) == sd[i]["exp_avg_sq"].numpy().tobytes()


def test_candle_state_to_burn_records(tmp_path):
    """candle → burn: paths join the model's ids, weights transpose back to [in, out]."""
    from statekit.formats.burnpack import write_burnpack
    from statekit.frameworks import burn

    ids = {"l1.weight": 1, "l1.bias": 2, "l2.weight": 3, "l2.bias": 4}
    with io.open_checkpoint(CANDLE / "optimizer.safetensors") as ckpt:
        params = []
        for p in ckpt.optimizer.params:
            t = p.path.endswith(".weight")
            slots = {k: TensorRef.from_array(np.ascontiguousarray(r.numpy().T) if t else r.numpy())
                     for k, r in p.slots.items()}
            params.append(replace(p, key=str(ids[p.path]), id=ids[p.path], slots=slots))
        state = replace(ckpt.optimizer, params=params, framework="burn")
        out = tmp_path / "o.bpk"
        write_burnpack(out, *burn.to_pack(state))
    with io.open_checkpoint(out) as back:
        p = back.optimizer.find("l1.weight")
        assert (p.id, p.step, p.shape) == (1, 21, (4, 16))
        np.testing.assert_array_equal(p.slots["exp_avg"].numpy(), M["l1.weight"].T)


# ----------------------------------------------------------------------------- refusals


def save(state, tmp_path, **kw):
    kw.setdefault("groups", [dict(HYPER)])
    return candle.save_optimizer(state, str(tmp_path / "o.safetensors"), **kw)


def test_refuses_differing_steps_unless_max(tmp_path):
    state = make_state(steps={"l2.bias": 5, "l2.weight": 5})
    with pytest.raises(MappingError, match=r"one step_t.*l2.bias, l2.weight at 5.*--step max"):
        save(state, tmp_path)
    assert not (tmp_path / "o.safetensors").exists()
    told: list[str] = []
    save(state, tmp_path, step_policy="max", on_warning=told.append)
    assert told and "step_t = 21" in told[0]
    with pytest.warns(UserWarning, match="steps differ"):
        save(state, tmp_path, step_policy="max")
    with io.open_checkpoint(tmp_path / "o.safetensors") as ckpt:
        assert {p.step for p in ckpt.optimizer.params} == {21}
    with pytest.raises(MappingError, match="step policy"):
        save(make_state(), tmp_path, step_policy="min")


def test_refuses_l2_adam_but_takes_adam_without_decay(tmp_path):
    state = make_state(family="adam")
    with pytest.raises(MappingError, match=r"L2-Adam \(adam with weight_decay=0.01\)"):
        save(state, tmp_path, family="adam")
    save(state, tmp_path, family="adam", groups=[dict(HYPER, weight_decay=0)])
    torch_adamw = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "decoupled_weight_decay": True}
    save(state, tmp_path, family="adam", groups=[torch_adamw])
    with io.open_checkpoint(tmp_path / "o.safetensors") as ckpt:
        assert ckpt.metadata["source"] == "candle adamw" and ckpt.optimizer.groups[0].hyperparams["weight_decay"] == 0.01


def test_refuses_amsgrad(tmp_path):
    state = make_state()
    state.params[1].slots["max_exp_avg_sq"] = state.params[1].slots["exp_avg_sq"]
    with pytest.raises(MappingError, match=r"amsgrad.*l1.weight hold max_exp_avg_sq"):
        save(state, tmp_path)
    with pytest.raises(MappingError, match="amsgrad"):
        save(make_state(), tmp_path, groups=[dict(HYPER, amsgrad=True)])


def test_refuses_groups_with_different_hyperparameters(tmp_path):
    state = make_state()
    state.params[2].group = state.params[3].group = 1
    groups = [dict(HYPER), dict(HYPER, lr=1e-3, weight_decay=0.0)]
    with pytest.raises(MappingError, match=r"several param groups with different lr / weight_decay"):
        save(state, tmp_path, groups=groups)
    save(state, tmp_path, groups=[dict(HYPER), dict(HYPER)])  # identical groups merge
    with pytest.raises(MappingError, match="group 1 has no hyperparameters"):
        save(state, tmp_path, groups=[dict(HYPER)])


def test_refuses_what_candle_cannot_hold(tmp_path):
    with pytest.raises(MappingError, match="AdamW only; sgd"):
        save(make_state(family="sgd"), tmp_path, family="sgd")
    with pytest.raises(MappingError, match="maximize"):
        save(make_state(), tmp_path, groups=[dict(HYPER, maximize=True)])
    nameless = make_state()
    nameless.params[0].path = None
    with pytest.raises(MappingError, match="has no name"):
        save(nameless, tmp_path)
    dup = make_state()
    dup.params[1].path = dup.params[0].path
    with pytest.raises(MappingError, match="both named"):
        save(dup, tmp_path)
    odd = make_state()
    odd.params[0].slots["momentum_buffer"] = odd.params[0].slots["exp_avg"]
    with pytest.raises(MappingError, match="no field for momentum_buffer"):
        save(odd, tmp_path)
    stepless = make_state()
    stepless.params[0].step = 2.5
    with pytest.raises(MappingError, match="not a whole count"):
        save(stepless, tmp_path)


def test_params_without_state_are_left_out(tmp_path):
    state = make_state()
    state.params.append(ParamState(key="l3.weight", path="l3.weight", declared_shape=(2, 2)))
    save(state, tmp_path)
    assert "first_moment.l3.weight" not in load_file(str(tmp_path / "o.safetensors"))


# ----------------------------------------------------------------------------- reading errors


def test_bad_candle_files(tmp_path):
    path = tmp_path / "o.safetensors"
    base = {k: v for k, v in load_file(str(CANDLE / "optimizer.safetensors")).items()}
    meta = S.metadata()
    cases = [
        ({k: v for k, v in base.items() if k != "second_moment.l1.bias"}, meta, "no second_moment"),
        ({k: v for k, v in base.items() if k != "step_t"}, meta, "no step_t"),
        (base | {"step_t": np.array([1.5], np.float32)}, meta, "0-dim integer"),
        (base | {"extra": np.ones(1, np.float32)}, meta, "not part of the candle AdamW layout"),
        (base | {"second_moment.zz": np.ones(1, np.float32)}, meta, "no matching first_moment"),
        (base | {"second_moment.l1.bias": np.ones(3, np.float32)}, meta, "first_moment is F32 \\[16\\]"),
        (base, meta | {"lr": "fast"}, "lr='fast' is not a number"),
        (base, meta | {"format_version": "2"}, "version '2'"),
    ]
    for tensors, md, match in cases:
        save_file(tensors, str(path), metadata=md)
        with pytest.raises(FormatError, match=match):
            io.open_checkpoint(path)
    save_file(base, str(path), metadata=meta | {"step_t": "3"})
    with io.open_checkpoint(path) as ckpt:
        assert any("step_t=3" in w for w in ckpt.warnings)


def test_broken_safetensors_is_one_line(tmp_path, cli):
    path = tmp_path / "x.safetensors"
    data = (CANDLE / "optimizer.safetensors").read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(FormatError, match="not a valid safetensors file"):
        io.open_checkpoint(path)
    r = cli("inspect", str(path))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "x.safetensors" in r.stderr


def test_closed_file_refuses_reads():
    ckpt = io.open_checkpoint(CANDLE / "optimizer.safetensors")
    ref = ckpt.optimizer.params[0].slots["exp_avg"]
    ckpt.close()
    with pytest.raises(FormatError, match="closed"):
        ref.numpy()


# ----------------------------------------------------------------------------- CLI


def test_cli_inspect_candle_state(cli):
    r = cli("inspect", "fixtures/candle/optimizer.safetensors")
    assert r.returncode == 0, r.stderr
    assert "candle v1 · optimizer (adamw) · 4 params · 9 tensors" in r.stdout
    assert "l1.weight" in r.stdout and "16×4" in r.stdout and "one step_t" in r.stdout
    d = json.loads(cli("inspect", "fixtures/candle/optimizer.safetensors", "--json").stdout)
    assert (d["format"], d["kind"], d["family"], d["hyperparameters_stored"]) == ("candle", "optimizer", "adamw", True)
    assert d["groups"] == [{"hyperparameters": HYPER, "params": 4}]
    l1 = next(p for p in d["params"] if p["path"] == "l1.weight")
    assert (l1["id"], l1["rank"], l1["shape"], l1["dtype"], l1["step"]) == (None, 2, [16, 4], "F32", 21)
    assert set(l1["fields"]) == {"first_moment", "second_moment"}  # candle's own names (naming.CANDLE)
    d = json.loads(cli("inspect", "fixtures/candle/model.safetensors", "--json", "--stats").stdout)
    assert d["kind"] == "model" and [p["path"] for p in d["params"]] == NAMES
    assert d["params"][1]["stats"]["max"] == pytest.approx(float(WEIGHTS["l1.weight"].max()))


def test_model_info_for_remap_from_candle():
    info = burn_legacy_io.load_model_info(str(CANDLE / "model.safetensors"))
    assert isinstance(info, ModelInfo) and set(info.by_path()) == set(NAMES)
    assert isinstance(info.params[0], ModelParam) and info.by_id() == {}


@pytest.mark.parametrize("second", [(1,), (1, 1)])
def test_weights_named_like_candle_state_are_written_back_as_weights(tmp_path, cli, second):
    """Weights whose names are all candle AdamW's (first_moment.*, second_moment.*, step_t), tagged
    as weights (``{"format": "pt"}``), were converted to an untagged file that statekit then read as
    candle state — refusing it when two shapes differ (fuzz crasher safetensors-126609f3922d:
    "statekit wrote out.safetensors and refuses to read it back"), silently becoming optimizer state
    otherwise. They are written tagged, and read back as the weights they are."""
    names = {"first_moment.l1.bias": np.ones(1, np.float32), "second_moment.l1.bias": np.ones(second, np.float32),
             "step_t": np.array(3, np.int64)}
    save_file(names, str(tmp_path / "w.safetensors"), metadata={"format": "pt"})
    r = cli("convert", tmp_path / "w.safetensors", tmp_path / "out.safetensors")
    assert r.returncode == 0, r.stderr
    again = json.loads(cli("inspect", tmp_path / "out.safetensors", "--json").stdout)
    assert again["kind"] == "model" and sorted(p["path"] for p in again["params"]) == sorted(names)
    with safe_open(str(tmp_path / "out.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}
    plain = {"l1.weight": np.ones((2, 2), np.float32)}  # other weights stay untagged, as candle's VarMap::save
    save_file(plain, str(tmp_path / "p.safetensors"))
    assert cli("convert", tmp_path / "p.safetensors", tmp_path / "p2.safetensors").returncode == 0
    with safe_open(str(tmp_path / "p2.safetensors"), "np") as f:
        assert not f.metadata()
