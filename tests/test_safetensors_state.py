"""statekit's generic safetensors layout (docs/safetensors-layout.md): any state, round trip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import FIXTURES
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from statekit import io
from statekit.errors import FormatError, MappingError
from statekit.formats.burnpack import Scalar, write_burnpack
from statekit.frameworks import burn, safetensors_io
from statekit.state import OptimizerState, ParamGroup, ParamState
from statekit.tensor import TensorRef


def same_value(a: object, b: object) -> bool:
    """Equality that also checks types (tuple vs list, int vs float) and handles NaN and tensors."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, TensorRef):
        return (a.dtype, tuple(a.shape), bytes(a.raw())) == (b.dtype, tuple(b.shape), bytes(b.raw()))
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, Scalar):
        return a.kind == b.kind and same_value(a.value, b.value)
    return a == b


def assert_same_state(a: OptimizerState, b: OptimizerState) -> None:
    for attr in ("family", "candidates", "framework", "hyperparams_stored", "notes", "global_scalars"):
        assert same_value(getattr(a, attr), getattr(b, attr)), attr
    assert same_value(a.global_slots, b.global_slots)
    assert len(a.groups) == len(b.groups)
    for g, h in zip(a.groups, b.groups, strict=True):
        assert same_value(g.hyperparams, h.hyperparams) and g.keys == h.keys
    assert len(a.params) == len(b.params)
    for p, q in zip(a.params, b.params, strict=True):
        for attr in ("key", "id", "index", "path", "rank", "step", "group", "family", "declared_shape", "extra", "slots"):
            assert same_value(getattr(p, attr), getattr(q, attr)), (p.key, attr)


def round_trip(state: OptimizerState, tmp_path: Path, name: str = "s.safetensors", **kw) -> Path:
    out = tmp_path / name
    size = safetensors_io.save_state(state, str(out), **kw)
    assert size == out.stat().st_size
    with io.open_checkpoint(out) as ckpt:
        assert (ckpt.format, ckpt.kind, ckpt.version) == ("safetensors", "optimizer", 1)
        assert_same_state(ckpt.optimizer, state)
    return out


@pytest.mark.parametrize("name", ["hand-optim.bpk", "hand-optim-amsgrad.bpk", "hand-optim-sgd.bpk",
                                  "hand-optim-rmsprop.bpk", "hand-optim-adagrad.bpk", "hand-optim-bf16.bpk",
                                  "hand-optim-019.bpk"])
def test_burnpack_states_round_trip(tmp_path, name):
    with io.open_checkpoint(FIXTURES / name) as ckpt:
        out = round_trip(ckpt.optimizer, tmp_path)
    if name == "hand-optim.bpk":
        # the documented names, readable by any safetensors reader
        loaded = load_file(str(out))
        assert set(loaded) == {f"state/{pid}/{slot}" for pid in ("18402649998147242804", "4872954564708272749",
                                                               "708128169117982014", "2021826497617271949")
                               for slot in ("exp_avg", "exp_avg_sq")}
        with safe_open(str(out), framework="np") as f:
            meta = f.metadata()
        assert (meta["format"], meta["format_version"], meta["framework"]) == ("statekit.state", "1", "burn")
        params = json.loads(meta["params"])
        assert params[0] == {
            "key": "18402649998147242804", "id": "18402649998147242804", "index": None, "path": "l1.weight",
            "rank": 2, "step": 21, "group": 0, "family": "adam", "declared_shape": None,
            "slots": {"exp_avg": "state/18402649998147242804/exp_avg",
                      "exp_avg_sq": "state/18402649998147242804/exp_avg_sq"},
            "extra": {"__step_kind": "UInt"},
        }
        assert json.loads(meta["candidates"]) == ["adam", "adamw"]


def test_generic_file_back_to_the_identical_burnpack(tmp_path):
    with io.open_checkpoint(FIXTURES / "hand-optim.bpk") as ckpt:
        safetensors_io.save_state(ckpt.optimizer, str(tmp_path / "s.safetensors"))
    with io.open_checkpoint(tmp_path / "s.safetensors") as back:
        write_burnpack(tmp_path / "back.bpk", *burn.to_pack(back.optimizer))
    assert (tmp_path / "back.bpk").read_bytes() == (FIXTURES / "hand-optim.bpk").read_bytes()


