"""statekit fit (issue 37 item 3): a state fitted to a changed trainable set or optimizer split.

The references are real runs (torch 2.13, peft 0.21.2, CPU, fixed seeds): a model trained 2 steps,
its trainable set or optimizer changed and continued 3 steps in memory (the old optimizer's state
moved to the new one by parameter object: the run that never went through a file), against the same
run through the saved state, ``fit`` and the real ``optimizer.load_state_dict``: every weight and every
state tensor bit for bit (tests/fit_runs.py)."""

import json
from pathlib import Path

import pytest
from conftest import ROOT

from statekit.errors import MappingError, UsageError
from statekit.ops.fit import fit_file, parse_groups

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
runs = pytest.importorskip("fit_runs")

GROUPS = ["decay=*.weight", "no_decay=*"]
FIT = ROOT / "fixtures" / "fit"


def _trained(tmp_path, frozen=(), seed=0):
    """Run 1: the tiny model with ``frozen`` modules, AdamW in Trainer-like groups, 2 steps, saved."""
    m = runs.tiny(seed)
    for name in frozen:
        getattr(m, name).requires_grad_(False)
    opt = torch.optim.AdamW(runs.decay_groups(m), lr=1e-2)
    runs.steps(m, [opt], 0, 2)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    torch.save(m.state_dict(), tmp_path / "model.pt")
    return m, opt


def _reloaded(tmp_path):
    m = runs.Tiny()
    m.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    return m


# ----------------------------------------------------------------------------- an unfrozen layer


def test_unfrozen_layer_continues_bit_for_bit(tmp_path):
    m, opt = _trained(tmp_path, frozen=["l1"])
    ref_m, ref_old = runs.deep((m, opt))
    ref_m.l1.requires_grad_(True)
    ref_opt = torch.optim.AdamW(runs.decay_groups(ref_m), lr=1e-2)
    runs.transplant(ref_old, ref_m, ref_opt, ref_m)
    runs.steps(ref_m, [ref_opt], 2, 3)

    plan = fit_file(tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "fitted.pt", groups=GROUPS)
    assert [n["name"] for n in plan["new"]] == ["l1.weight", "l1.bias"] and plan["dropped"] == []
    # torch numbers positions group by group in named_parameters() order: l1.weight is 1, l1.bias 4
    assert {k["name"]: (k["old_position"], k["position"]) for k in plan["kept"]} == {
        "embed.weight": (0, 0), "l2.weight": (1, 2), "head.weight": (2, 3), "l2.bias": (3, 5), "head.bias": (4, 6)}
    m2 = _reloaded(tmp_path)
    opt2 = torch.optim.AdamW(runs.decay_groups(m2), lr=1e-2)
    sd = torch.load(tmp_path / "fitted.pt", weights_only=True)
    assert 1 not in sd["state"] and 4 not in sd["state"]  # new: no entry, as torch holds for a param never stepped
    opt2.load_state_dict(sd)
    runs.steps(m2, [opt2], 2, 3)
    runs.assert_same(runs.snapshot(m2, [opt2]), runs.snapshot(ref_m, [ref_opt]))


def test_frozen_again_drops_its_state(tmp_path):
    """The other way: a layer trained in run 1 is frozen in run 2: its state is dropped, the rest kept."""
    m, opt = _trained(tmp_path)
    ref_m, ref_old = runs.deep((m, opt))
    ref_m.l2.requires_grad_(False)
    ref_opt = torch.optim.AdamW(runs.decay_groups(ref_m), lr=1e-2)
    runs.transplant(ref_old, ref_m, ref_opt, ref_m)
    runs.steps(ref_m, [ref_opt], 2, 3)
    plan = fit_file(tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "fitted.pt", frozen=["l2.*"])
    assert plan["dropped"] == ["l2.weight", "l2.bias"] and plan["new"] == []
    m2 = _reloaded(tmp_path)
    m2.l2.requires_grad_(False)
    opt2 = torch.optim.AdamW(runs.decay_groups(m2), lr=1e-2)
    opt2.load_state_dict(torch.load(tmp_path / "fitted.pt", weights_only=True))
    runs.steps(m2, [opt2], 2, 3)
    runs.assert_same(runs.snapshot(m2, [opt2]), runs.snapshot(ref_m, [ref_opt]))


