"""Which bitsandbytes one-state optimizer wrote a state: bitsandbytes stores no name, only a param
group each optimizer packs its own way (bitsandbytes 0.50's ``optim/{sgd,rmsprop,lion,adagrad}.py``
into ``Optimizer1State``, which checks every beta in [0, 1)):

* ``SGD8bit``: ``betas=(momentum, dampening)``, ``eps=0.0``; momentum 0 is refused;
* ``RMSprop8bit``: ``betas=(alpha, momentum)``, the user's ``eps``; alpha 0 is refused;
* ``Lion8bit``: its ``betas``, ``eps=0.0``;
* ``Adagrad8bit``: ``betas=(0.0, 0.0)``, the user's ``eps``.

Where several fit, the family is left open (``unknown (…; one of …: say which with --optimizer)``)
and state1 keeps bitsandbytes' own name until ``--optimizer`` settles it. The expected candidate
sets below are worked out by hand from those rules; the files are bitsandbytes 0.50.2's own
(``scripts/make_bnb_fixtures.py``), and every expected value is bitsandbytes' or real torch's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from statekit import io
from statekit.errors import UsageError
from statekit.frameworks import bnb
from statekit.ops import replay as rp

BNB = Path(__file__).resolve().parent.parent / "fixtures" / "bnb"
NAMES = ["--names", str(BNB / "names.txt")]
SHAPES = [(128, 64), (128,), (70, 60), (260, 16)]
THREE = ("lion", "rmsprop", "sgd")
# file → (the optimizer that wrote it, the families its param group fits)
WRITTEN = {
    "sgd8bit.pt": ("sgd", THREE),  # (0.9, 0), eps 0: also Lion8bit(betas=(0.9, 0)), RMSprop8bit(alpha=0.9, eps=0)
    "sgd8bit-dampening.pt": ("sgd", THREE),  # (0.9, 0.5), eps 0: read as lion before
    "lion8bit.pt": ("lion", THREE),  # (0.9, 0.99), eps 0: also SGD8bit(momentum=0.9, dampening=0.99)
    "lion8bit-beta2-0.pt": ("lion", THREE),  # (0.9, 0.0), eps 0: read as sgd before
    "rmsprop8bit-eps0.pt": ("rmsprop", THREE),  # (0.99, 0), eps 0: read as sgd before
    "adagrad8bit-eps0.pt": ("adagrad", ("adagrad", "lion")),  # (0, 0), eps 0: also Lion8bit(betas=(0, 0))
    "rmsprop8bit.pt": ("rmsprop", ("rmsprop",)),  # eps 1e-8: only RMSprop keeps an eps and alpha > 0
    "adagrad8bit.pt": ("adagrad", ("adagrad",)),  # (0, 0), eps 1e-10
}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.mark.parametrize(("betas", "eps", "fits"), [
    ((0.9, 0), 0.0, THREE),
    ((0.9, 0.5), 0.0, THREE),
    ((0.9, 0.99), 0.0, THREE),
    ((0.99, 0), 1e-8, ("rmsprop",)),
    ((0.99, 0.9), 1e-8, ("rmsprop",)),  # RMSprop's momentum in betas[1]
    ((0.0, 0.0), 1e-10, ("adagrad",)),
    ((0.0, 0.0), 0.0, ("adagrad", "lion")),
    ((0.0, 0.99), 0.0, ("lion",)),  # beta1 0: SGD's momentum and RMSprop's alpha cannot be 0
    ((0.0, 0.99), 1e-8, ()),  # an eps, but no alpha: nothing bitsandbytes writes
])
def test_the_candidates_are_every_optimizer_that_packs_its_group_so(betas, eps, fits):
    assert bnb.group_candidates(betas, eps) == fits


def test_every_group_of_the_state_must_fit_the_family():
    """One optimizer writes every group: an RMSprop8bit whose groups have eps 0 and 1e-8 is RMSprop."""
    one = {"lr": 0.01, "betas": (0.99, 0), "eps": 0.0, "weight_decay": 0, "params": [0]}
    assert bnb._family([], [one])[:2] == (None, THREE)
    assert bnb._family([], [one, dict(one, eps=1e-8, params=[1])])[:2] == ("rmsprop", ())
    family, fits, why = bnb._family([], [dict(one, betas=(0.0, 0.99), eps=1e-8)])
    assert (family, fits) == (None, ()) and "no optimizer" in why


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_each_file_reads_as_the_families_its_group_admits(cli, name):
    """The optimizer that wrote it is always among them; a family is named only where it is the one."""
    wrote, fits = WRITTEN[name]
    d = json.loads(cli("inspect", f"fixtures/bnb/{name}", "--json").stdout)
    assert wrote in fits and d["library"] == "bitsandbytes"
    if len(fits) == 1:
        assert d["family"] == wrote and d["family_candidates"] in ([], [wrote])
        return
    assert d["family"].startswith("unknown (") and d["family"].endswith("say which with --optimizer)")
    assert f"one of {', '.join(fits)}" in d["family"] and d["family_candidates"] == list(fits)
    for p in d["params"]:  # no family's name on state1 while the family is open
        f = p["fields"]["state1"]
        assert f["slot"] == "state1" and all(c in f["meaning"] for c in fits), f
        assert p["family_candidates"] == list(fits)
    table = cli("inspect", f"fixtures/bnb/{name}").stdout
    assert "state1 (8-bit/256)" in table and "(unknown family)" in table
    assert not any(s in table for s in ("=exp_avg", "=momentum_buffer", "=square_avg", "=sum"))


@pytest.mark.parametrize("name", ["sgd8bit-dampening.pt", "rmsprop8bit-eps0.pt", "adagrad8bit-eps0.pt"])
def test_convert_replay_and_verify_resume_refuse_until_optimizer_settles_it(cli, tmp_path, name):
    fits = WRITTEN[name][1]
    src = f"fixtures/bnb/{name}"
    for args in (("convert", src, str(tmp_path / "x.pt"), *NAMES),
                 ("convert", src, str(tmp_path / "x.bpk"), *NAMES),
                 ("convert", src, str(tmp_path / "x.bnb.pt"), "--to", "bnb"),
                 ("verify-resume", src, src, *NAMES),
                 ("replay", "--state", src, "--params", src, "--grads", src, "--out-params",
                  str(tmp_path / "p.safetensors"))):
        r = cli(*args)
        assert r.returncode != 0 and "Traceback" not in r.stderr, args
        assert "--optimizer" in r.stderr and f"one of {', '.join(fits)}" in r.stderr, r.stderr
    r = cli("convert", src, str(tmp_path / "x.pt"), *NAMES, "--optimizer", "adamw")
    assert r.returncode != 0 and f"say --optimizer {' or '.join(fits)}" in r.stderr
    r = cli("verify-resume", src, src, *NAMES, "--optimizer", "adamw")
    assert r.returncode != 0 and "not adamw" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())


def _dequantized(name: str, idx: int) -> np.ndarray:
    """bitsandbytes' own dequantized state1 of parameter ``idx`` (its float32 state where it kept one)."""
    refs = np.load(BNB / f"{name}.ref.npz")
    key = next((k for k in refs.files if k.startswith(f"{idx}.") and k.split(".")[1] in
                ("momentum_buffer", "momentum", "square_avg", "sum")), None)
    if key is not None:
        return refs[key]
    sd = torch.load(BNB / f"{name}.pt", weights_only=True)
    return sd["state"][idx]["__bnb_optimizer_quant_state__"]["state1"].numpy()


