"""bitsandbytes optimizer states, as bitsandbytes 0.50.2 wrote them (``fixtures/bnb/``, written by
``scripts/make_bnb_fixtures.py``; bitsandbytes' own dequantized moments and quantizer outputs are in
the ``*.ref.npz`` beside them). bitsandbytes is not needed here: every expected value below is
bitsandbytes' own output, or real torch's in the test run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from statekit import io
from statekit.formats import torch_pt
from statekit.optim import blockwise

BNB = Path(__file__).resolve().parent.parent / "fixtures" / "bnb"
UNREAD = ("lamb8bit.pt", "lars8bit.pt")  # LAMB/LARS keep an update norm statekit does not model
STATES = sorted(p.name for p in BNB.glob("*.pt") if p.name != "torch-adamw.pt" and p.name not in UNREAD)
NAMES = ["--names", str(BNB / "names.txt")]
FAMILY = {"adamw8bit.pt": "adamw", "adamw8bit-flat.pt": "adamw", "adamw8bit-nan.pt": "adamw", "adam8bit.pt": "adamw",
          "adamw8bit-b2048.pt": "adamw", "paged_adamw8bit.pt": "adamw", "adamw32bit.pt": "adamw",
          "paged_adamw32bit.pt": "adamw", "ademamix8bit.pt": "ademamix",
          "rmsprop8bit.pt": "rmsprop", "adagrad8bit.pt": "adagrad"}
# one-state files whose param group several bitsandbytes optimizers store alike (tests/test_bnb_family.py):
# what wrote each, and the families that fit (bitsandbytes' packing, by hand from its optim/*.py)
AMBIGUOUS = {"lion8bit.pt": ("lion", ("lion", "rmsprop", "sgd")), "sgd8bit.pt": ("sgd", ("lion", "rmsprop", "sgd")),
             "sgd8bit-dampening.pt": ("sgd", ("lion", "rmsprop", "sgd")),
             "rmsprop8bit-eps0.pt": ("rmsprop", ("lion", "rmsprop", "sgd")),
             "lion8bit-beta2-0.pt": ("lion", ("lion", "rmsprop", "sgd")),
             "adagrad8bit-eps0.pt": ("adagrad", ("adagrad", "lion"))}
BITS32 = ("adamw32bit.pt", "paged_adamw32bit.pt")


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32)


def test_the_fixture_set_is_there():
    assert set(STATES) == set(FAMILY) | set(AMBIGUOUS) and all((BNB / n).exists() for n in UNREAD)


@pytest.mark.parametrize("name", UNREAD)
def test_lamb_and_lars_read_as_unknown_naming_what_is_not_modelled(cli, tmp_path, name):
    """Their state1/state2 look like Adam's and SGD's: taken for those, a resume would skip the trust ratio."""
    d = json.loads(cli("inspect", f"fixtures/bnb/{name}", "--json").stdout)
    assert d["family"].startswith("unknown (") and "unorm_vec" in d["family"]
    assert "state1" in d["params"][0]["fields"] and d["tensors"] >= 8
    r = cli("convert", f"fixtures/bnb/{name}", str(tmp_path / "x.pt"))
    assert r.returncode != 0 and "unorm_vec" in r.stderr and not (tmp_path / "x.pt").exists()


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_every_fixture_inspects_with_its_family_and_real_tensors(cli, name):
    d = json.loads(cli("inspect", f"fixtures/bnb/{name}", "--json").stdout)
    assert (d["family"], d["library"]) == (FAMILY[name], "bitsandbytes")
    assert d["tensors"] >= 4 and d["bytes"] > 20_000 and not d["warnings"]
    w1, b1, w2, emb = d["params"]
    assert (w1["shape"], b1["shape"], w2["shape"], emb["shape"]) == ([128, 64], [128], [70, 60], [260, 16])
    assert w1["step"] == 3
    big = w1["fields"]["state1" if FAMILY[name] != "ademamix" else "state1[0]"]
    assert big["slot"] == ("exp_avg" if FAMILY[name] in ("adamw", "lion", "ademamix") else
                           {"sgd": "momentum_buffer", "rmsprop": "square_avg", "adagrad": "sum"}[FAMILY[name]])
    if FAMILY[name] == "ademamix":
        assert big["encoding"]["part"] == 0 and w1["fields"]["state1[1]"]["slot"] == "exp_avg_slow"
    if name in BITS32:
        assert big["encoding"] == {"bits": 32} and big["dtype"] == "F32"
    else:
        block = 2048 if "b2048" in name else 256
        assert big["dtype"] == "U8" and big["encoding"]["bits"] == 8 and big["encoding"]["block"] == block
        assert w1["fields"]["absmax1"]["shape"][-1] == 8192 // block
    # below 4096 elements, and the embedding bitsandbytes was told to keep in 32 bits: float32 state
    for small in (b1, emb):
        assert small["fields"]["state1" if FAMILY[name] != "ademamix" else "state1[0]"]["encoding"]["bits"] == 32
    assert "(no state)" not in cli("inspect", f"fixtures/bnb/{name}").stdout


def test_the_table_shows_each_fields_meaning(cli):
    out = cli("inspect", "fixtures/bnb/adamw8bit.pt", *NAMES).stdout
    assert "optimizer (bitsandbytes adamw)" in out
    assert "state1=exp_avg (8-bit/256)" in out and "state2=exp_avg_sq (32-bit)" in out
    assert "nested (bitsandbytes >= 0.49.2)" in out
    assert "flat (bitsandbytes <= 0.49.1)" in cli("inspect", "fixtures/bnb/adamw8bit-flat.pt").stdout


def test_the_qmaps_in_the_files_are_bitsandbytes_dynamic_maps():
    sd = torch_pt.load_pt(BNB / "adamw8bit.pt")
    q = sd["state"][0]["__bnb_optimizer_quant_state__"]
    assert np.array_equal(bits(q["qmap1"].numpy()), bits(blockwise.dynamic_map(True)))
    assert np.array_equal(bits(q["qmap2"].numpy()), bits(blockwise.dynamic_map(False)))


REF_SLOT = {"momentum": "exp_avg"}  # the script names Lion's moment as burn does; statekit's slot is exp_avg
NOT_MOMENTS = ("param", "grad", "param_next")  # sgd8bit-dampening's record of bitsandbytes' next step
REFERENCED = sorted(p.name[: -len(".ref.npz")] for p in BNB.glob("*.ref.npz") if not p.name.startswith("torch-"))


@pytest.mark.parametrize("name", REFERENCED)
def test_moments_equal_bitsandbytes_dequantize_bit_for_bit(name):
    ref = np.load(BNB / f"{name}.ref.npz")
    with io.open_checkpoint(str(BNB / f"{name}.pt")) as ckpt:
        params = {p.index: p for p in ckpt.optimizer.params}
        checked = 0
        for key in ref.files:
            idx, _, slot = key.partition(".")
            if "." in slot or slot in NOT_MOMENTS:
                continue  # the 2048 file's re-quantized references
            # a family the file cannot tell: the values are state1's until --optimizer names them
            got = params[int(idx)].slots["state1" if f"{name}.pt" in AMBIGUOUS else REF_SLOT.get(slot, slot)].numpy()
            assert got.shape == ref[key].shape and np.array_equal(bits(got), bits(ref[key])), key
            checked += 1
    assert checked >= 2


def test_dequantizing_streams_in_pieces_not_on_block_boundaries():
    with io.open_checkpoint(str(BNB / "ademamix8bit.pt")) as ckpt:
        for slot, ref in ckpt.optimizer.params[2].slots.items():  # 4200 elements: a last block of 104
            whole = ref.numpy().reshape(-1)
            pieces = list(ref.pieces(300))
            assert max(p.size for p in pieces) <= 512 and np.array_equal(bits(np.concatenate(pieces)), bits(whole)), slot


def test_doctor_finds_the_nan_planted_in_an_absmax(cli):
    r = cli("doctor", "fixtures/bnb/adamw8bit-nan.pt", "--json")
    assert r.returncode == 1
    [f] = json.loads(r.stdout)["findings"]
    assert (f["severity"], f["check"], f["param"]) == ("error", "nan", "#0")
    # one scale of 256 elements: the whole block decodes to NaN
    assert f["message"] == "exp_avg (state1 dequantized with absmax1): 256 NaN of 8192"
    r = cli("doctor", "fixtures/bnb/adamw8bit.pt", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["clean"]


@pytest.mark.parametrize("name", ["lamb8bit", "lars8bit"])
def test_doctor_of_an_unread_8bit_state_does_not_call_its_code_tables_a_shape_error(name, cli):
    """LAMB8bit/LARS8bit (unorm_vec: family unknown, the fields kept as stored): qmap (256 codes)
    and absmax (one scale a block) are not the parameter's shape by design; doctor called that
    "error field-shapes: fields have different shapes" (the optimizer's update would fail)."""
    r = cli("doctor", f"fixtures/bnb/{name}.pt", "--json")
    findings = json.loads(r.stdout)["findings"]
    assert not [f for f in findings if f["check"] == "field-shapes"], findings
    assert {f["check"] for f in findings} >= {"layout"}  # unorm_vec is still named as unrecognised


# ----------------------------------------------------------------------------- bnb → torch


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", ["adamw8bit", "adamw8bit-flat", "paged_adamw8bit", "adamw8bit-b2048", "adamw32bit"])
def test_bnb_to_torch_equals_bitsandbytes_dequantize_and_loads_into_torch_adamw(cli, tmp_path, name):
    out = tmp_path / "torch.pt"
    r = cli("convert", f"fixtures/bnb/{name}.pt", str(out))
    assert r.returncode == 0, r.stderr
    sd = torch.load(out, weights_only=True)
    ref_name = "adamw8bit" if name in ("adamw8bit-flat",) else name
    refs = np.load(BNB / f"{ref_name}.ref.npz") if (BNB / f"{ref_name}.ref.npz").exists() else None
    src = torch_pt.load_pt(BNB / f"{name}.pt")
    for idx in range(4):
        entry = sd["state"][idx]
        assert entry["step"].dtype == torch.float32 and float(entry["step"]) == 3.0
        for k, slot in ((1, "exp_avg"), (2, "exp_avg_sq")):
            got = entry[slot].numpy()
            if refs is not None and f"{idx}.{slot}" in refs.files:
                want = refs[f"{idx}.{slot}"]
            else:  # a 32-bit state: the file's own float32 tensor
                s = src["state"][idx]
                want = s.get("__bnb_optimizer_quant_state__", s)[f"state{k}"].numpy()
            assert np.array_equal(bits(got), bits(want)), (idx, slot)
    group = sd["param_groups"][0]
    assert not {"alpha", "t_alpha", "t_beta3"} & set(group)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(128, 64), (128,), (70, 60), (260, 16)]]
    opt = torch.optim.AdamW(params)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.01
    for p in params:
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    assert float(opt.state[params[0]]["step"]) == 4.0
    d = json.loads(cli("inspect", str(out), "--json").stdout)
    assert d["family"] == "adamw" and "library" not in d