def test_tied_weights_are_one_parameter(tmp_path):
    """head.weight tied to embed.weight: the state_dict saves both names over one storage,
    named_parameters() lists the parameter once; fit follows named_parameters()."""
    def tied():
        m = runs.tiny()
        m.head.weight = m.embed.weight
        return m

    m = tied()
    m.l1.requires_grad_(False)
    opt = torch.optim.AdamW(runs.decay_groups(m), lr=1e-2)
    runs.steps(m, [opt], 0, 2)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    torch.save(m.state_dict(), tmp_path / "model.pt")
    assert "head.weight" in torch.load(tmp_path / "model.pt", weights_only=True)
    ref_m, ref_old = runs.deep((m, opt))
    ref_m.l1.requires_grad_(True)
    ref_opt = torch.optim.AdamW(runs.decay_groups(ref_m), lr=1e-2)
    runs.transplant(ref_old, ref_m, ref_opt, ref_m)
    runs.steps(ref_m, [ref_opt], 2, 3)
    plan = fit_file(tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "f.pt", groups=GROUPS)
    assert "head.weight (= embed.weight)" in plan["trainable_from"]
    assert [n["name"] for n in plan["new"]] == ["l1.weight", "l1.bias"]
    m2 = tied()
    m2.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    opt2 = torch.optim.AdamW(runs.decay_groups(m2), lr=1e-2)
    opt2.load_state_dict(torch.load(tmp_path / "f.pt", weights_only=True))
    runs.steps(m2, [opt2], 2, 3)
    runs.assert_same(runs.snapshot(m2, [opt2]), runs.snapshot(ref_m, [ref_opt]))


def test_reset_step_restarts_kept_steps_at_zero(tmp_path):
    m, opt = _trained(tmp_path, frozen=["l1"])
    ref_m, ref_old = runs.deep((m, opt))
    ref_m.l1.requires_grad_(True)
    ref_opt = torch.optim.AdamW(runs.decay_groups(ref_m), lr=1e-2)

    def zero_step(st):
        st["step"] = torch.zeros_like(st["step"])
        return st

    runs.transplant(ref_old, ref_m, ref_opt, ref_m, change=zero_step)
    runs.steps(ref_m, [ref_opt], 2, 3)
    plan = fit_file(tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "fitted.pt", groups=GROUPS,
                    reset_step=True)
    assert {k["step"] for k in plan["kept"]} == {0}
    m2 = _reloaded(tmp_path)
    opt2 = torch.optim.AdamW(runs.decay_groups(m2), lr=1e-2)
    opt2.load_state_dict(torch.load(tmp_path / "fitted.pt", weights_only=True))
    runs.steps(m2, [opt2], 2, 3)
    runs.assert_same(runs.snapshot(m2, [opt2]), runs.snapshot(ref_m, [ref_opt]))


# ----------------------------------------------------------------------------- AdamW → Muon + AdamW

MUON = ("l1.weight", "l2.weight")


def _muon_parts(model):
    mu = torch.optim.Muon([p for n, p in model.named_parameters() if n in MUON], lr=0.02, momentum=0.9)
    aw = torch.optim.AdamW(runs.decay_groups(model, only=lambda n: n not in MUON), lr=1e-2)
    return mu, aw


@pytest.mark.parametrize("policy", ["exp_avg", "fresh"])
def test_adamw_to_muon_plus_adamw(tmp_path, policy):
    m, opt = _trained(tmp_path)
    ref_m, ref_old = runs.deep((m, opt))
    mu, aw = _muon_parts(ref_m)
    if policy == "exp_avg":
        runs.transplant(ref_old, ref_m, mu, ref_m, change=lambda st: {"momentum_buffer": st["exp_avg"]})
    runs.transplant(ref_old, ref_m, aw, ref_m)
    runs.steps(ref_m, [mu, aw], 2, 3)

    p1 = fit_file(tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "muon.pt", trainable=["l?.weight"],
                  optimizer="muon", momentum_from=policy, groups=["muon=*:lr=0.02,momentum=0.9"])
    p2 = fit_file(tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "adamw.pt", frozen=["l?.weight"],
                  groups=GROUPS)
    assert p1["family"] == "muon" and [k["name"] for k in p1["kept"]] == list(MUON)
    assert p2["dropped"] == list(MUON) and p2["family"] == "adamw"
    sd = torch.load(tmp_path / "muon.pt", weights_only=True)
    fields = {tuple(st) for st in sd["state"].values()}
    assert fields == ({("momentum_buffer",)} if policy == "exp_avg" else set())
    m2 = _reloaded(tmp_path)
    mu2, aw2 = _muon_parts(m2)
    mu2.load_state_dict(sd)
    aw2.load_state_dict(torch.load(tmp_path / "adamw.pt", weights_only=True))
    runs.steps(m2, [mu2, aw2], 2, 3)
    runs.assert_same(runs.snapshot(m2, [mu2, aw2]), runs.snapshot(ref_m, [mu, aw]))