@pytest.mark.parametrize(("name", "family", "cls", "slot", "kw"), [
    ("sgd8bit-dampening", "sgd", torch.optim.SGD, "momentum_buffer", {"momentum": 0.5}),
    ("rmsprop8bit-eps0", "rmsprop", torch.optim.RMSprop, "square_avg", {}),
    ("rmsprop8bit-eps0", "sgd", torch.optim.SGD, "momentum_buffer", {"momentum": 0.5}),  # what the user says
    ("adagrad8bit-eps0", "adagrad", torch.optim.Adagrad, "sum", {}),
])
def test_optimizer_settles_the_family_and_names_state1_as_that_family_does(cli, tmp_path, name, family, cls, slot,
                                                                           kw):
    """state1's values (bitsandbytes' dequantize) under the settled family's name, in a file real torch loads."""
    out = tmp_path / "torch.pt"
    r = cli("convert", f"fixtures/bnb/{name}.pt", str(out), *NAMES, "--optimizer", family)
    assert r.returncode == 0, r.stderr
    sd = torch.load(out, weights_only=True)
    for idx in range(4):
        assert set(sd["state"][idx]) - {"step"} == {slot}
        assert np.array_equal(bits(sd["state"][idx][slot].numpy()), bits(_dequantized(name, idx)))
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    cls(params, lr=0.1, **kw).load_state_dict(sd)  # real torch takes it as its own
    d = json.loads(cli("inspect", str(out), "--json").stdout)
    assert d["family"] == family