@pytest.mark.parametrize(("name", "family", "torch_cls", "slot"), [
    ("rmsprop8bit", "rmsprop", torch.optim.RMSprop, "square_avg"),
    ("adagrad8bit", "adagrad", torch.optim.Adagrad, "sum"),
    ("sgd8bit", "sgd", torch.optim.SGD, "momentum_buffer"),
])
def test_one_state_optimizers_to_torch(cli, tmp_path, name, family, torch_cls, slot):
    out = tmp_path / "torch.pt"
    settle = ["--optimizer", family] if f"{name}.pt" in AMBIGUOUS else []  # SGD8bit's group is also Lion's
    assert cli("convert", f"fixtures/bnb/{name}.pt", str(out), *settle).returncode == 0
    sd = torch.load(out, weights_only=True)
    refs = np.load(BNB / f"{name}.ref.npz")
    assert np.array_equal(bits(sd["state"][0][slot].numpy()), bits(refs[f"0.{slot}"]))
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(128, 64), (128,), (70, 60), (260, 16)]]
    opt = torch_cls(params, lr=0.1, **({"momentum": 0.5} if family == "sgd" else {}))
    opt.load_state_dict(sd)
    assert json.loads(cli("inspect", str(out), "--json").stdout)["family"] == family


@pytest.mark.parametrize(("name", "why"), [("lion8bit", "torch has no lion optimizer"),
                                           ("ademamix8bit", "torch has no ademamix optimizer")])