def test_carried_exp_avg_is_the_buffer_muon_builds_from_the_same_gradients(tmp_path):
    """--momentum-from exp_avg: real Muon fed run 1's two gradients holds exactly the fitted buffer."""
    m = runs.tiny()
    opt = torch.optim.AdamW(runs.decay_groups(m), lr=1e-2, betas=(0.9, 0.999))
    twin = {n: torch.nn.Parameter(p.detach().clone()) for n, p in m.named_parameters() if n in MUON}
    muon = torch.optim.Muon(list(twin.values()), lr=0.02, momentum=0.9)
    for i in range(2):
        opt.zero_grad()
        runs.tiny_loss(m, i).backward()
        for n, p in m.named_parameters():
            if n in twin:
                twin[n].grad = p.grad.clone()
        opt.step()
        muon.step()
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    torch.save(m.state_dict(), tmp_path / "model.pt")
    fit_file(tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "muon.pt", trainable=list(MUON),
             optimizer="muon", momentum_from="exp_avg", groups=["muon=*:momentum=0.9"])
    sd = torch.load(tmp_path / "muon.pt", weights_only=True)
    for pos, name in enumerate(sd["param_groups"][0]["param_names"]):
        assert torch.equal(sd["state"][pos]["momentum_buffer"], muon.state[twin[name]]["momentum_buffer"]), name


def test_muon_refusals(tmp_path):
    _trained(tmp_path)
    args = (tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "m.pt")
    with pytest.raises(UsageError, match="--momentum-from exp_avg"):
        fit_file(*args, trainable=list(MUON), optimizer="muon")
    with pytest.raises(MappingError, match=r"β1 = 0\.9, Muon's group has momentum = 0\.95"):
        fit_file(*args, trainable=list(MUON), optimizer="muon", momentum_from="exp_avg")  # torch's default 0.95
    with pytest.raises(MappingError, match=r"l1.bias: Muon takes 2-D matrices only"):
        fit_file(*args, trainable=["l1.*"], optimizer="muon", momentum_from="fresh")
    with pytest.raises(MappingError, match="has no hyperparameter betas"):
        fit_file(*args, trainable=list(MUON), optimizer="muon", momentum_from="fresh", groups=["m=*:betas=0.9,0.99"])
    with pytest.raises(UsageError, match="Muon keeps no step count"):
        fit_file(*args, trainable=list(MUON), optimizer="muon", momentum_from="fresh", reset_step=True)
    with pytest.raises(UsageError, match="sgd is not one it knows"):
        fit_file(*args, optimizer="sgd")
    assert not (tmp_path / "m.pt").exists()


# ----------------------------------------------------------------------------- LoRA modules_to_save (unsloth #3108)


def _llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                                   max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    return lambda: transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base")


def _lora(modules_to_save):
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=modules_to_save,
                           init_lora_weights="gaussian")


def _lm_loss(model, i):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randint(0, 32, (2, 8), generator=g)
    return model(input_ids=x, labels=x).loss


MTS = ["lm_head", "embed_tokens"]


