"""verify-resume never lets a NaN pass as close: ``max(0.0, nan)`` is 0.0 in Python, so a migrated run
whose parameter went NaN once read as tracking, with max |Δp| 0, under a tolerance criterion."""

from __future__ import annotations

import json

import numpy as np
import torch

from statekit.ops.replay import _compare


def test_a_nan_on_one_side_is_infinitely_far_and_the_same_nan_is_not():
    one = np.array([1.0, 2.0, np.nan], np.float32)
    assert _compare(one, one.copy(), 1e-2, 10) == (0.0, 0.0, True, None)  # the same bits: the same run
    other = np.array([1.0, np.nan, np.nan], np.float32)
    max_diff, ratio, identical, first = _compare(one, other, 1e-2, 10)
    assert (max_diff, ratio, identical) == (np.inf, np.inf, False)
    assert first[0] == [1] and first[1] == 2.0  # the first element whose bits differ: 2.0 against a NaN
    finite = np.array([1.0, 2.0, 3.0], np.float32)  # the original NaN, the migrated not
    assert _compare(one, finite, 1e-2, 10)[1] == np.inf


def test_a_migrated_state_that_steps_to_nan_does_not_track(cli, tmp_path):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4))
    opt = torch.optim.Adam([("w", w)], lr=1e-2)
    for _ in range(3):
        w.grad = torch.randn(6, 4)
        opt.step()
    sd = opt.state_dict()
    torch.save(sd, tmp_path / "adam.pt")
    sd["state"][0]["exp_avg_sq"][0, 0] = -1.0  # a broken migration: torch's next step makes w[0, 0] NaN
    torch.save(sd, tmp_path / "bad.pt")
    opt.load_state_dict(sd)
    w.grad = torch.randn(6, 4)
    opt.step()
    assert torch.isnan(w[0, 0]) and not torch.isnan(w[0, 1:]).any()
    for extra in ([], ["--flavor-migrated", "torch-fused"]):  # bit-exact (lossy start) and tolerance criteria
        r = cli("verify-resume", tmp_path / "adam.pt", tmp_path / "bad.pt", "--json", *extra)
        d = json.loads(r.stdout)
        assert r.returncode == 1 and not d["tracks"], extra
        assert d["params"][0]["max_abs_diff"] == "inf" and d["params"][0]["tolerance_ratio"] == "inf"
