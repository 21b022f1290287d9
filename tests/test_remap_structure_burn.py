"""Structural remaps with burn on either side: burn's Linear is [d_in, d_out], so a fused weight joins
along axis 1 and a torch state crossing to burn is transposed as well as fused — matched by values
across the two layouts, in one command."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_remap_structure import OPTIMIZERS, _names, by_name, convert, trained  # noqa: E402

from statekit import io  # noqa: E402
from statekit.formats.burnpack import PackTensor, write_burnpack  # noqa: E402
from statekit.tensor import TensorRef  # noqa: E402

LINEAR = ("q.weight", "k.weight", "v.weight", "gate.weight", "up.weight", "down.weight", "head.weight",
          "qkv.weight", "gate_up.weight")


def burn_layout(tensors: dict) -> dict:
    """torch tensors as a burn model holds them: Linear weights [d_in, d_out]."""
    return {k: (v.T if k in LINEAR else v).contiguous() for k, v in tensors.items()}


def write_model(path, tensors: dict, seed: int) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    ids = {k: int(rng.integers(1, 2**62)) for k in tensors}
    write_burnpack(path, [PackTensor(k, TensorRef.from_array(v.numpy()), param_id=ids[k]) for k, v in tensors.items()])
    return ids


def burn_state(path) -> dict[str, dict]:
    with io.open_checkpoint(str(path)) as ckpt:
        return {p.path: ({k: v.numpy().copy() for k, v in p.slots.items()}, p.step, p.id)
                for p in ckpt.optimizer.params}


def expected_moments(opt, weights, slot):
    old = by_name(opt.state_dict(), list(weights))
    return burn_layout(convert({p: s[slot] for p, s in old.items()}, lambda n, like: torch.zeros(n, *like.shape[1:])))


def test_torch_state_onto_a_fused_burn_model_in_one_command(tmp_path, cli):
    _, opt, weights, new_weights = trained(tmp_path, OPTIMIZERS["adamw"])
    ids = write_model(tmp_path / "new.bpk", burn_layout(new_weights), 1)
    r = cli("remap", tmp_path / "optim.pt", "--old-model", tmp_path / "old.pt", "--model", tmp_path / "new.bpk",
            "-o", tmp_path / "out.bpk")
    assert r.returncode == 0, r.stderr
    got = burn_state(tmp_path / "out.bpk")
    assert set(got) == set(new_weights)
    for slot in ("exp_avg", "exp_avg_sq"):
        for path, want in expected_moments(opt, weights, slot).items():
            slots, step, pid = got[path]
            assert pid == ids[path] and step == 4
            assert np.array_equal(slots[slot], want.numpy()), (path, slot)
    # q's rows are columns now, still RoPE-interleaved: the map says so
    plan = cli("remap", tmp_path / "optim.pt", "--old-model", tmp_path / "old.pt", "--model", tmp_path / "new.bpk",
               "-o", tmp_path / "x.bpk", "--dry-run")
    assert "qkv.weight" in plan.stdout and "reordered" in plan.stdout


def test_burn_state_onto_a_burn_model_fused_along_axis_one(tmp_path, cli):
    _, opt, weights, new_weights = trained(tmp_path, OPTIMIZERS["adamw"])
    write_model(tmp_path / "old.bpk", burn_layout(weights), 2)
    ids = write_model(tmp_path / "new.bpk", burn_layout(new_weights), 3)
    r = cli("convert", tmp_path / "optim.pt", tmp_path / "old-optim.bpk", "--model", tmp_path / "old.bpk",
            "--names", _names(tmp_path), "--transpose", "q.weight")
    assert r.returncode == 0, r.stderr
    r = cli("remap", tmp_path / "old-optim.bpk", "--old-model", tmp_path / "old.bpk", "--model", tmp_path / "new.bpk",
            "-o", tmp_path / "new-optim.bpk", "--plan-out", tmp_path / "plan.json")
    assert r.returncode == 0, r.stderr
    got = burn_state(tmp_path / "new-optim.bpk")
    for slot in ("exp_avg", "exp_avg_sq"):
        for path, want in expected_moments(opt, weights, slot).items():
            assert got[path][2] == ids[path]
            assert np.array_equal(got[path][0][slot], want.numpy()), (path, slot)
    # the fused weight joins along axis 1: gate then up, side by side
    import json

    plan = json.loads((tmp_path / "plan.json").read_text())
    gate_up = next(a for a in plan["params"] if a["dst_path"] == "gate_up.weight")
    starts = {p["source"]: p["dst_offset"] for p in gate_up["pieces"]}
    assert starts == {"gate.weight": 0, "up.weight": 24}  # column 24 of row 0


def test_the_same_by_rules_along_burns_second_axis(tmp_path, cli):
    """--fuse on a burn state joins along axis 1 without being told."""
    _, opt, weights, new_weights = trained(tmp_path, OPTIMIZERS["adamw"], grow=0, rope=False)
    write_model(tmp_path / "old.bpk", burn_layout(weights), 2)
    assert cli("convert", tmp_path / "optim.pt", tmp_path / "old-optim.bpk", "--model",
               tmp_path / "old.bpk", "--names", _names(tmp_path), "--transpose", "q.weight").returncode == 0
    write_model(tmp_path / "new.bpk", burn_layout(new_weights), 3)
    r = cli("remap", tmp_path / "old-optim.bpk", "--model", tmp_path / "new.bpk", "-o", tmp_path / "out.bpk",
            "--fuse", "qkv.weight=q.weight,k.weight,v.weight", "--fuse", "gate_up.weight=gate.weight,up.weight",
            "--fuse", "gate_up.bias=gate.bias,up.bias", "--stack", "experts_w=experts.*.weight")
    assert r.returncode == 0, r.stderr
    got = burn_state(tmp_path / "out.bpk")
    old = by_name(opt.state_dict(), list(weights))
    for slot in ("exp_avg", "exp_avg_sq"):
        fused = torch.cat([old[n][slot] for n in ("q.weight", "k.weight", "v.weight")]).T
        assert np.array_equal(got["qkv.weight"][0][slot], fused.numpy())
        stacked = torch.stack([old[f"experts.{e}.weight"][slot] for e in range(3)])
        assert np.array_equal(got["experts_w"][0][slot], stacked.numpy())


def test_every_layout_onto_the_burn_model_comes_from_the_map(tmp_path, cli):
    """Issue 38, item 2, as the user runs it: torch state onto a burn model with a grown embedding in one
    command. No rank-2 parameter's layout is guessed from shapes: each one the map proves is laid out as
    the map says (the embedding untransposed and grown, every Linear weight transposed or assembled)."""
    import json

    _, _, _, new_weights = trained(tmp_path, OPTIMIZERS["adamw"])
    write_model(tmp_path / "new.bpk", burn_layout(new_weights), 1)
    r = cli("remap", tmp_path / "optim.pt", "--old-model", tmp_path / "old.pt", "--model", tmp_path / "new.bpk",
            "-o", tmp_path / "out.bpk", "--plan-out", tmp_path / "plan.json")
    assert r.returncode == 0, r.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    rank2 = [a for a in plan["params"] if a["dst_shape"] and len(a["dst_shape"]) == 2]
    assert {a["dst_path"] for a in rank2} == {k for k, v in new_weights.items() if v.dim() == 2}
    for a in rank2:
        assert a["structure"] and any("(inferred from the weights, proved)" in n for n in a["notes"]), a
        assert not any(n.startswith(("layout:", "transposed: the target")) for n in a["notes"]), a
    embed = next(a for a in rank2 if a["dst_path"] == "embed.weight")
    assert (embed["structure"], embed["transpose"], embed["resize"]) == ("grown", False, True)
    assert embed["src_shape"] == [12, 16] and embed["dst_shape"] == [14, 16]


def test_a_move_by_path_onto_a_burn_model_says_why_the_weights_did_not_map_it(tmp_path, cli):
    """Weights that share no values leave the layouts to shapes; the grown embedding's cannot be told,
    and the refusal says why the weights did not answer it (main: the layout refusal alone)."""
    _, _, _, new_weights = trained(tmp_path, OPTIMIZERS["adamw"])
    torch.manual_seed(5)  # the new model saved before its weights were loaded
    write_model(tmp_path / "new.bpk", burn_layout({k: torch.randn_like(v) for k, v in new_weights.items()}), 1)
    r = cli("remap", tmp_path / "optim.pt", "--old-model", tmp_path / "old.pt", "--model", tmp_path / "new.bpk",
            "-o", tmp_path / "out.bpk", "--resize")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and not (tmp_path / "out.bpk").exists(), r.stderr
    assert "cannot tell which rank-2 parameters are Linear weights" in r.stderr and "embed.weight [12, 16]" in r.stderr
    assert "share no values: the state is moved by path" in r.stderr
