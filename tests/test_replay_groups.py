"""replay and verify-resume step each parameter with its own param group's hyperparameters (a
no-decay group, a head at another learning rate), as torch does: once every parameter took group
0's. References are real torch 2.13 in this run."""

from __future__ import annotations

import copy
import json

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

SHAPES = {"w": (12, 5), "b": (5,), "head": (5, 3)}


def _grads(seed: int, n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(n)]


def _run(start: dict[str, np.ndarray], grads: list[dict], state=None):
    """Real torch AdamW, three groups: decayed weights, the bias without decay, the head at 10× the lr."""
    ps = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in start.items()}
    opt = torch.optim.AdamW([{"params": [("w", ps["w"])]},
                             {"params": [("b", ps["b"])], "weight_decay": 0.0},
                             {"params": [("head", ps["head"])], "lr": 1e-1, "betas": (0.8, 0.99)}],
                            lr=1e-2, weight_decay=0.1, foreach=False)
    if state is not None:
        opt.load_state_dict(copy.deepcopy(state))
    for g in grads:
        for k, p in ps.items():
            p.grad = torch.from_numpy(g[k])
        opt.step()
    return {k: p.detach().numpy().copy() for k, p in ps.items()}, opt.state_dict()


def _files(tmp_path):
    rng = np.random.default_rng(0)
    p0 = {k: rng.normal(0, 0.5, s).astype(np.float32) for k, s in SHAPES.items()}
    p3, state = _run(p0, _grads(1, 3))
    torch.save(state, tmp_path / "state.pt")
    save_file(p3, str(tmp_path / "p3.safetensors"))
    later = _grads(2, 4)
    files = []
    for i, g in enumerate(later):
        save_file(g, str(tmp_path / f"g{i}.safetensors"))
        files.append(tmp_path / f"g{i}.safetensors")
    return p3, state, later, files


def _bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_replay_steps_each_parameter_with_its_groups_hyperparameters(cli, tmp_path):
    p3, state, later, files = _files(tmp_path)
    want, _ = _run(p3, later, state)
    r = cli("replay", "--state", tmp_path / "state.pt", "--params", tmp_path / "p3.safetensors", "--grads", *files,
            "--out-params", tmp_path / "out.safetensors", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert [(h["lr"], h["weight_decay"], h["beta1"]) for h in d["group_hyperparams"]] == \
        [(1e-2, 0.1, 0.9), (1e-2, 0.0, 0.9), (1e-1, 0.1, 0.8)]
    got = load_file(str(tmp_path / "out.safetensors"))
    for k in SHAPES:  # bit for bit, the bias and the head included
        assert np.array_equal(_bits(got[k]), _bits(want[k])), k


def test_verify_resume_catches_a_group_whose_hyperparameters_changed(cli, tmp_path):
    _, state, _, _ = _files(tmp_path)
    r = cli("verify-resume", tmp_path / "state.pt", tmp_path / "state.pt", "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["tracks"] and all(p["bit_exact"] for p in d["params"])
    assert [h["lr"] for h in d["group_hyperparams"]["original"]] == [1e-2, 1e-2, 1e-1]
    wrong = copy.deepcopy(state)
    wrong["param_groups"][2]["lr"] = 1e-2  # the head's learning rate lost in a migration
    torch.save(wrong, tmp_path / "wrong.pt")
    r = cli("verify-resume", tmp_path / "state.pt", tmp_path / "wrong.pt", "--json")
    d = json.loads(r.stdout)
    rows = {p["path"]: p for p in d["params"]}
    assert r.returncode == 1 and not d["tracks"]
    assert rows["w"]["bit_exact"] and rows["b"]["bit_exact"] and not rows["head"]["tracks"]