@pytest.mark.hf
@pytest.mark.peft
@pytest.mark.parametrize("before, after", [(None, MTS), (MTS, None)], ids=["added", "removed"])
def test_lora_modules_to_save_changed(tmp_path, before, after):
    import peft

    base = _llama(tmp_path)
    torch.manual_seed(1)
    m1 = peft.get_peft_model(base(), _lora(before))
    o1 = torch.optim.AdamW(runs.decay_groups(m1), lr=1e-2)
    runs.steps(m1, [o1], 0, 2, _lm_loss)
    torch.save(o1.state_dict(), tmp_path / "optimizer.pt")
    torch.manual_seed(2)
    m2 = peft.get_peft_model(base(), _lora(after))  # run 2's adapter starts from run 1's trained weights
    w1 = dict(m1.named_parameters())
    with torch.no_grad():
        for n, p in m2.named_parameters():
            if n in w1:
                p.copy_(w1[n])
    m2.save_pretrained(tmp_path / "run2")
    ref_m = runs.deep(m2)
    ref_o = torch.optim.AdamW(runs.decay_groups(ref_m), lr=1e-2)
    runs.transplant(o1, m1, ref_o, ref_m)
    runs.steps(ref_m, [ref_o], 2, 3, _lm_loss)

    plan = fit_file(tmp_path / "optimizer.pt", tmp_path / "run2", tmp_path / "fitted.pt",
                    groups=["decay=*.weight", "no_decay=*:weight_decay=0.0"])
    saved = ["base_model.model.model.embed_tokens.modules_to_save.default.weight",
             "base_model.model.lm_head.modules_to_save.default.weight"]
    assert sorted(n["name"] for n in plan["new"]) == (sorted(saved) if after else [])
    assert sorted(plan["dropped"]) == (sorted(saved) if before else [])
    assert len(plan["kept"]) == 4 and all(".lora_" in k["name"] for k in plan["kept"])
    m3 = peft.PeftModel.from_pretrained(base(), tmp_path / "run2", is_trainable=True)
    o3 = torch.optim.AdamW(runs.decay_groups(m3), lr=1e-2)
    o3.load_state_dict(torch.load(tmp_path / "fitted.pt", weights_only=True))
    runs.steps(m3, [o3], 2, 3, _lm_loss)
    runs.assert_same(runs.snapshot(m3, [o3]), runs.snapshot(ref_m, [ref_o]))


@pytest.mark.hf
@pytest.mark.peft
@pytest.mark.slow
def test_trainer_lora_folder_with_training_args(tmp_path):
    """unsloth #3108 as it happens: a Trainer LoRA checkpoint folder (optimizer.pt without param_names,
    named from its adapter), run 2 adds modules_to_save; --training-args gives the groups, and real
    Trainer.create_optimizer builds the optimizers of both runs."""
    import peft
    import transformers

    base = _llama(tmp_path)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=1e-2, weight_decay=0.1,
                                          adam_beta2=0.99, use_cpu=True, report_to=[])

    def trainer_optimizer(model):
        return transformers.Trainer(model=model, args=args).create_optimizer()

    torch.manual_seed(1)
    m1 = peft.get_peft_model(base(), _lora(None))
    o1 = trainer_optimizer(m1)
    runs.steps(m1, [o1], 0, 2, _lm_loss)
    ckpt = tmp_path / "checkpoint-2"
    m1.save_pretrained(ckpt)
    torch.save(o1.state_dict(), ckpt / "optimizer.pt")
    torch.save(args, ckpt / "training_args.bin")  # as Trainer saves it
    torch.manual_seed(2)
    m2 = peft.get_peft_model(base(), _lora(MTS))
    w1 = dict(m1.named_parameters())
    with torch.no_grad():
        for n, p in m2.named_parameters():
            if n in w1:
                p.copy_(w1[n])
    m2.save_pretrained(tmp_path / "run2")
    ref_m = runs.deep(m2)
    ref_o = trainer_optimizer(ref_m)
    runs.transplant(o1, m1, ref_o, ref_m)
    runs.steps(ref_m, [ref_o], 2, 3, _lm_loss)

    plan = fit_file(ckpt, tmp_path / "run2", tmp_path / "fitted.pt", training_args=ckpt / "training_args.bin")
    assert [(g["name"], g["params"], g["hyperparams"]["weight_decay"], g["hyperparams"]["betas"])
            for g in plan["groups"]] == [("decay", 6, 0.1, [0.9, 0.99]), ("no_decay", 0, 0.0, [0.9, 0.99])]
    m3 = peft.PeftModel.from_pretrained(base(), tmp_path / "run2", is_trainable=True)
    o3 = trainer_optimizer(m3)
    o3.load_state_dict(torch.load(tmp_path / "fitted.pt", weights_only=True))
    runs.steps(m3, [o3], 2, 3, _lm_loss)
    runs.assert_same(runs.snapshot(m3, [o3]), runs.snapshot(ref_m, [ref_o]))

    # modules_to_save=["norm"] too: Trainer's releases disagree whether an RMSNorm weight decays
    m4 = peft.get_peft_model(base(), _lora([*MTS, "norm"]))
    m4.save_pretrained(tmp_path / "run3")
    with pytest.raises(MappingError, match=r"split the trainable parameters differently \(\S*norm\.modules_to_save"):
        fit_file(ckpt, tmp_path / "run3", tmp_path / "f3.pt", training_args=ckpt / "training_args.bin")
    torch.save(runs.tiny().state_dict(), tmp_path / "plain.pt")
    with pytest.raises(UsageError, match="holds no model definition"):
        fit_file(ckpt, tmp_path / "plain.pt", tmp_path / "f3.pt", training_args=ckpt / "training_args.bin")
    assert not (tmp_path / "f3.pt").exists()


