"""Write ``fixtures/bnb/``: optimizer states saved by the real bitsandbytes, and bitsandbytes' own
dequantized moments and quantizer outputs as references.

    python3 -m venv --system-site-packages /work/venvs/bnb
    /work/venvs/bnb/bin/pip install 'torch==2.13.0' bitsandbytes==0.50.2
    /work/venvs/bnb/bin/python scripts/make_bnb_fixtures.py [NAME ...]   # NAMEs: only those fixtures

bitsandbytes >= 0.50 runs its 8-bit optimizers on CPU. The test suite does not need it: it reads
the committed files. Four parameters (torch ids 0..3, names in ``names.txt``): ``w1`` 128×64
(8192 elements: 32 blocks of 256, 4 of 2048), ``b1`` 128 (below ``min_8bit_size`` = 4096: kept in
32 bits by every 8-bit optimizer), ``w2`` 70×60 (4200 elements, not a multiple of 256: a last
block of 104) and ``emb`` 260×16 (4160 elements, kept in 32 bits by a ``GlobalOptimManager``
override, as transformers' Trainer does for every ``nn.Embedding``). Each optimizer steps 3 times
on seeded gradients, then its state is saved:

* ``<name>.pt`` — ``opt.state_dict()`` of bitsandbytes 0.50.2: each parameter's tensors nested
  under ``__bnb_optimizer_quant_state__`` (the layout since 0.49.2).
* ``adamw8bit-flat.pt`` — the same AdamW8bit through the base
  ``torch.optim.Optimizer.state_dict(opt)``: the flat layout every bitsandbytes <= 0.49.1 wrote.
* ``paged_adamw8bit.pt`` / ``paged_adamw32bit.pt`` — Paged* optimizers. On CPU bitsandbytes falls
  back to ordinary buffers, so the script tags the state tensors ``is_paged`` / ``page_deviceid``
  exactly as ``bitsandbytes.functional.get_paged`` does on a GPU: torch then pickles them through
  ``torch._tensor._rebuild_from_type_v2`` with that dict (the real files' difference).
* ``adamw8bit-b2048.pt`` — the layout of bitsandbytes <= 0.43 (flat, block size 2048, param group
  without ``alpha``/``t_alpha``/``t_beta3``): AdamW32bit's fp32 moments quantized by bitsandbytes'
  own ``quantize_blockwise(blocksize=2048)``.
* ``lamb8bit.pt`` / ``lars8bit.pt`` — LAMB8bit and LARS8bit, whose ``unorm_vec`` statekit does not
  model: they must read as unknown, not as Adam or SGD.
* ``sgd8bit-dampening.pt``, ``rmsprop8bit-eps0.pt``, ``lion8bit-beta2-0.pt``, ``adagrad8bit-eps0.pt``
  — one-state optimizers whose param group another one-state optimizer stores alike (SGD8bit with
  dampening 0.5: betas (0.9, 0.5), eps 0, as a Lion8bit's; RMSprop8bit with eps 0: as an SGD8bit's;
  Lion8bit with beta2 0: as an SGD8bit's; Adagrad8bit with eps 0: as a Lion8bit with betas (0, 0)).
  ``sgd8bit-dampening.ref.npz`` also holds, for ids 1 and 2, ``<id>.param`` / ``.grad`` / ``.param_next``: the
  parameters after the 3 steps, a 4th gradient, and the parameters after SGD8bit's own 4th step.
* ``adamw8bit-nan.pt`` — ``adamw8bit.pt`` with one absmax of ``w1``'s first moment set to NaN.
* ``torch-adamw.pt`` — ``torch.optim.AdamW`` on the same parameters and gradients.
* ``<name>.ref.npz`` — the references: ``<id>.<slot>`` the fp32 moments as
  ``bitsandbytes.functional.dequantize_blockwise`` gives them (``exp_avg``, ``exp_avg_sq``,
  ``momentum``, AdEMAMix's ``exp_avg_slow``); for ``adamw8bit-b2048`` also ``<id>.<state>.b256`` /
  ``.absmax256``: what bitsandbytes 0.50 writes for the dequantized moments at block size 256; for
  ``torch-adamw``, ``<id>.<slot>.cpu`` / ``.cpu_absmax`` (bitsandbytes' CPU C quantizer, the one its
  8-bit optimizers use on CPU) and ``.torch`` / ``.torch_absmax`` (its pure-torch "default"
  quantizer), which differ on a few codes.
* ``versions.json`` — the library versions that wrote them.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch

_DEFAULT_KERNELS: dict[str, object] = {}
_register = torch.library.register_kernel


def _recording(op, device_types, func=None, **kw):  # keep bnb's pure-torch kernels callable
    if device_types == "default" and func is None:
        def wrap(fn):
            _DEFAULT_KERNELS[str(op)] = fn
            return _register(op, device_types, **kw)(fn)
        return wrap
    return _register(op, device_types, func, **kw)


torch.library.register_kernel = _recording
import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as F  # noqa: E402

torch.library.register_kernel = _register

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "bnb"
SHAPES = {"w1": (128, 64), "b1": (128,), "w2": (70, 60), "emb": (260, 16)}
STEPS = 3


def params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in SHAPES.values()]


def train(make, ps: list[torch.nn.Parameter], steps: int = STEPS):
    opt = make(ps)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g) * 0.05
        opt.step()
    return opt


def bnb_opt(cls, **kw):
    def make(ps):
        mng = bnb.optim.GlobalOptimManager.get_instance()
        mng.initialize()
        mng.register_parameters(ps)
        mng.override_config(ps[3], "optim_bits", 32)  # the embedding, as transformers' Trainer does
        return cls(ps, **kw)
    return make


def quant_state(entry: dict) -> dict:
    return entry.get("__bnb_optimizer_quant_state__", entry)


def dequant(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor, block: int = 256) -> np.ndarray:
    return F.dequantize_blockwise(codes, absmax=absmax, code=qmap, blocksize=block).numpy()


MEANING = {  # bnb state → the torch-style slot it holds, per optimizer
    "adam": ("exp_avg", "exp_avg_sq"), "lion": ("momentum",), "momentum": ("momentum_buffer",),
    "rmsprop": ("square_avg",), "adagrad": ("sum",), "ademamix": ("exp_avg", "exp_avg_sq"),
}


def references(sd: dict, kind: str, block: int = 256) -> dict[str, np.ndarray]:
    """The fp32 moments of every parameter, by bitsandbytes' own dequantize_blockwise."""
    out = {}
    for idx, entry in sd["state"].items():
        q = quant_state(entry)
        for k, slot in enumerate(MEANING[kind], start=1):
            s = q[f"state{k}"]
            if s.dtype != torch.uint8:
                continue  # a 32-bit state: the file's own tensor is the value
            if kind == "ademamix" and k == 1:
                out[f"{idx}.exp_avg"] = dequant(s[0], q["absmax1"][0], q["qmap1"], block)
                out[f"{idx}.exp_avg_slow"] = dequant(s[1], q["absmax1"][1], q["qmap1"], block)
            else:
                out[f"{idx}.{slot}"] = dequant(s, q[f"absmax{k}"], q[f"qmap{k}"], block)
    return out