def test_what_torch_cannot_continue_is_refused_by_name(cli, tmp_path, name, why):
    settle = ["--optimizer", "lion"] if name == "lion8bit" else []
    r = cli("convert", f"fixtures/bnb/{name}.pt", str(tmp_path / "x.pt"), *settle)
    assert r.returncode != 0 and why in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- torch → bnb, bnb → bnb


def test_torch_adamw_to_bnb_codes_and_absmax_equal_bitsandbytes_quantize(cli, tmp_path):
    out = tmp_path / "bnb.pt"
    r = cli("convert", "fixtures/bnb/torch-adamw.pt", str(out), "--to", "bnb")
    assert r.returncode == 0, r.stderr
    assert "bitsandbytes' CPU quantizer" in " ".join((r.stdout + r.stderr).split())
    refs = np.load(BNB / "torch-adamw.ref.npz")
    sd = torch_pt.load_pt(out)
    assert sd["param_groups"][0] == {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01,
                                     "alpha": 0.0, "t_alpha": None, "t_beta3": None, "params": [0, 1, 2, 3]}
    differ = 0
    for idx in (0, 2, 3):  # 8192, 4200 and 4160 elements: 8-bit
        q = sd["state"][idx]["__bnb_optimizer_quant_state__"]
        assert sd["state"][idx]["step"] == 3
        for k, slot in ((1, "exp_avg"), (2, "exp_avg_sq")):
            assert np.array_equal(q[f"state{k}"].numpy(), refs[f"{idx}.{slot}.cpu"]), (idx, slot)
            assert np.array_equal(bits(q[f"absmax{k}"].numpy()), bits(refs[f"{idx}.{slot}.cpu_absmax"]))
            differ += int((q[f"state{k}"].numpy() != refs[f"{idx}.{slot}.torch"]).sum())
    assert differ > 0  # bitsandbytes' pure-torch quantizer would have given other codes
    assert set(sd["state"][1]["__bnb_optimizer_quant_state__"]) == {"state1", "state2"}  # 128 elements: float32