def test_settled_lion_goes_to_burn_lion_exactly(cli, tmp_path):
    bpk = tmp_path / "lion.bpk"
    r = cli("convert", "fixtures/bnb/lion8bit-beta2-0.pt", str(bpk), *NAMES, "--optimizer", "lion",
            "--transpose", "w*", "--no-transpose", "emb")
    assert r.returncode == 0, r.stderr
    names = (BNB / "names.txt").read_text().split()
    with io.open_checkpoint(str(bpk)) as ckpt:
        assert ckpt.optimizer.family == "lion"
        by_path = {p.path: p for p in ckpt.optimizer.params}
        for idx, name in enumerate(names):
            want = _dequantized("lion8bit-beta2-0", idx)
            got = by_path[name].slots["exp_avg"].numpy()
            assert np.array_equal(bits(got), bits(want.T if name in ("w1", "w2") else want)), name


def test_sgd8bit_with_dampening_continues_in_torch_as_bitsandbytes_stepped(cli, tmp_path):
    """bitsandbytes' SGD kernels step s = momentum·s + g whatever the dampening: real torch SGD from the
    settled file, with dampening 0, takes bitsandbytes' own next step bit for bit; honouring the
    stored dampening 0.5 would not."""
    out = tmp_path / "sgd.pt"
    r = cli("convert", "fixtures/bnb/sgd8bit-dampening.pt", str(out), *NAMES, "--optimizer", "sgd")
    assert r.returncode == 0 and "kernels ignore it" in " ".join(r.stderr.split()), r.stderr
    sd = torch.load(out, weights_only=True)
    assert sd["param_groups"][0]["dampening"] == 0.0 and sd["param_groups"][0]["momentum"] == 0.9
    refs = np.load(BNB / "sgd8bit-dampening.ref.npz")
    for damp in (0.0, 0.5):
        for idx in (1, 2):  # b1 (32-bit state) and w2 (8-bit)
            p = torch.nn.Parameter(torch.from_numpy(refs[f"{idx}.param"]).clone())
            opt = torch.optim.SGD([p], lr=0.01, momentum=0.9, dampening=damp)
            opt.state[p]["momentum_buffer"] = sd["state"][idx]["momentum_buffer"].clone()
            p.grad = torch.from_numpy(refs[f"{idx}.grad"])
            opt.step()
            same = np.array_equal(bits(p.detach().numpy()), bits(refs[f"{idx}.param_next"]))
            assert same == (damp == 0.0), (damp, idx)