def next_step(opt, ps: list[torch.nn.Parameter]) -> dict[str, np.ndarray]:
    """``<id>.param`` (after the saved steps), ``<id>.grad`` and ``<id>.param_next`` (after one
    more step of ``opt``, the optimizer itself)."""
    g = torch.Generator().manual_seed(2)
    out = {}
    for i, p in enumerate(ps):
        p.grad = torch.randn(p.shape, generator=g) * 0.05
        if i in KEEP_NEXT:
            out[f"{i}.param"], out[f"{i}.grad"] = p.detach().clone().numpy(), p.grad.clone().numpy()
    opt.step()
    for i in KEEP_NEXT:
        out[f"{i}.param_next"] = ps[i].detach().clone().numpy()
    return out


KEEP_NEXT = (1, 2)  # b1 (32-bit state) and w2 (8-bit): enough to see the arithmetic, small to commit


def tag_paged(sd: dict) -> dict:
    """What F.get_paged leaves on a paged buffer: ``is_paged`` and ``page_deviceid`` attributes."""
    sd = copy.deepcopy(sd)
    for entry in sd["state"].values():
        q = quant_state(entry)
        for k in ("state1", "state2"):
            if k in q:
                q[k].is_paged = True
                q[k].page_deviceid = 0
    return sd