def test_legacy_state_round_trips(tmp_path):
    with io.open_checkpoint(FIXTURES / "legacy" / "adam_half.mpk.gz", model=str(FIXTURES / "legacy" / "model-21.mpk")) as ckpt:
        round_trip(ckpt.optimizer, tmp_path)


def torch_adam_state(tmp_path: Path, **opt_kw) -> Path:
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 5e-3}]
    opt = torch.optim.Adam(groups, lr=1e-2, **opt_kw)
    for _ in range(7):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    path = tmp_path / "optim.pt"
    torch.save(opt.state_dict(), path)
    return path


def test_real_torch_adam_state_round_trips(tmp_path):
    torch = pytest.importorskip("torch")
    pt = torch_adam_state(tmp_path, amsgrad=True, weight_decay=0.1)
    with io.open_checkpoint(pt) as ckpt:
        state = ckpt.optimizer
        assert state.framework == "torch" and len(state.groups) == 2
        out = round_trip(state, tmp_path)
    sd = torch.load(pt, weights_only=True)
    loaded = load_file(str(out))
    for idx, entry in sd["state"].items():
        for slot in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            np.testing.assert_array_equal(loaded[f"state/{idx}/{slot}"], entry[slot].numpy())
    with io.open_checkpoint(out) as back:
        st = back.optimizer
        assert st.params[0].step == 7.0 and isinstance(st.params[0].step, float)
        assert st.groups[1].hyperparams["lr"] == 5e-3 and st.groups[1].hyperparams["betas"] == (0.9, 0.999)
        assert st.groups[0].hyperparams["foreach"] is None and st.params[0].extra["__step_dtype"] == "F32"


def test_state_built_by_hand_with_every_kind_of_value(tmp_path):
    lr = TensorRef.from_array(np.array(0.01, np.float32))
    params = [
        ParamState(key="0", index=0, path="w", rank=2, step=3.0, family="adam", group=0,
                   slots={"exp_avg": TensorRef.from_array(np.arange(6, dtype=np.float64).reshape(2, 3)),
                          "exp_avg_sq": TensorRef.from_array(np.ones((2, 3), ml_dtypes.bfloat16))},
                   extra={"__step_dtype": "F32", "odd": {"__tuple__": 1}, "ints": {1: "a", 2: (3, 4)},
                          "buf": TensorRef.from_array(np.array([1, 2], np.int32)), "s": Scalar("Int", -2),
                          "bad": float("nan"), "inf": float("-inf"), "n": np.float64(2.5)}),
        ParamState(key="1", index=1, path=None, rank=None, step=None, declared_shape=(5,), group=1),
        ParamState(key="x/y", id=18446744073709551615, rank=0, step=12,
                   slots={"sum": TensorRef.from_array(np.array(4.0, np.float16))}),
    ]
    flex = TensorRef.from_array(np.ones(3, np.float32))
    flex.dtype = "Flex32"
    params[2].slots["flex"] = flex
    state = OptimizerState(
        family="mixed", candidates=(), params=params, framework="neutral", hyperparams_stored=True,
        groups=[ParamGroup({"lr": lr, "betas": (0.9, 0.99), "nested": {"a": [1, (2, 3)]}}, ["0", "x/y"]),
                ParamGroup({"lr": float("inf")}, ["1"])],
        global_slots={"d": TensorRef.from_array(np.zeros(2, np.float32))},
        global_scalars={"g_iter": 3, "prev_loss": 0.5},
        notes=["a", "ü"],
    )
    state.params[0].extra["n"] = 2.5  # numpy scalars come back as Python numbers
    out = round_trip(state, tmp_path, metadata={"origin": "test", "format": "ignored"})
    with io.open_checkpoint(out) as ckpt:
        assert ckpt.metadata["origin"] == "test" and ckpt.metadata["format"] == "statekit.state"
        assert "params" not in ckpt.metadata
        assert ckpt.optimizer.params[2].slots["flex"].dtype == "Flex32"
    names = set(load_file(str(out)))
    assert {"state/0/exp_avg", "state/0/extra/buf", "groups/0/lr", "global/d", "state/x/y/sum"} <= names


def test_lbfgs_global_state(tmp_path):
    state = OptimizerState(family="lbfgs", candidates=("lbfgs",), framework="burn",
                           global_slots={"d": TensorRef.from_array(np.arange(3, dtype=np.float32))},
                           global_scalars={"g_iter": 4, "history_s.len": 0})
    round_trip(state, tmp_path)