# ----------------------------------------------------------------------------- refusals


def test_resized_tensor_is_refused(tmp_path):
    _trained(tmp_path)
    torch.manual_seed(3)
    grown = runs.Tiny()
    grown.embed = torch.nn.Embedding(12, 8)
    torch.save(grown.state_dict(), tmp_path / "grown.pt")
    with pytest.raises(MappingError, match=r"embed.weight: the state's is \[10, 8\], the model's \[12, 8\]"):
        fit_file(tmp_path / "opt.pt", tmp_path / "grown.pt", tmp_path / "f.pt")
    assert not (tmp_path / "f.pt").exists()


@pytest.mark.parametrize("rows", [12, 7], ids=["grown", "cut"])
def test_resized_embedding_with_resize(tmp_path, rows):
    """--resize: the embedding grown (new rows: zero moments, as torch starts a new parameter's) or cut; the
    in-memory continuation pads or cuts the moments with torch itself."""
    m, opt = _trained(tmp_path)
    ref_m, ref_old = runs.deep((m, opt))

    def loss(model, i):  # a cut vocabulary sees only its own tokens
        x, y = runs.batch(i)
        return torch.nn.functional.cross_entropy(model(x % rows).reshape(-1, 10), y.reshape(-1))

    def resized(model):
        old = model.embed.weight.detach()
        torch.manual_seed(7)
        new = torch.nn.Embedding(rows, 8)
        with torch.no_grad():
            new.weight[: min(rows, 10)] = old[: min(rows, 10)]
        model.embed = new
        return model

    old_embed = ref_m.embed.weight
    resized(ref_m)
    ref_opt = torch.optim.AdamW(runs.decay_groups(ref_m), lr=1e-2)
    runs.transplant(ref_old, ref_m, ref_opt, ref_m)
    st = ref_old.state[old_embed]
    pad = {k: torch.zeros(rows, 8) for k in ("exp_avg", "exp_avg_sq")}
    for k in pad:
        pad[k][: min(rows, 10)] = st[k][: min(rows, 10)]
    ref_opt.state[ref_m.embed.weight] = {"step": st["step"].clone(), **pad}
    runs.steps(ref_m, [ref_opt], 2, 3, loss=loss)

    torch.save(resized(runs.deep(m)).state_dict(), tmp_path / "resized.pt")
    plan = fit_file(tmp_path / "opt.pt", tmp_path / "resized.pt", tmp_path / "f.pt", groups=GROUPS, resize=True)
    assert [k["resized"] for k in plan["kept"] if "resized" in k] == [[[10, 8], [rows, 8]]]
    m2 = runs.Tiny()
    m2.embed = torch.nn.Embedding(rows, 8)
    m2.load_state_dict(torch.load(tmp_path / "resized.pt", weights_only=True))
    opt2 = torch.optim.AdamW(runs.decay_groups(m2), lr=1e-2)
    opt2.load_state_dict(torch.load(tmp_path / "f.pt", weights_only=True))
    runs.steps(m2, [opt2], 2, 3, loss=loss)
    runs.assert_same(runs.snapshot(m2, [opt2]), runs.snapshot(ref_m, [ref_opt]))


def test_group_refusals(tmp_path):
    _trained(tmp_path, frozen=["l1"])
    args = (tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "f.pt")
    with pytest.raises(MappingError, match="new parameters l1.weight, l1.bias: the state has 2 param groups"):
        fit_file(*args)
    with pytest.raises(MappingError, match=r"2 trainable parameters are in no --group: l1.bias, l2.bias"):
        fit_file(*args, groups=["w=*.weight", "hb=head.bias", "eb=embed.*"])
    with pytest.raises(MappingError, match="different weight_decay"):
        fit_file(*args, groups=["all=*"])
    with pytest.raises(MappingError, match="has no hyperparameter momentum"):
        fit_file(*args, groups=["w=*.weight:momentum=0.9", "b=*"])
    with pytest.raises(UsageError, match="is a folder; fit writes one file"):
        fit_file(tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path, groups=GROUPS)
    with pytest.raises(UsageError, match="--trainable nope.*: selects no parameter"):
        fit_file(*args, trainable=["nope.*"])
    assert not (tmp_path / "f.pt").exists()