def save(name: str, sd: dict, refs: dict[str, np.ndarray] | None = None) -> None:
    torch.save(sd, OUT / f"{name}.pt")
    if refs:  # compressed: codes and moments of a few thousand elements each
        np.savez_compressed(OUT / f"{name}.ref.npz", **refs)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    optimizers = {
        "adamw8bit": (bnb.optim.AdamW8bit, dict(lr=1e-2, weight_decay=1e-2), "adam"),
        "adam8bit": (bnb.optim.Adam8bit, dict(lr=1e-2), "adam"),
        "paged_adamw8bit": (bnb.optim.PagedAdamW8bit, dict(lr=1e-2, weight_decay=1e-2), "adam"),
        "adamw32bit": (bnb.optim.AdamW32bit, dict(lr=1e-2, weight_decay=1e-2), "adam"),
        "paged_adamw32bit": (bnb.optim.PagedAdamW32bit, dict(lr=1e-2, weight_decay=1e-2), "adam"),
        "lion8bit": (bnb.optim.Lion8bit, dict(lr=1e-3, weight_decay=1e-2), "lion"),
        "ademamix8bit": (bnb.optim.AdEMAMix8bit, dict(lr=1e-2), "ademamix"),
        "rmsprop8bit": (bnb.optim.RMSprop8bit, dict(lr=1e-2), "rmsprop"),
        "adagrad8bit": (bnb.optim.Adagrad8bit, dict(lr=1e-2), "adagrad"),
        "sgd8bit": (bnb.optim.SGD8bit, dict(lr=1e-2, momentum=0.9), "momentum"),
        # one-state param groups several bitsandbytes optimizers store alike (bitsandbytes keeps no name):
        # SGD's dampening sits where Lion's beta2 does, an RMSprop with eps 0 packs like SGD or Lion
        "sgd8bit-dampening": (bnb.optim.SGD8bit, dict(lr=1e-2, momentum=0.9, dampening=0.5), "momentum"),
        "rmsprop8bit-eps0": (bnb.optim.RMSprop8bit, dict(lr=1e-2, eps=0.0), "rmsprop"),
        "lion8bit-beta2-0": (bnb.optim.Lion8bit, dict(lr=1e-3, betas=(0.9, 0.0)), "lion"),
        "adagrad8bit-eps0": (bnb.optim.Adagrad8bit, dict(lr=1e-2, eps=0.0), "adagrad"),
        # states statekit must not mistake for Adam or SGD: LAMB/LARS keep the update norm too
        "lamb8bit": (bnb.optim.LAMB8bit, dict(lr=1e-2), None),
        "lars8bit": (bnb.optim.LARS8bit, dict(lr=1e-2, momentum=0.9), None),
    }
    only = set(sys.argv[1:])  # names given: write only those fixtures (the others stay byte for byte)
    if only:
        optimizers = {k: v for k, v in optimizers.items() if k in only}
    written = {}
    for name, (cls, kw, kind) in optimizers.items():
        ps = params()
        opt = train(bnb_opt(cls, **kw), ps)
        sd = opt.state_dict()
        if name.startswith("paged_"):
            sd = tag_paged(sd)
        refs = references(sd, kind) if kind else None
        if name == "sgd8bit-dampening":  # bitsandbytes' own 4th step from here: what continuing it must do
            sd = copy.deepcopy(sd)  # state_dict() holds the live tensors, which the step changes
            refs.update(next_step(opt, ps))
        save(name, sd, refs)
        written[name] = sd
        if name == "adamw8bit":
            flat = torch.optim.Optimizer.state_dict(opt)
            assert "state1" in flat["state"][0]
            save("adamw8bit-flat", flat)
    if only:
        return
    # a NaN planted in one absmax of w1's first moment
    nan = copy.deepcopy(written["adamw8bit"])
    nan["state"][0]["__bnb_optimizer_quant_state__"]["absmax1"][3] = float("nan")
    save("adamw8bit-nan", nan)
    # bitsandbytes <= 0.43: block size 2048, flat, no AdEMAMix keys in the group
    sd32 = written["adamw32bit"]
    old = {"state": {}, "param_groups": [{k: v for k, v in g.items() if k not in ("alpha", "t_alpha", "t_beta3")}
                                         for g in sd32["param_groups"]]}
    refs = {}
    signed, unsigned = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)
    for idx, entry in sd32["state"].items():
        q = quant_state(entry)
        if idx in (1, 3):  # below 4096 elements / the 32-bit override: fp32 as in any 8-bit file
            old["state"][idx] = {"step": entry["step"], "state1": q["state1"].clone(), "state2": q["state2"].clone()}
            continue
        c1, a1 = F.quantize_blockwise(q["state1"], code=signed, blocksize=2048)
        c2, a2 = F.quantize_blockwise(q["state2"], code=unsigned, blocksize=2048)
        old["state"][idx] = {"step": entry["step"], "state1": c1, "qmap1": signed, "state2": c2, "qmap2": unsigned,
                             "absmax1": a1.absmax, "absmax2": a2.absmax}
        for k, (codes, st, qmap) in enumerate(((c1, a1, signed), (c2, a2, unsigned)), start=1):
            m = F.dequantize_blockwise(codes, absmax=st.absmax, code=qmap, blocksize=2048)
            refs[f"{idx}.{('exp_avg', 'exp_avg_sq')[k - 1]}"] = m.numpy()
            c256, s256 = F.quantize_blockwise(m, code=qmap, blocksize=256)
            refs[f"{idx}.state{k}.b256"] = c256.numpy()
            refs[f"{idx}.state{k}.absmax256"] = s256.absmax.numpy()
    save("adamw8bit-b2048", old, refs)
    # torch AdamW, and what bitsandbytes' two quantizers make of its moments
    topt = train(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2), params())
    tsd = topt.state_dict()
    refs = {}
    default_q = _DEFAULT_KERNELS["bitsandbytes::quantize_blockwise"]
    for idx, entry in tsd["state"].items():
        for slot, qmap in (("exp_avg", signed), ("exp_avg_sq", unsigned)):
            x = entry[slot]
            c, st = F.quantize_blockwise(x, code=qmap, blocksize=256)
            refs[f"{idx}.{slot}.cpu"], refs[f"{idx}.{slot}.cpu_absmax"] = c.numpy(), st.absmax.numpy()
            c, a = default_q(x, qmap, 256)
            refs[f"{idx}.{slot}.torch"], refs[f"{idx}.{slot}.torch_absmax"] = c.numpy(), a.numpy()
    refs["qmap.signed"], refs["qmap.unsigned"] = signed.numpy(), unsigned.numpy()
    save("torch-adamw", tsd, refs)
    (OUT / "names.txt").write_text("".join(f"{n}\n" for n in SHAPES))
    (OUT / "versions.json").write_text(json.dumps({"bitsandbytes": bnb.__version__, "torch": torch.__version__,
                                                   "numpy": np.__version__}, indent=2) + "\n")


if __name__ == "__main__":
    main()