def test_save_optimizer_interface(tmp_path):
    with io.open_checkpoint(FIXTURES / "hand-optim.bpk") as ckpt:
        out = tmp_path / "s.safetensors"
        safetensors_io.save_optimizer(ckpt.optimizer, str(out), family="adamw",
                                      groups=[{"lr": 1e-3, "weight_decay": 1e-4}], metadata={"plan": "x"})
    with io.open_checkpoint(out) as back:
        st = back.optimizer
        assert (st.family, st.candidates, st.hyperparams_stored) == ("adamw", ("adamw",), True)
        assert st.groups[0].hyperparams == {"lr": 1e-3, "weight_decay": 1e-4} and len(st.groups[0].keys) == 4
        assert back.metadata["plan"] == "x"
    with pytest.raises(MappingError, match="2 hyperparameter sets"):
        safetensors_io.save_optimizer(st, str(out), groups=[{}, {}])


def test_refusals(tmp_path):
    q = TensorRef(dtype="QFloat", shape=(4,), loader=lambda: b"\0" * 4, nbytes_hint=4)
    with pytest.raises(MappingError, match="QFloat"):
        safetensors_io.save_state(OptimizerState(family=None, params=[ParamState(key="0", slots={"q": q})]),
                                  str(tmp_path / "q.safetensors"))
    twice = OptimizerState(family=None, params=[ParamState(key="0"), ParamState(key="0")])
    with pytest.raises(MappingError, match="share the key"):
        safetensors_io.save_state(twice, str(tmp_path / "d.safetensors"))
    odd = OptimizerState(family=None, params=[ParamState(key="0", extra={"f": object()})])
    with pytest.raises(MappingError, match="object value cannot be stored"):
        safetensors_io.save_state(odd, str(tmp_path / "o.safetensors"))
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_writer_matches_the_safetensors_writer(tmp_path):
    tensors = {
        "b": np.arange(3, dtype=np.float32), "a": np.ones((2, 2), np.float16), "i": np.array(7, np.int64),
        "m": np.array([True, False]), "z": np.zeros((0, 3), np.float64), "u": np.arange(5, dtype=np.uint8),
        "h": np.ones(2, ml_dtypes.bfloat16),
    }
    save_file(tensors, str(tmp_path / "ref.safetensors"))
    save_file(tensors, str(tmp_path / "meta.safetensors"), metadata={"k": "v"})
    refs = [(k, TensorRef.from_array(v)) for k, v in tensors.items()]
    safetensors_io.write_safetensors(tmp_path / "ours.safetensors", refs)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    safetensors_io.write_safetensors(tmp_path / "ours.safetensors", refs, {"k": "v"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "meta.safetensors").read_bytes()
    with pytest.raises(MappingError, match="two tensors"):
        safetensors_io.write_safetensors(tmp_path / "x.safetensors", refs + refs[:1])


def test_malformed_state_metadata(tmp_path):
    path = tmp_path / "s.safetensors"
    base = {"format": "statekit.state", "format_version": "1", "framework": "burn"}
    cases = [
        (base | {"params": "[{"}, "not valid JSON"),
        (base | {"params": '[{"key": "0", "slots": {"exp_avg": "state/0/exp_avg"}}]'}, "missing tensor"),
        (base | {"params": '[{"id": "1"}]'}, "malformed statekit state metadata"),
        (base | {"format_version": "9"}, "version '9'"),
    ]
    for meta, match in cases:
        save_file({"t": np.ones(1, np.float32)}, str(path), metadata=meta)
        with pytest.raises(FormatError, match=match):
            io.open_checkpoint(path)


def test_cli_inspect_generic_file(tmp_path, cli):
    with io.open_checkpoint(FIXTURES / "hand-optim.bpk") as ckpt:
        safetensors_io.save_state(ckpt.optimizer, str(tmp_path / "s.safetensors"))
    d = json.loads(cli("inspect", str(tmp_path / "s.safetensors"), "--json").stdout)
    b = json.loads(cli("inspect", "fixtures/hand-optim.bpk", "--json").stdout)
    assert (d["format"], d["version"], d["kind"], d["family"]) == ("safetensors", 1, "optimizer", "adam")
    assert d["params"] == b["params"] and d["tensors"] == 8 and d["bytes"] == b["bytes"]
    r = cli("inspect", "s.safetensors", cwd=tmp_path)  # relative: tmp_path's length cannot wrap the header
    assert r.returncode == 0 and r.stdout.startswith("s.safetensors: safetensors v1 · optimizer (adam/adamw) · ")