def test_unnamed_state_is_refused_and_names_settle_it(tmp_path):
    m = runs.tiny()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)  # parameters(), not named: the file has no param_names
    runs.steps(m, [opt], 0, 2)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    torch.save(m.state_dict(), tmp_path / "model.pt")
    with pytest.raises(MappingError, match="positions have no names"):
        fit_file(tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "f.pt")
    (tmp_path / "names.txt").write_text("\n".join(n for n, _ in m.named_parameters()) + "\n")
    plan = fit_file(tmp_path / "opt.pt", tmp_path / "model.pt", tmp_path / "f.pt", names=str(tmp_path / "names.txt"))
    assert len(plan["kept"]) == 7 and plan["new"] == []


def test_sorted_safetensors_model_is_refused(tmp_path):
    from safetensors.torch import save_file

    m, _ = _trained(tmp_path)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "model.safetensors")
    with pytest.raises(MappingError, match=r"not in named_parameters\(\) order"):
        fit_file(tmp_path / "opt.pt", tmp_path / "model.safetensors", tmp_path / "f.pt")


def test_parse_groups():
    g = parse_groups(["a=x.*,y.*:lr=0.1,betas=0.9,0.95,amsgrad=true", "b=*"])
    assert [(s.name, s.patterns, s.settings) for s in g] == [
        ("a", ["x.*", "y.*"], {"lr": 0.1, "betas": (0.9, 0.95), "amsgrad": True}), ("b", ["*"], {})]
    for bad in (["a"], ["=x"], ["a=:lr=1"], ["a=x", "a=y"]):
        with pytest.raises(UsageError):
            parse_groups(bad)


# ----------------------------------------------------------------------------- the CLI and the committed fixture


def test_cli_json_dry_run_and_errors(cli, tmp_path):
    _trained(tmp_path, frozen=["l1"])
    r = cli("fit", "opt.pt", "--model", "model.pt", "--group", "decay=*.weight", "--group", "no_decay=*",
            "-o", "f.pt", "--json", "--dry-run", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["dry_run"] and not d["written"] and not (tmp_path / "f.pt").exists()
    assert [n["position"] for n in d["new"]] == [1, 4]
    r = cli("fit", "opt.pt", "--model", "model.pt", "-o", "f.pt", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "give the new groups with --group" in r.stderr and not (tmp_path / "f.pt").exists()
    r = cli("fit", "opt.pt", "--model", "model.pt", "--group", "decay=*.weight", "--group", "no_decay=*",
            "-o", "f.pt", "--format", "tsv", cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "f.pt").exists()
    rows = [line.split("\t") for line in r.stdout.splitlines()[1:]]
    assert [(row[0], row[1], row[2]) for row in rows[:2]] == [("embed.weight", "kept", "0"), ("l1.weight", "new", "1")]


def test_committed_fixture_fits_and_loads(tmp_path):
    """fixtures/fit (scripts/make_fit_fixtures.py, torch 2.13): the state of a run with l1 frozen, the model."""
    plan = fit_file(FIT / "frozen-optim.pt", FIT / "model.pt", tmp_path / "f.pt", groups=GROUPS)
    old = torch.load(FIT / "frozen-optim.pt", weights_only=True)
    new = torch.load(tmp_path / "f.pt", weights_only=True)
    names_old = [n for g in old["param_groups"] for n in g["param_names"]]
    names_new = [n for g in new["param_groups"] for n in g["param_names"]]
    assert "l1.weight" not in names_old and names_new.index("l1.weight") == 1
    for i, name in enumerate(names_new):
        if name in names_old:
            a, b = old["state"][names_old.index(name)], new["state"][i]
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), name
        else:
            assert i not in new["state"]
    m = runs.Tiny()
    m.load_state_dict(torch.load(FIT / "model.pt", weights_only=True))
    torch.optim.AdamW(runs.decay_groups(m), lr=1e-2).load_state_dict(new)
    assert len(plan["new"]) == 2 and Path(plan["output"]).exists()


def test_python_api(tmp_path):
    import statekit

    plan = statekit.fit(FIT / "frozen-optim.pt", FIT / "model.pt", tmp_path / "f.pt", groups=GROUPS, dry_run=True)
    assert [n["name"] for n in plan["new"]] == ["l1.weight", "l1.bias"] and not (tmp_path / "f.pt").exists()
