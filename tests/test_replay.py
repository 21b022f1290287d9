"""replay and verify-resume from the user's side."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

HAND_NAMES = ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
SHAPES = {"l1.weight": (4, 16), "l1.bias": (16,), "l2.weight": (16, 1), "l2.bias": (1,)}


def make_files(tmp_path, n, seed=0):
    rng = np.random.default_rng(seed)
    save_file({k: rng.normal(0, 0.5, s).astype(np.float32) for k, s in SHAPES.items()}, str(tmp_path / "p0.safetensors"))
    grads = []
    for i in range(n):
        path = tmp_path / f"g{i + 1}.safetensors"
        save_file({k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in SHAPES.items()}, str(path))
        grads.append(path)
    return tmp_path / "p0.safetensors", grads


def grad_args(grads):
    """``--grads G1 G2 ...`` (the issue's spelling); the repeated-flag form is tested below."""
    return ["--grads", *grads]


def test_repeated_grads_flag_is_the_same(tmp_path, cli):
    p0, grads = make_files(tmp_path, 3)
    common = ["--params", p0, "--optimizer", "adam", "--lr", "1e-2"]
    assert cli("replay", *common, *grad_args(grads), "--out-params", tmp_path / "a.safetensors").returncode == 0
    repeated = [a for g in grads for a in ("--grads", g)]
    assert cli("replay", *common, *repeated, "--out-params", tmp_path / "b.safetensors").returncode == 0
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.parametrize(("flavor", "ext", "extra"), [("torch-fused", ".pt", ["--optimizer", "adamw"]),
                                                      ("burn", ".bpk", ["--optimizer", "adam"]),
                                                      ("torch", ".pt", ["--optimizer", "sgd", "--momentum", "0.9"])])
def test_continuation_equals_reconstruction(tmp_path, cli, flavor, ext, extra):
    p0, grads = make_files(tmp_path, 6)
    common = ["--flavor", flavor, "--lr", "1e-2", *extra]
    # from scratch over all six steps
    r = cli("replay", "--params", p0, *grad_args(grads), "--out-params", tmp_path / "pn.safetensors",
            "--out-state", tmp_path / f"sn{ext}", *common)
    assert r.returncode == 0, r.stderr
    # four steps, then the remaining two from the saved state
    r = cli("replay", "--params", p0, *grad_args(grads[:4]), "--out-params", tmp_path / "pk.safetensors",
            "--out-state", tmp_path / f"sk{ext}", *common)
    assert r.returncode == 0, r.stderr
    r = cli("replay", "--state", tmp_path / f"sk{ext}", "--params", tmp_path / "pk.safetensors", *grad_args(grads[4:]),
            "--out-params", tmp_path / "pn2.safetensors", "--out-state", tmp_path / f"sn2{ext}", *common)
    assert r.returncode == 0, r.stderr
    a, b = load_file(str(tmp_path / "pn.safetensors")), load_file(str(tmp_path / "pn2.safetensors"))
    for k in SHAPES:
        assert np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)), k
    da = json.loads(cli("inspect", tmp_path / f"sn{ext}", "--stats", "--json").stdout)
    db = json.loads(cli("inspect", tmp_path / f"sn2{ext}", "--stats", "--json").stdout)
    for pa, pb in zip(da["params"], db["params"], strict=True):
        assert pa["step"] == pb["step"] and pa["fields"] == pb["fields"]
    if "sgd" not in extra:
        assert {p["step"] for p in da["params"]} == {6}