def test_the_pure_torch_quantizer_is_bitsandbytes_default_kernel():
    refs = np.load(BNB / "torch-adamw.ref.npz")
    sd = torch_pt.load_pt(BNB / "torch-adamw.pt")
    for idx in (0, 2):
        for slot, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            codes, absmax = blockwise.quantize(sd["state"][idx][slot].numpy().reshape(-1),
                                               blockwise.dynamic_map(signed), 256, "torch")
            assert np.array_equal(codes, refs[f"{idx}.{slot}.torch"].reshape(-1))
            assert np.array_equal(bits(absmax), bits(refs[f"{idx}.{slot}.torch_absmax"]))


def test_a_2048_block_state_to_256_equals_what_bitsandbytes_writes(cli, tmp_path):
    out = tmp_path / "b256.pt"
    assert cli("convert", "fixtures/bnb/adamw8bit-b2048.pt", str(out), "--to", "bnb").returncode == 0
    refs = np.load(BNB / "adamw8bit-b2048.ref.npz")
    sd = torch_pt.load_pt(out)
    for idx in (0, 2):
        q = sd["state"][idx]["__bnb_optimizer_quant_state__"]
        for k in (1, 2):
            assert np.array_equal(q[f"state{k}"].numpy(), refs[f"{idx}.state{k}.b256"])
            assert np.array_equal(bits(q[f"absmax{k}"].numpy()), bits(refs[f"{idx}.state{k}.absmax256"]))
    src = torch_pt.load_pt(BNB / "adamw8bit-b2048.pt")
    for idx in (1, 3):  # float32 in the source: kept float32, the same values
        q = sd["state"][idx]["__bnb_optimizer_quant_state__"]
        assert set(q) == {"state1", "state2"}
        assert np.array_equal(bits(q["state1"].numpy()), bits(src["state"][idx]["state1"].numpy()))
    d = json.loads(cli("inspect", str(out), "--json").stdout)
    assert d["params"][0]["fields"]["state1"]["encoding"]["block"] == 256


def test_the_older_layouts_can_be_written(cli, tmp_path):
    flat, old = tmp_path / "flat.pt", tmp_path / "old.pt"
    assert cli("convert", "fixtures/bnb/adamw8bit.pt", str(flat), "--to", "bnb-flat").returncode == 0
    assert cli("convert", "fixtures/bnb/adamw8bit.pt", str(old), "--to", "bnb-2048").returncode == 0
    a, b = torch_pt.load_pt(flat), torch_pt.load_pt(old)
    assert set(a["state"][0]) == {"step", "state1", "qmap1", "state2", "qmap2", "absmax1", "absmax2"}
    assert "alpha" in a["param_groups"][0] and "alpha" not in b["param_groups"][0]
    assert b["state"][0]["absmax1"].shape == (4,)  # 8192 / 2048
    # bnb → bnb at the same block size re-quantizes bitsandbytes' own dequantized codes to themselves
    src = torch_pt.load_pt(BNB / "adamw8bit.pt")["state"][0]["__bnb_optimizer_quant_state__"]
    assert np.array_equal(a["state"][0]["state2"].numpy(), src["state2"].numpy())