def test_replay_settles_the_family_and_takes_bitsandbytes_next_step():
    """replay with --optimizer sgd: state1 becomes the momentum buffer, and statekit's torch SGD lands
    where bitsandbytes' SGD8bit did, bit for bit; without --optimizer it is refused."""
    refs = np.load(BNB / "sgd8bit-dampening.ref.npz")
    names = (BNB / "names.txt").read_text().split()
    from statekit.tensor import TensorRef

    with io.open_checkpoint(str(BNB / "sgd8bit-dampening.pt")) as ckpt:
        st = ckpt.optimizer
        with pytest.raises(UsageError, match="one of lion, rmsprop, sgd"):
            rp.pick_algorithm(st, given=None)
        with pytest.raises(UsageError, match="not adam"):
            rp.pick_algorithm(st, given="adam")
        assert rp.pick_algorithm(st, given="sgd") == "sgd"
        assert st.family == "sgd" and all(set(p.slots) == {"momentum_buffer"} for p in st.params)
        for p, name in zip(st.params, names, strict=True):
            p.path = name
        keep = [1, 2]
        st.params = [st.params[i] for i in keep]
        hp = rp.registry_hp("sgd", "torch", rp.state_hp(st), {})
        assert (hp["momentum"], hp["dampening"]) == (0.9, 0.0)
        params = {names[i]: TensorRef.from_array(refs[f"{i}.param"]) for i in keep}
        grads = [{names[i]: TensorRef.from_array(refs[f"{i}.grad"]) for i in keep}]
        lane = rp.replay(st, params, grads, algorithm="sgd", flavor="torch", hp=hp)
    for i in keep:
        assert np.array_equal(bits(lane.params[names[i]]), bits(refs[f"{i}.param_next"])), names[i]


def test_a_saved_plan_settles_the_family_too(cli, tmp_path):
    plan = tmp_path / "plan.json"
    first = tmp_path / "a.pt"
    assert cli("convert", "fixtures/bnb/sgd8bit.pt", str(first), *NAMES, "--optimizer", "sgd",
               "--plan-out", str(plan)).returncode == 0
    again = tmp_path / "b.pt"
    r = cli("convert", "fixtures/bnb/sgd8bit.pt", str(again), "--plan", str(plan))
    assert r.returncode == 0, r.stderr
    a, b = torch.load(first, weights_only=True), torch.load(again, weights_only=True)
    for idx in range(4):
        assert np.array_equal(bits(a["state"][idx]["momentum_buffer"].numpy()),
                              bits(b["state"][idx]["momentum_buffer"].numpy()))
        assert np.array_equal(bits(b["state"][idx]["momentum_buffer"].numpy()), bits(_dequantized("sgd8bit", idx)))


def test_verify_resume_of_a_settled_conversion_is_bit_exact(cli, tmp_path):
    out = tmp_path / "sgd.pt"
    assert cli("convert", "fixtures/bnb/sgd8bit-dampening.pt", str(out), *NAMES, "--optimizer", "sgd").returncode == 0
    r = cli("verify-resume", "fixtures/bnb/sgd8bit-dampening.pt", str(out), *NAMES)
    assert r.returncode != 0 and "one of lion, rmsprop, sgd" in r.stderr  # the torch side does not settle it
    r = cli("verify-resume", "fixtures/bnb/sgd8bit-dampening.pt", str(out), *NAMES, "--optimizer", "sgd", "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["tracks"] and all(p["bit_exact"] and p["has_state"] for p in d["params"])
    assert d["hyperparams"]["original"]["dampening"] == 0.0 and d["hyperparams"]["original"]["momentum"] == 0.9


@pytest.mark.parametrize("name", ["sgd8bit.pt", "adamw8bit.pt"])
def test_merge_refuses_bitsandbytes_states(cli, tmp_path, name):
    """merge writes torch's layout: from bitsandbytes inputs that was a file of no known family (float32
    moments under bitsandbytes' group), or, with the family open, one named by a guess."""
    out = tmp_path / "m.pt"
    r = cli("merge", f"fixtures/bnb/{name}", f"fixtures/bnb/{name}", "-o", str(out), "--on-conflict", "first")
    assert r.returncode != 0 and "bitsandbytes state" in r.stderr and "--to bnb" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