def test_replay_matches_torch_fused_adam(tmp_path, cli):
    torch = pytest.importorskip("torch")
    p0, grads = make_files(tmp_path, 5)
    r = cli("replay", "--params", p0, *grad_args(grads), "--out-params", tmp_path / "out.safetensors",
            "--out-state", tmp_path / "s.pt", "--optimizer", "adam", "--flavor", "torch-fused", "--lr", "1e-2")
    assert r.returncode == 0, r.stderr
    params = {k: torch.nn.Parameter(torch.from_numpy(v)) for k, v in load_file(str(p0)).items()}
    opt = torch.optim.Adam(params.values(), lr=1e-2, fused=True)
    for g in grads:
        gd = load_file(str(g))
        for k, p in params.items():
            p.grad = torch.from_numpy(gd[k])
        opt.step()
    got = load_file(str(tmp_path / "out.safetensors"))
    for k, p in params.items():
        assert torch.equal(p.detach(), torch.from_numpy(got[k])), k
    sd = torch.load(tmp_path / "s.pt", weights_only=True)
    assert torch.equal(sd["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert sd["state"][0]["step"].item() == 5.0


def _hand_pt(tmp_path, cli, name="h.pt", *extra):
    (tmp_path / "names.txt").write_text("\n".join(HAND_NAMES))
    r = cli("convert", "fixtures/hand-optim.bpk", tmp_path / name, "--optimizer", "adam", "--names",
            tmp_path / "names.txt", "--transpose", "*.weight", *extra)
    assert r.returncode == 0, r.stderr
    return tmp_path / name


def test_verify_resume_passes_for_a_correct_conversion(tmp_path, cli):
    pt = _hand_pt(tmp_path, cli)
    r = cli("verify-resume", "fixtures/hand-optim.bpk", pt, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["tracks"] and report["flavors"] == {"original": "burn", "migrated": "torch"}
    assert all(p["transposed"] == p["path"].endswith("weight") for p in report["params"])
    assert all(p["cold_ratio"] > 100 for p in report["params"])  # a cold start is far off


def test_verify_resume_same_arithmetic_is_bit_exact(tmp_path, cli):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    assert cli("convert", tmp_path / "ckpt.pt", tmp_path / "o.bpk", "--transpose", "*.weight").returncode == 0
    (tmp_path / "n.txt").write_text("0.weight\n0.bias\n1.weight\n1.bias\n")
    assert cli("convert", tmp_path / "o.bpk", tmp_path / "back.pt", "--names", tmp_path / "n.txt",
               "--transpose", "*.weight").returncode == 0
    report = json.loads(cli("verify-resume", tmp_path / "ckpt.pt", tmp_path / "back.pt", "--json").stdout)
    assert report["tracks"] and report["criterion"] == "bit-exact"
    assert all(p["bit_exact"] for p in report["params"])


def test_verify_resume_catches_swapped_parameters(tmp_path, cli):
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).sum().backward()
        opt.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    (tmp_path / "good.txt").write_text("0.weight\n0.bias\n1.weight\n1.bias\n")
    (tmp_path / "bad.txt").write_text("1.weight\n1.bias\n0.weight\n0.bias\n")  # same shapes: nothing else notices
    assert cli("convert", tmp_path / "opt.pt", tmp_path / "good.bpk", "--names", tmp_path / "good.txt",
               "--transpose", "*.weight").returncode == 0
    assert cli("convert", tmp_path / "opt.pt", tmp_path / "bad.bpk", "--names", tmp_path / "bad.txt",
               "--transpose", "*.weight").returncode == 0
    # name the original's positions with the true names, through a checkpoint holding the model
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    # square weights: which layout the conversion used is said with --transpose, as for convert
    assert cli("verify-resume", tmp_path / "ckpt.pt", tmp_path / "good.bpk", "--transpose", "*.weight").returncode == 0
    r = cli("verify-resume", tmp_path / "ckpt.pt", tmp_path / "bad.bpk", "--transpose", "*.weight")
    assert r.returncode == 1 and "DIVERGES" in r.stdout


def test_verify_resume_catches_a_wrong_eps_at_step_1(tmp_path, cli):
    torch = pytest.importorskip("torch")
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-5)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "step1.pt")
    assert cli("convert", tmp_path / "step1.pt", tmp_path / "s.bpk", "--transpose", "*.weight").returncode == 0
    (tmp_path / "n.txt").write_text("0.weight\n0.bias\n1.weight\n1.bias\n")
    base = ["convert", tmp_path / "s.bpk", "--names", tmp_path / "n.txt", "--transpose", "*.weight"]
    assert cli(*base[:2], tmp_path / "ok.pt", *base[2:]).returncode == 0
    assert cli(*base[:2], tmp_path / "eps.pt", *base[2:], "--eps", "1e-8").returncode == 0
    assert cli("verify-resume", tmp_path / "s.bpk", tmp_path / "ok.pt").returncode == 0
    r = cli("verify-resume", tmp_path / "s.bpk", tmp_path / "eps.pt")
    assert r.returncode == 1 and "eps: 1e-05 vs 1e-08" in r.stdout