@pytest.mark.parametrize(("make", "why"), [
    (lambda ps: torch.optim.Adam(ps, weight_decay=0.1), "bitsandbytes' Adam decays the weights"),
    (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "AMSGrad has no bitsandbytes equivalent"),
])
def test_torch_states_bitsandbytes_cannot_continue_are_refused(cli, tmp_path, make, why):
    params = [torch.nn.Parameter(torch.ones(64, 80))]
    opt = make(params)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    src = tmp_path / "src.pt"
    torch.save(opt.state_dict(), src)
    r = cli("convert", str(src), str(tmp_path / "out.pt"), "--to", "bnb")
    assert r.returncode != 0 and why in r.stderr
    assert not (tmp_path / "out.pt").exists()


# ----------------------------------------------------------------------------- verify-resume


@pytest.mark.parametrize(("src", "to", "exact"), [("adamw8bit", None, True), ("adamw8bit-b2048", None, True),
                                                  ("torch-adamw", "bnb", False), ("adamw8bit-b2048", "bnb", False)])
def test_verify_resume_tracks_each_conversion(cli, tmp_path, src, to, exact):
    out = tmp_path / "out.pt"
    assert cli("convert", f"fixtures/bnb/{src}.pt", str(out), *(["--to", to] if to else [])).returncode == 0
    r = cli("verify-resume", f"fixtures/bnb/{src}.pt", str(out), *NAMES, "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["tracks"], d["params"]
    if exact:
        assert all(p["bit_exact"] for p in d["params"])
    else:  # 8-bit codes cannot carry float32 moments exactly: near the original, far from a cold start
        eight = [p for p in d["params"] if not p["bit_exact"]]
        assert eight and all(p["share_of_cold"] < 0.05 for p in eight)
        assert "re-quantized" in d["criterion"]


def test_quantizing_streams_in_bounded_pieces():
    """The writer's codes and scales come a bounded number of blocks at a time, equal to one pass."""
    from statekit.frameworks import bnb
    from statekit.tensor import TensorRef

    values = np.random.default_rng(3).standard_normal(70_000).astype(np.float32)
    ref = TensorRef.from_array(values)
    qmap = blockwise.dynamic_map(True)
    codes, absmax = bnb.quantized(ref, qmap, 256, "codes"), bnb.quantized(ref, qmap, 256, "absmax")
    pieces = list(codes.pieces(1024))
    assert max(p.size for p in pieces) <= 1024
    whole_codes, whole_absmax = blockwise.quantize(values, qmap, 256)
    assert np.array_equal(np.concatenate(pieces), whole_codes)
    assert np.array_equal(bits(np.concatenate(list(absmax.pieces(7)))), bits(whole_absmax))


def test_bnb_to_burn_and_back_through_the_float32_moments(cli, tmp_path):
    """2048-block bnb → burn (bitsandbytes' dequantized moments, exactly) → bnb at 256: what
    bitsandbytes 0.50 writes for those moments."""
    bpk, back = tmp_path / "optim.bpk", tmp_path / "back.pt"
    layout = ["--transpose", "w*", "--no-transpose", "emb"]  # burn keeps Linear weights [in, out]
    r = cli("convert", "fixtures/bnb/adamw8bit-b2048.pt", str(bpk), *NAMES, *layout)
    assert r.returncode == 0, r.stderr
    refs = np.load(BNB / "adamw8bit-b2048.ref.npz")
    with io.open_checkpoint(str(bpk)) as ckpt:
        w1 = next(p for p in ckpt.optimizer.params if p.path == "w1")
        assert w1.step == 3
        assert np.array_equal(bits(w1.slots["exp_avg"].numpy()), bits(refs["0.exp_avg"].T))
        assert np.array_equal(bits(w1.slots["exp_avg_sq"].numpy()), bits(refs["0.exp_avg_sq"].T))
    r = cli("convert", str(bpk), str(back), "--to", "bnb", "--optimizer", "adamw", "--lr", "0.01",
            "--weight-decay", "0.01", *layout)
    assert r.returncode == 0, r.stderr
    sd = torch_pt.load_pt(back)
    order = {0: "w1", 2: "w2"}
    names = (BNB / "names.txt").read_text().split()
    for idx, name in order.items():
        q = sd["state"][names.index(name)]["__bnb_optimizer_quant_state__"]
        for k in (1, 2):
            assert np.array_equal(q[f"state{k}"].numpy(), refs[f"{idx}.state{k}.b256"]), (name, k)


def test_bnb_lion_to_burn_lion_momentum_exact(cli, tmp_path):
    bpk = tmp_path / "lion.bpk"
    r = cli("convert", "fixtures/bnb/lion8bit.pt", str(bpk), *NAMES, "--transpose", "w*", "--no-transpose", "emb",
            "--optimizer", "lion")
    assert r.returncode == 0, r.stderr
    refs = np.load(BNB / "lion8bit.ref.npz")  # bitsandbytes' dequantized state1, under burn's name
    src = torch_pt.load_pt(BNB / "lion8bit.pt")
    names = (BNB / "names.txt").read_text().split()
    with io.open_checkpoint(str(bpk)) as ckpt:
        assert ckpt.optimizer.family == "lion"
        by_path = {p.path: p for p in ckpt.optimizer.params}
        for idx, name in enumerate(names):
            got = by_path[name].slots["exp_avg"].numpy()
            want = refs[f"{idx}.momentum"] if f"{idx}.momentum" in refs.files else \
                src["state"][idx]["__bnb_optimizer_quant_state__"]["state1"].numpy()
            want = want.T if name in ("w1", "w2") else want
            assert np.array_equal(bits(got), bits(want)), name
    d = json.loads(cli("inspect", str(bpk), "--json").stdout)
    assert d["family"] == "lion" and all(set(p["fields"]) == {"momentum"} for p in d["params"])


def test_verify_resume_tracks_bnb_lion_to_burn_lion(cli, tmp_path):
    bpk = tmp_path / "lion.bpk"
    assert cli("convert", "fixtures/bnb/lion8bit.pt", str(bpk), *NAMES, "--transpose", "w*",
               "--no-transpose", "emb", "--optimizer", "lion").returncode == 0
    r = cli("verify-resume", "fixtures/bnb/lion8bit.pt", str(bpk), *NAMES, "--optimizer", "lion")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "--flavor-original burn" in r.stderr
    r = cli("verify-resume", "fixtures/bnb/lion8bit.pt", str(bpk), *NAMES, "--flavor-original", "burn", "--json",
            "--optimizer", "lion")
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["tracks"] and d["optimizer"] == "lion"
    assert all(p["bit_exact"] for p in d["params"])


def test_stats_are_of_the_dequantized_values(cli):
    d = json.loads(cli("inspect", "fixtures/bnb/adamw8bit-nan.pt", "--stats", "--json").stdout)
    w1 = d["params"][0]["fields"]
    assert (w1["state1"]["stats"]["nan"], w1["absmax1"]["stats"]["nan"], w1["state2"]["stats"]["nan"]) == (256, 1, 0)
    refs = np.load(BNB / "adamw8bit.ref.npz")
    v = refs["0.exp_avg_sq"].astype(np.float64)
    assert w1["state2"]["stats"]["max"] == float(v.max()) and w1["state2"]["stats"]["min"] == float(v.min())
    assert w1["state2"]["stats"]["mean"] == pytest.approx(float(v.mean()), rel=1e-12)


def test_verify_resume_tracks_bnb_to_burn(cli, tmp_path):
    bpk = tmp_path / "optim.bpk"
    layout = ["--transpose", "w*", "--no-transpose", "emb"]
    assert cli("convert", "fixtures/bnb/adamw8bit.pt", str(bpk), *NAMES, *layout).returncode == 0
    r = cli("verify-resume", "fixtures/bnb/adamw8bit.pt", str(bpk), *NAMES, "--optimizer", "adamw", "--json")
    d = json.loads(r.stdout)
    assert r.returncode == 0 and d["tracks"], d["params"]
    assert d["flavors"] == {"original": "torch", "migrated": "burn"}
