"""verify-resume on what users have: remapped states (--plan, or the sources a written file records),
resized parameters, transposes recorded at conversion, torch positions named by --names/--model, and
the hyperparameter flags. States are made by real torch 2.13 training steps."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

V, D = 10, 8


class Net(torch.nn.Module):
    def __init__(self, vocab: int = V, embed: str = "embed"):
        super().__init__()
        self.embed_name = embed
        setattr(self, embed, torch.nn.Embedding(vocab, D))
        self.norm = torch.nn.LayerNorm(D)
        self.head = torch.nn.Linear(D, D)  # square: its transpose cannot be seen from the shape

    def forward(self, ids):
        return self.head(self.norm(getattr(self, self.embed_name)(ids)))


@pytest.fixture
def trained(tmp_path):
    """A torch checkpoint (model + Adam state after 3 steps) and the grown, renamed new model."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(3):
        net(torch.randint(0, V, (4,))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")  # positions only, no names
    torch.save(Net(V + 4, "tok_embed").state_dict(), tmp_path / "new_model.pt")
    (tmp_path / "names.txt").write_text("\n".join(n for n, _ in net.named_parameters()) + "\n")
    return tmp_path


def remapped(cli, d, out: str):
    res = cli("remap", d / "ckpt.pt", "--model", d / "new_model.pt", "-o", d / out, "--rename", r"^embed\.=tok_embed.",
              "--resize", "--plan-out", d / "plan.json")
    assert res.returncode == 0, res.stderr
    return d / out


def verify(cli, *args):
    res = cli("verify-resume", *map(str, args), "--json")
    assert res.returncode in (0, 1), res.stderr
    return res.returncode, json.loads(res.stdout)


def swap_moments(src, dst, a: int, b: int, field: str = "exp_avg"):
    sd = torch.load(src, weights_only=True)
    sd["state"][a][field], sd["state"][b][field] = sd["state"][b][field].clone(), sd["state"][a][field].clone()
    torch.save(sd, dst)


def test_a_remapped_state_tracks_through_its_plan_and_swapped_moments_do_not(cli, trained):
    new = remapped(cli, trained, "new.pt")
    code, report = verify(cli, trained / "ckpt.pt", new, "--plan", trained / "plan.json")
    assert code == 0 and report["tracks"]
    rows = {r["path"]: r for r in report["params"]}
    grown = rows["embed.weight"]
    assert grown["migrated_path"] == "tok_embed.weight" and grown["kept"] == [V, D] and grown["new_elements_fresh"]
    assert all(r["bit_exact"] for r in rows.values())
    # norm.weight and norm.bias have the same shape: swapping their moments must be caught
    swap_moments(new, trained / "swapped.pt", 1, 2)
    code, report = verify(cli, trained / "ckpt.pt", trained / "swapped.pt", "--plan", trained / "plan.json")
    assert code == 1 and not report["tracks"]
    assert {r["path"] for r in report["params"] if not r["tracks"]} == {"norm.weight", "norm.bias"}


def test_new_rows_that_are_not_a_zero_state_are_caught(cli, trained):
    new = remapped(cli, trained, "new.pt")
    sd = torch.load(new, weights_only=True)
    sd["state"][0]["exp_avg"][V:] = 0.5  # stale values in the grown rows; the kept rows are untouched
    torch.save(sd, trained / "stale.pt")
    code, report = verify(cli, trained / "ckpt.pt", trained / "stale.pt", "--plan", trained / "plan.json")
    row = next(r for r in report["params"] if r["path"] == "embed.weight")
    assert code == 1 and row["bit_exact"] and not row["new_elements_fresh"]


def test_a_written_file_records_its_sources_so_no_plan_is_needed(cli, trained):
    new = remapped(cli, trained, "new.safetensors")
    code, report = verify(cli, trained / "ckpt.pt", new)
    assert code == 0
    assert {r.get("migrated_path", r["path"]) for r in report["params"]} == {
        "tok_embed.weight", "norm.weight", "norm.bias", "head.weight", "head.bias"}


def test_without_plan_or_record_a_renamed_parameter_is_missing(cli, trained):
    new = remapped(cli, trained, "new.pt")  # torch files keep no record
    code, report = verify(cli, trained / "ckpt.pt", new)
    assert code == 1
    row = next(r for r in report["params"] if r["path"] == "embed.weight")
    assert not row["has_state"] and any("--plan" in n for n in report["notes"])


def test_transposes_are_recorded_in_the_converted_file(cli, trained):
    out = trained / "optim.bpk"
    res = cli("convert", trained / "ckpt.pt", out, "--transpose", "head.weight", "--no-transpose", "embed.weight")
    assert res.returncode == 0, res.stderr
    code, report = verify(cli, trained / "ckpt.pt", out)  # head.weight is square: only the record tells
    assert code == 0
    assert next(r for r in report["params"] if r["path"] == "head.weight")["transposed"]
    assert not any("square weights" in n for n in report["notes"])


def test_torch_positions_named_by_names_or_model(cli, trained):
    out = trained / "optim.bpk"
    assert cli("convert", trained / "ckpt.pt", out, "--transpose", "head.weight", "--no-transpose",
               "embed.weight").returncode == 0
    # opt.pt has positions only; the record pairs them, and --names / --model name them as well
    for extra in ([], ["--names", trained / "names.txt"], ["--model", trained / "ckpt.pt"]):
        code, report = verify(cli, trained / "opt.pt", out, *extra)
        assert code == 0, (extra, report)
        assert [r["path"] for r in report["params"]] == ["embed.weight", "norm.weight", "norm.bias", "head.weight",
                                                         "head.bias"]
    swap_moments(trained / "opt.pt", trained / "swapped.pt", 1, 2)
    code, report = verify(cli, trained / "swapped.pt", out, "--names", trained / "names.txt")
    assert code == 1


def test_two_torch_states_pair_by_position_when_groups_and_shapes_agree(cli, trained):
    """verify-resume a.pt roundtrip.pt: neither names its positions, neither records moves (the round trip
    through burn writes torch positions only, as a.pt has), and torch pairs state by position too."""
    bpk, back = trained / "optim.bpk", trained / "roundtrip.pt"
    assert cli("convert", trained / "opt.pt", bpk, "--names", trained / "names.txt", "--transpose", "head.weight",
               "--no-transpose", "embed.weight").returncode == 0
    assert cli("convert", bpk, back).returncode == 0
    sd = torch.load(back, weights_only=True)
    assert "param_names" not in sd["param_groups"][0]  # opt.pt had none
    code, report = verify(cli, trained / "opt.pt", back)
    assert code == 0 and report["tracks"]
    assert any("paired by position" in n for n in report["notes"])
    swap_moments(back, trained / "swapped.pt", 1, 2)  # norm.weight and norm.bias: the same shape
    code, report = verify(cli, trained / "opt.pt", trained / "swapped.pt")
    assert code == 1 and not report["tracks"]


def test_unnamed_positions_that_disagree_by_position_are_refused_in_one_line(cli, trained):
    torch.manual_seed(1)
    other = Net(V + 4)
    opt = torch.optim.Adam(other.parameters(), lr=1e-2)
    other(torch.randint(0, V, (4,))).pow(2).mean().backward()
    opt.step()
    torch.save(opt.state_dict(), trained / "other.pt")
    res = cli("verify-resume", trained / "opt.pt", trained / "other.pt")
    assert res.returncode == 1 and res.stderr.count("\n") == 1
    assert "--names" in res.stderr and "--model" in res.stderr and "position 0 (#0)" in res.stderr


def test_hyperparameter_flags_reach_both_sides(cli, trained):
    code, report = verify(cli, trained / "ckpt.pt", trained / "ckpt.pt", "--eps", "1e-6", "--betas", "0.8,0.99")
    assert code == 0
    for side in ("original", "migrated"):
        hp = report["hyperparams"][side]
        assert hp["eps"] == 1e-6 and (hp["beta1"], hp["beta2"]) == (0.8, 0.99)


def test_the_record_is_the_only_thing_it_adds(cli, trained, monkeypatch):
    """The statekit.moves entry aside, a converted file is what it was without the record."""
    import numpy as np

    import statekit
    from statekit.ops import convert as convert_op
    from statekit.ops.pairing import MOVES_KEY, MOVES_SOURCE_KEY

    args = ("--transpose", "head.weight", "--no-transpose", "embed.weight")
    assert cli("convert", trained / "ckpt.pt", trained / "with.bpk", *args).returncode == 0
    monkeypatch.setattr(convert_op, "moves_metadata", lambda plan: {})
    assert cli("convert", trained / "ckpt.pt", trained / "without.bpk", *args).returncode == 0
    with statekit.open(trained / "with.bpk") as a, statekit.open(trained / "without.bpk") as b:
        assert MOVES_KEY in a.metadata and MOVES_KEY not in b.metadata
        assert a.metadata[MOVES_SOURCE_KEY] == "torch"
        assert {k: v for k, v in a.metadata.items() if k not in (MOVES_KEY, MOVES_SOURCE_KEY)} == b.metadata
        for p, q in zip(a.optimizer.params, b.optimizer.params, strict=True):
            assert (p.path, p.id, p.step, list(p.slots)) == (q.path, q.id, q.step, list(q.slots))
            for name in p.slots:
                assert np.array_equal(p.slots[name].numpy(), q.slots[name].numpy())


def test_a_state_restarted_by_reset_step_is_checked_against_a_cold_start(cli, trained):
    d = trained
    res = cli("remap", d / "ckpt.pt", "--model", d / "new_model.pt", "-o", d / "reset.pt", "--rename",
              r"^embed\.=tok_embed.", "--resize", "--reset-step", "tok_embed.*", "--plan-out", d / "reset-plan.json")
    assert res.returncode == 0, res.stderr
    code, report = verify(cli, d / "ckpt.pt", d / "reset.pt", "--plan", d / "reset-plan.json")
    row = next(r for r in report["params"] if r["path"] == "embed.weight")
    assert code == 0 and row["reset"] and row["bit_exact"] and not row["has_state"]


ASGD = {"lr": 1e-2, "lambd": 1e-2, "alpha": 0.75, "t0": 1.0}  # eta and mu both move from their start (lr, 1)


def _asgd_resized(d, stale: float | None = None):
    """Real torch ASGD after 3 steps (its ckpt), and the same state for the grown model as a resize
    makes it: the embedding's ``ax`` zero-padded (``stale``: the new rows filled with that instead),
    the tensor's own ``eta``, ``mu`` and ``step`` as they are."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.ASGD(net.named_parameters(), **ASGD)
    for _ in range(3):
        net(torch.randint(0, V, (4,))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, d / "asgd.pt")
    sd = opt.state_dict()
    ax = sd["state"][0]["ax"]
    sd["state"][0]["ax"] = torch.cat([ax, torch.full((4, D), 0.0 if stale is None else stale)])
    sd["param_groups"][0]["param_names"][0] = "tok_embed.weight"
    out = d / ("asgd-grown.pt" if stale is None else "asgd-stale.pt")
    torch.save(sd, out)
    return sd, out


def test_a_resized_asgd_state_tracks_its_new_rows_share_the_tensors_eta_and_mu(cli, trained):
    """ASGD's eta and mu are one 0-dim tensor per parameter: a grown embedding's new rows step with the
    tensor's eta and mu, in real torch as in verify-resume's zero-state lane (which once zeroed them,
    so that a correctly grown state read as not tracking). Restarted at torch's initial eta = lr and
    mu = 1, the new rows would land elsewhere: that is not what torch does with this file."""
    remapped(cli, trained, "new.pt")  # the plan: embed.weight → tok_embed.weight, grown by 4 rows
    sd, grown = _asgd_resized(trained)
    eta, mu = float(sd["state"][0]["eta"]), float(sd["state"][0]["mu"])
    assert eta != float(torch.tensor(ASGD["lr"])) and mu != 1.0  # both off their start: the case that matters
    code, report = verify(cli, trained / "asgd.pt", grown, "--plan", trained / "plan.json")
    row = next(r for r in report["params"] if r["path"] == "embed.weight")
    assert report["optimizer"] == "asgd" and row["kept"] == [V, D]
    assert code == 0 and report["tracks"] and row["bit_exact"] and row["new_elements_fresh"], row

    # real torch: the grown tensor's new rows step as a zero ax with the tensor's eta and mu does
    def run(eta_mu, ax_rows):
        p = torch.nn.Parameter(torch.full((V + 4, D), 0.25))
        opt = torch.optim.ASGD([p], **ASGD)
        state = {"step": sd["state"][0]["step"].clone(), "ax": ax_rows.clone(),
                 "eta": torch.tensor(eta_mu[0]), "mu": torch.tensor(eta_mu[1])}
        opt.load_state_dict({"state": {0: state}, "param_groups": [dict(opt.state_dict()["param_groups"][0])]})
        for k in range(4):
            p.grad = torch.linspace(-0.1, 0.1 + k, (V + 4) * D).reshape(V + 4, D)
            opt.step()
        return p.detach()[V:].clone()

    resumed = run((eta, mu), sd["state"][0]["ax"])
    zero_state = run((eta, mu), torch.zeros(V + 4, D))
    restarted = run((float(torch.tensor(ASGD["lr"])), 1.0), torch.zeros(V + 4, D))
    assert torch.equal(resumed, zero_state) and not torch.equal(resumed, restarted)


def test_stale_new_rows_of_a_resized_asgd_state_are_caught(cli, trained):
    """ASGD's average ax moves no parameter: stale new rows of it are caught in the state itself."""
    remapped(cli, trained, "new.pt")
    _, stale = _asgd_resized(trained, stale=0.5)
    code, report = verify(cli, trained / "asgd.pt", stale, "--plan", trained / "plan.json")
    row = next(r for r in report["params"] if r["path"] == "embed.weight")
    assert code == 1 and row["bit_exact"] and not row["new_elements_fresh"]