def test_verify_resume_flags_a_silent_empty_restore(tmp_path, cli):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), eps=1e-5)
    sd = opt.state_dict()  # never stepped: no state at all
    sd["param_groups"][0]["param_names"] = HAND_NAMES
    torch.save(sd, tmp_path / "empty.pt")
    r = cli("verify-resume", "fixtures/hand-optim.bpk", tmp_path / "empty.pt", "--json")
    assert r.returncode == 1
    assert not any(p["has_state"] for p in json.loads(r.stdout)["params"])


def test_a_fused_torch_state_is_verified_with_the_fused_arithmetic(tmp_path, cli):
    torch = pytest.importorskip("torch")
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    assert cli("convert", tmp_path / "ckpt.pt", tmp_path / "o.bpk", "--transpose", "*.weight").returncode == 0
    (tmp_path / "n.txt").write_text("0.weight\n0.bias\n1.weight\n1.bias\n")
    assert cli("convert", tmp_path / "o.bpk", tmp_path / "back.pt", "--names", tmp_path / "n.txt",
               "--transpose", "*.weight").returncode == 0
    report = json.loads(cli("verify-resume", tmp_path / "ckpt.pt", tmp_path / "back.pt", "--json").stdout)
    assert report["flavors"] == {"original": "torch-fused", "migrated": "torch-fused"}
    assert report["tracks"] and report["criterion"] == "bit-exact"


@pytest.mark.slow
def test_verify_resume_memory_does_not_grow_with_steps(tmp_path, kernel="auto"):
    """Gradients are generated one step of one parameter at a time: peak traced memory is the
    same for 2 and 12 steps and stays under 4x the state (its moments) whatever the step count."""
    import tracemalloc

    torch = pytest.importorskip("torch")
    from statekit import api

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 512)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    state_bytes = 2 * 4 * sum(p.numel() for p in model.parameters())
    peaks = {}
    for steps in (2, 12):
        tracemalloc.start()
        report = api.verify_resume(tmp_path / "ckpt.pt", tmp_path / "ckpt.pt", steps=steps, kernel=kernel)
        peaks[steps] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert report["tracks"] and all(p["bit_exact"] for p in report["params"])
    assert peaks[12] <= 1.1 * peaks[2]
    assert peaks[12] <= 4 * state_bytes, (peaks, state_bytes)


def test_the_kernel_is_chosen_printed_and_can_be_forced(tmp_path, cli):
    """auto picks a kernel and says which; --kernel reference gives the same bytes; an
    impossible --kernel is one clear error line."""
    p0, grads = make_files(tmp_path, 3)
    outs = {}
    for kernel in ("auto", "reference"):
        out = tmp_path / f"p_{kernel}.safetensors"
        r = cli("replay", "--params", p0, *grad_args(grads), "--optimizer", "adam", "--flavor", "torch-fused",
                "--lr", "1e-2", "--out-params", out, "--kernel", kernel, "--json")
        assert r.returncode == 0, r.stderr
        outs[kernel] = json.loads(r.stdout)["kernel"]
    from statekit.optim import kernels

    assert outs == {"reference": "reference",
                    "auto": "torch" if kernels.torch_available() else "numba" if kernels.numba_available() else "reference"}
    assert load_file(str(tmp_path / "p_auto.safetensors")).keys() == load_file(str(tmp_path / "p_reference.safetensors")).keys()
    for k, v in load_file(str(tmp_path / "p_auto.safetensors")).items():
        assert np.array_equal(v.view(np.uint32), load_file(str(tmp_path / "p_reference.safetensors"))[k].view(np.uint32))
    r = cli("replay", "--params", p0, *grad_args(grads), "--optimizer", "adam", "--flavor", "burn", "--lr", "1e-2",
            "--out-params", tmp_path / "x.safetensors", "--kernel", "torch")
    assert r.returncode != 0 and "--kernel torch" in r.stderr and "burn" in r.stderr
    assert not (tmp_path / "x.safetensors").exists()
    r = cli("replay", "--params", p0, *grad_args(grads), "--optimizer", "adam", "--flavor", "torch-fused",
            "--lr", "1e-2", "--out-params", tmp_path / "y.safetensors")
    assert r.returncode == 0 and " kernel)" in r.stdout
