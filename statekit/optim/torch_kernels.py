"""torch's own code for a replay step: the ``torch`` kernel (:mod:`statekit.optim.kernels`).

With torch installed, a step of a torch flavor runs torch's own operations on zero-copy views of
the arrays (``torch.from_numpy``), so its bits are torch's by construction, on whatever CPU this
is (torch's square root, reductions and bfloat16 products included):

* ``torch-fused``: the fused kernels ``torch._fused_adam_`` / ``_fused_adamw_`` /
  ``_fused_sgd_`` / ``_fused_adagrad_``;
* ``torch`` (the for-loop, ``foreach=False``): for Adam/AdamW, NAdam, RAdam, Adamax, Adadelta,
  ASGD and Rprop, torch's single-tensor function written out here operation by operation, each
  temporary in a reused buffer (``out=`` or in place) instead of a fresh parameter-sized tensor
  (whose page faults a step pays every time); the same ATen kernels on the same operands in the
  same order, hence the same bits (``tests/test_kernels.py`` checks each against torch's own
  function). SGD, Adagrad, RMSprop, Adafactor and Muon call torch's functional API;
* ``torch-foreach`` (NAdam, RAdam, ASGD, Adafactor): torch's functional API with
  ``foreach=True`` (on CPU tensors each ``_foreach_*`` op is the per-tensor op).

Scalar slots (NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``) travel as torch's 0-dim float32
tensors; :func:`run` returns their new values. The step counter is torch's float32 tensor,
incremented by torch's code as in a training run.

Every buffer is a torch allocation (64-byte aligned, as torch's own temporaries are), one set per
thread, the largest size so far kept.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
import warnings

import numpy as np

TORCH_FUSED, TORCH, TORCH_FOREACH = "torch-fused", "torch", "torch-foreach"

#: (algorithm, flavor) pairs torch's own code runs.
SUPPORTS = frozenset(
    {(a, TORCH_FUSED) for a in ("adam", "adamw", "sgd", "adagrad")}
    | {(a, TORCH) for a in ("adam", "adamw", "sgd", "adagrad", "rmsprop", "nadam", "radam", "adamax", "adadelta",
                            "asgd", "rprop", "adafactor", "muon")}
    | {(a, TORCH_FOREACH) for a in ("nadam", "radam", "asgd", "adafactor")}
)
#: 0-dim slots torch keeps as float32 tensors, and their values in a fresh state (``lr``: f32(lr)).
SCALAR_SLOTS = {"nadam": {"mu_product": 1.0}, "asgd": {"eta": "lr", "mu": 1.0}}


def _torch():
    return importlib.import_module("torch")


def as_torch(torch, b, array):
    """A torch tensor sharing ``array``'s memory (numpy arrays through ``torch.from_numpy``)."""
    if b.name == "torch":
        return array
    with warnings.catch_warnings():
        # read-only gradients (memory-mapped files): no kernel here writes a gradient
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


_scratch = threading.local()


def buffers(torch, like, count: int) -> list:
    """``count`` scratch tensors shaped like ``like``, reused across steps, each thread its own
    (each a separate torch allocation: 64-byte aligned like torch's own temporaries)."""
    held = getattr(_scratch, "held", None)
    if held is None:
        held = _scratch.held = []
    n = like.numel()
    out = []
    for i in range(count):
        if len(held) <= i:
            held.append(None)
        t = held[i]
        if t is None or t.dtype != like.dtype or t.numel() < n:
            held[i] = None  # free the old one first
            held[i] = t = torch.empty(n, dtype=like.dtype)
        out.append(t[:n].view(like.shape))
    return out


def _plain_cpu(p, g) -> bool:
    """A real CPU float tensor: what the written-out single-tensor functions are for."""
    return p.device.type == "cpu" and g.device.type == "cpu" and p.is_floating_point() and not p.is_complex()


def run(algorithm: str, flavor: str, b, p, g, s: dict, step: int, hp, present, scalars: dict | None = None) -> dict:
    """One step with torch's own code, in place on ``p`` and the slots ``s`` (numpy arrays or torch
    tensors; ``s`` holds the full-size slots only). ``step`` is the number of steps already
    taken, ``present`` the slots the caller gave (a missing momentum buffer is SGD's first step),
    ``scalars`` the values of the 0-dim slots the caller gave. Returns the 0-dim slots' new
    values (floats), empty for the algorithms that keep none."""
    torch = _torch()
    tp, tg = as_torch(torch, b, p), as_torch(torch, b, g)
    ts = {name: as_torch(torch, b, value) for name, value in s.items()}
    device = tp.device
    if flavor == TORCH_FUSED:
        _fused(torch, algorithm, tp, tg, ts, step, hp, present)
        return {}
    # torch keeps the step count on the CPU (not capturable), ASGD's eta and mu on the
    # parameter's device, NAdam's mu_product on the CPU
    steps = [torch.tensor(float(np.float32(step)), dtype=torch.float32)]
    if algorithm in ("adam", "adamw", "sgd", "adagrad", "rmsprop"):
        _first_kernels(torch, algorithm, tp, tg, ts, step, steps, hp, present)
        return {}
    zero_dim = {}
    for name, fresh in SCALAR_SLOTS.get(algorithm, {}).items():
        value = (scalars or {}).get(name)
        if value is None:
            value = float(np.float32(hp["lr"])) if fresh == "lr" else fresh
        zero_dim[name] = torch.tensor(value, dtype=torch.float32, device=device if algorithm == "asgd" else "cpu")
    foreach = flavor == TORCH_FOREACH
    written = WRITTEN_OUT.get(algorithm)
    # a written-out function may decline (False, nothing done): torch's own function then runs
    if not foreach and written is not None and _plain_cpu(tp, tg) \
            and written(torch, tp, tg, ts, zero_dim, float(np.float32(step + 1)), hp) is not False:
        pass
    else:
        FUNCTIONAL[algorithm](torch, tp, tg, ts, zero_dim, steps, hp, foreach)
    return {name: float(value.item()) for name, value in zero_dim.items()}


# ------------------------------------------------------------------------------- Adam, SGD, Adagrad, RMSprop


def _fused(torch, algorithm, tp, tg, ts, step, hp, present) -> None:
    # torch's Python wrappers add 1 to the steps before calling the fused kernels
    steps = [torch.tensor(float(step + 1), dtype=torch.float32, device=tp.device)]
    if algorithm in ("adam", "adamw"):
        vmax = [ts["max_exp_avg_sq"]] if hp["amsgrad"] else []
        func = torch._fused_adamw_ if hp["decoupled_weight_decay"] else torch._fused_adam_
        func([tp], [tg], [ts["exp_avg"]], [ts["exp_avg_sq"]], vmax, steps, lr=hp["lr"], beta1=hp["beta1"],
             beta2=hp["beta2"], weight_decay=hp["weight_decay"], eps=hp["eps"], amsgrad=hp["amsgrad"],
             maximize=hp["maximize"])
    elif algorithm == "sgd":
        momentum = hp["momentum"]
        bufs = [ts["momentum_buffer"]] if momentum != 0 else []
        torch._fused_sgd_([tp], [tg], bufs, is_first_step="momentum_buffer" not in present and momentum != 0,
                          weight_decay=hp["weight_decay"], momentum=momentum, lr=hp["lr"], dampening=hp["dampening"],
                          nesterov=hp["nesterov"], maximize=hp["maximize"])
    else:
        torch._fused_adagrad_([tp], [tg], [ts["sum"]], steps, lr=hp["lr"], lr_decay=hp["lr_decay"],
                              weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=hp["maximize"])


def _first_kernels(torch, algorithm, tp, tg, ts, step, steps, hp, present) -> None:
    """torch's for-loop Adam/AdamW, SGD, Adagrad and RMSprop."""
    if algorithm in ("adam", "adamw"):
        vmax = [ts["max_exp_avg_sq"]] if hp["amsgrad"] else []
        common = dict(lr=hp["lr"], beta1=hp["beta1"], beta2=hp["beta2"], weight_decay=hp["weight_decay"],
                      eps=hp["eps"], amsgrad=hp["amsgrad"], maximize=hp["maximize"])
        if _plain_cpu(tp, tg):
            single_tensor_adam(torch, tp, tg, ts["exp_avg"], ts["exp_avg_sq"], vmax, step + 1,
                               decoupled_weight_decay=hp["decoupled_weight_decay"], **common)
        else:
            from torch.optim.adam import adam

            adam([tp], [tg], [ts["exp_avg"]], [ts["exp_avg_sq"]], vmax, steps, foreach=False, fused=None,
                 decoupled_weight_decay=hp["decoupled_weight_decay"], **common)
    elif algorithm == "sgd":
        from torch.optim.sgd import sgd

        momentum = hp["momentum"]
        first = "momentum_buffer" not in present
        listed = [None] if first or momentum == 0 else [ts["momentum_buffer"]]
        sgd([tp], [tg], listed, foreach=False, fused=None, weight_decay=hp["weight_decay"], momentum=momentum,
            lr=hp["lr"], dampening=hp["dampening"], nesterov=hp["nesterov"], maximize=hp["maximize"])
        if momentum != 0 and first:
            ts["momentum_buffer"].copy_(listed[0])
    elif algorithm == "adagrad":
        from torch.optim.adagrad import adagrad

        adagrad([tp], [tg], [ts["sum"]], steps, foreach=False, fused=None, lr=hp["lr"], lr_decay=hp["lr_decay"],
                weight_decay=hp["weight_decay"], eps=hp["eps"], maximize=hp["maximize"])
    else:
        from torch.optim.rmsprop import rmsprop

        rmsprop([tp], [tg], [ts["square_avg"]], [ts["grad_avg"]] if hp["centered"] else [],
                [ts["momentum_buffer"]] if hp["momentum"] > 0 else [], steps, foreach=False,
                maximize=hp["maximize"], lr=hp["lr"], alpha=hp["alpha"], eps=hp["eps"],
                weight_decay=hp["weight_decay"], momentum=hp["momentum"], centered=hp["centered"])


def single_tensor_adam(torch, param, grad, exp_avg, exp_avg_sq, vmax: list, step: int, *, lr, beta1, beta2,
                       weight_decay, eps, amsgrad, maximize, decoupled_weight_decay) -> None:
    """``torch.optim.adam._single_tensor_adam`` (not capturable, not differentiable), written
    out; ``step`` counts this one."""
    g_buf, d_buf = buffers(torch, param, 2)
    if maximize:
        grad = torch.neg(grad, out=g_buf)
    if weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = torch.add(grad, param, alpha=weight_decay, out=g_buf)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = float(step)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if amsgrad:
        torch.maximum(vmax[0], exp_avg_sq, out=vmax[0])
        denom = torch.sqrt(vmax[0], out=d_buf)
    else:
        denom = torch.sqrt(exp_avg_sq, out=d_buf)
    denom.div_(bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


# ------------------------------------------------------------------- torch 2.13's other for-loops, written out
# Each is torch/optim/<name>.py's _single_tensor_<name> for one real CPU tensor, not capturable,
# not differentiable; ``t`` is the float value of torch's step tensor after its increment.


def _grad(torch, tg, tp, buf, hp, wd_key="weight_decay"):
    """``grad`` (negated when maximizing) with L2 decay ``grad.add(param, alpha=wd)``."""
    grad = torch.neg(tg, out=buf) if hp["maximize"] else tg
    wd = hp[wd_key]
    if wd != 0:
        grad = torch.add(grad, tp, alpha=wd, out=buf)
    return grad


def _nadam(torch, tp, tg, ts, zero_dim, t, hp) -> None:
    beta1, beta2, lr, wd = hp["beta1"], hp["beta2"], hp["lr"], hp["weight_decay"]
    psi, eps = hp["momentum_decay"], hp["eps"]
    g_buf, d_buf = buffers(torch, tp, 2)
    grad = torch.neg(tg, out=g_buf) if hp["maximize"] else tg
    mu_product, exp_avg, exp_avg_sq = zero_dim["mu_product"], ts["exp_avg"], ts["exp_avg_sq"]
    bias_correction2 = 1 - beta2**t
    if wd != 0:
        if hp["decoupled_weight_decay"]:
            tp.mul_(1 - lr * wd)
        else:
            grad = torch.add(grad, tp, alpha=wd, out=g_buf)
    mu = beta1 * (1.0 - 0.5 * (0.96 ** (t * psi)))
    mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * psi)))
    mu_product *= mu
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = torch.div(exp_avg_sq, bias_correction2, out=d_buf).sqrt_()
    mu_product_next = mu_product.item() * mu_next
    denom.add_(eps)
    tp.addcdiv_(grad, denom, value=(-lr * (1.0 - mu) / (1.0 - mu_product.item())))
    tp.addcdiv_(exp_avg, denom, value=(-lr * mu_next) / (1.0 - mu_product_next))


def _radam(torch, tp, tg, ts, zero_dim, t, hp) -> None:
    beta1, beta2, lr, wd = hp["beta1"], hp["beta2"], hp["lr"], hp["weight_decay"]
    g_buf, a_buf, d_buf = buffers(torch, tp, 3)
    grad = torch.neg(tg, out=g_buf) if hp["maximize"] else tg
    exp_avg, exp_avg_sq = ts["exp_avg"], ts["exp_avg_sq"]
    if wd != 0:
        if hp["decoupled_weight_decay"]:
            tp.mul_(1 - lr * wd)
        else:
            grad = torch.add(grad, tp, alpha=wd, out=g_buf)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    # bias_corrected_exp_avg * lr, the first product torch forms
    update = torch.div(exp_avg, bias_correction1, out=a_buf).mul_(lr)
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * t * (beta2**t) / bias_correction2
    if rho_t > 5.0:
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
        # _compute_adaptive_lr: (bias_correction2**0.5) / (sqrt(v) + eps), a number divided by a
        # tensor being torch's reciprocal() * number
        adaptive = torch.sqrt(exp_avg_sq, out=d_buf).add_(hp["eps"]).reciprocal_().mul_(bias_correction2**0.5)
        update.mul_(adaptive).mul_(rect)
    tp.add_(update, alpha=-1.0)


def _adamax(torch, tp, tg, ts, zero_dim, t, hp) -> None:
    beta1 = hp["beta1"]
    g_buf, a_buf = buffers(torch, tp, 2)
    grad = _grad(torch, tg, tp, g_buf, hp)
    exp_avg, exp_inf = ts["exp_avg"], ts["exp_inf"]
    exp_avg.lerp_(grad, 1 - beta1)
    torch.maximum(exp_inf.mul_(hp["beta2"]), torch.abs(grad, out=a_buf).add_(hp["eps"]), out=exp_inf)
    clr = hp["lr"] / (1 - beta1**t)
    tp.addcdiv_(exp_avg, exp_inf, value=-clr)


def _adadelta(torch, tp, tg, ts, zero_dim, t, hp) -> None:
    rho, eps = hp["rho"], hp["eps"]
    g_buf, std_buf, delta_buf = buffers(torch, tp, 3)
    grad = _grad(torch, tg, tp, g_buf, hp)
    square_avg, acc_delta = ts["square_avg"], ts["acc_delta"]
    square_avg.mul_(rho).addcmul_(grad, grad, value=1 - rho)
    std = torch.add(square_avg, eps, out=std_buf).sqrt_()
    delta = torch.add(acc_delta, eps, out=delta_buf).sqrt_()
    delta.div_(std).mul_(grad)
    acc_delta.mul_(rho).addcmul_(delta, delta, value=1 - rho)
    tp.add_(delta, alpha=-hp["lr"])


def _asgd(torch, tp, tg, ts, zero_dim, t, hp) -> None:
    lr, lambd, alpha, t0 = hp["lr"], hp["lambd"], hp["alpha"], hp["t0"]
    g_buf, a_buf = buffers(torch, tp, 2)
    grad = _grad(torch, tg, tp, g_buf, hp)
    eta, mu, ax = zero_dim["eta"], zero_dim["mu"], ts["ax"]
    eta_value = eta.item()
    tp.mul_(1 - lambd * eta_value)
    tp.add_(grad, alpha=-eta_value)
    if mu.item() != 1:
        ax.add_(torch.sub(tp, ax, out=a_buf).mul_(mu))
    else:
        ax.copy_(tp)
    eta.copy_(torch.as_tensor(lr / ((1 + lambd * lr * t) ** alpha)))
    mu.copy_(torch.as_tensor(1 / max(1, t - t0)))


def _rprop(torch, tp, tg, ts, zero_dim, t, hp) -> None:
    (etaminus, etaplus), (step_size_min, step_size_max) = hp["etas"], hp["step_sizes"]
    g_buf, sign_buf = buffers(torch, tp, 2)
    mask = buffers_bool(torch, tp)
    grad = torch.neg(tg, out=g_buf) if hp["maximize"] else tg
    prev, step_size = ts["prev"], ts["step_size"]
    sign = torch.mul(grad, prev, out=sign_buf).sign_()
    # sign[sign.gt(0)] = etaplus; sign[sign.lt(0)] = etaminus; sign[sign.eq(0)] = 1
    sign.masked_fill_(torch.gt(sign, 0, out=mask), etaplus)
    sign.masked_fill_(torch.lt(sign, 0, out=mask), etaminus)
    sign.masked_fill_(torch.eq(sign, 0, out=mask), 1)
    step_size.mul_(sign).clamp_(step_size_min, step_size_max)
    # grad = grad.clone(); grad[sign.eq(etaminus)] = 0
    torch.eq(sign, etaminus, out=mask)
    if grad is not g_buf:
        grad = g_buf.copy_(grad)
    grad.masked_fill_(mask, 0)
    tp.addcmul_(torch.sign(grad, out=sign_buf), step_size, value=-1)
    prev.copy_(grad)


def buffers_bool(torch, like):
    """A reused bool buffer shaped like ``like`` (this thread's)."""
    held = getattr(_scratch, "mask", None)
    n = like.numel()
    if held is None or held.numel() < n:
        _scratch.mask = None
        _scratch.mask = held = torch.empty(n, dtype=torch.bool)
    return held[:n].view(like.shape)


# ---------------------------------------------------------------------------------------- Adafactor
# torch's for-loop spends most of a matrix's step in one reduction: ``torch.norm(grad, dim=-2)``
# (the column norms), which ATen runs serially per column down the rows (NormTwoOps), a strided
# walk; then it fills a fresh parameter-sized ``row_var @ col_var`` and makes four more passes
# over it. With numba (statekit[fast]) the column norms are one streaming pass in that very
# order (statekit.optim.numba_adafactor.torch_col_norms) and the update one fused pass into a
# reused buffer (``_matrix_update``: (row_var·col_var)/mean, clamp, 1/√ then ·grad, torch's
# IEEE operations on CPU); torch still takes the norms of the parameter, of the rows and of the
# update, the lerps and the step itself. Those two computations are torch's order read from its
# source, not torch's code: the first time in a process they are checked against torch's own
# for-loop on probe matrices, bit for bit (``_adafactor_fast_ok``); where any bit differs (another
# build of torch, another CPU path) torch's own function runs, as it does without numba.

_ADAFACTOR_FAST: list = []  # [bool] once checked in this process
_ADAFACTOR_LOCK = threading.Lock()


def _adafactor_fast_ok(torch) -> bool:
    if _ADAFACTOR_FAST:
        return _ADAFACTOR_FAST[0]
    with _ADAFACTOR_LOCK:
        if not _ADAFACTOR_FAST:
            _ADAFACTOR_FAST.append(_adafactor_probe(torch))
    return _ADAFACTOR_FAST[0]


def _adafactor_probe(torch) -> bool:
    """Whether the fast matrix step gives torch's own for-loop's bits here: 3 steps on matrices
    of odd shapes (one batched), gradients from 1e-3 to 10 with exact zeros, two settings."""
    if importlib.util.find_spec("numba") is None:
        return False
    try:
        importlib.import_module("statekit.optim.numba_adafactor")
    except Exception:  # noqa: BLE001 - a numba that cannot compile here: torch's own code runs
        return False
    from torch.optim._adafactor import adafactor

    rng = np.random.default_rng(38)
    settings = ({"lr": 1e-2, "beta2_decay": -0.8, "d": 1.0, "weight_decay": 0.0, "eps": (None, 1e-3), "maximize": False},
                {"lr": 5e-2, "beta2_decay": -0.5, "d": 0.5, "weight_decay": 0.1, "eps": (1e-3, 1e-3), "maximize": True})
    for shape in ((37, 53), (3, 17, 9), (130, 300)):
        for hp in settings:
            p0 = rng.standard_normal(shape, dtype=np.float32)
            ours, theirs = torch.from_numpy(p0.copy()), torch.from_numpy(p0.copy())
            rows = [torch.zeros(shape[:-1] + (1,)) for _ in range(2)]
            cols = [torch.zeros(shape[:-2] + (1, shape[-1])) for _ in range(2)]
            step_t = torch.tensor(0.0)
            for k in range(3):
                g = rng.standard_normal(shape, dtype=np.float32) * np.float32(10 ** rng.uniform(-3, 1))
                g[rng.random(shape) < 0.02] = 0
                tg = torch.from_numpy(g)
                adafactor([theirs], [tg], [rows[1]], [cols[1]], [None], [step_t], foreach=False, d=hp["d"],
                          lr=hp["lr"], beta2_decay=hp["beta2_decay"], weight_decay=hp["weight_decay"],
                          eps1=hp["eps"][0], eps2=hp["eps"][1], maximize=hp["maximize"])
                _adafactor_matrix(torch, ours, tg, rows[0], cols[0], float(np.float32(k + 1)), hp)
                for a, b in ((ours, theirs), (rows[0], rows[1]), (cols[0], cols[1])):
                    if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                        return False
    return True


def _adafactor(torch, tp, tg, ts, zero_dim, t, hp):
    """torch's ``_single_tensor_adafactor`` for one float32 matrix (or batch of them), with the
    column norms and the update computed as above; False (nothing done) where that path does not
    apply: a vector, another dtype, memory that is not C-contiguous, no numba, or the probe found
    other bits."""
    if tp.dim() < 2 or tp.dtype != torch.float32 or tg.dtype != torch.float32 or not tp.is_contiguous() \
            or not tg.is_contiguous() or tp.requires_grad or tg.requires_grad:
        return False
    if not all(v.dtype == torch.float32 and v.is_contiguous() for v in (ts["row_var"], ts["col_var"])):
        return False
    if not _adafactor_fast_ok(torch):
        return False
    _adafactor_matrix(torch, tp, tg, ts["row_var"], ts["col_var"], t, hp)
    return None


def _adafactor_matrix(torch, tp, tg, row_var, col_var, t, hp) -> None:
    """One step of ``_single_tensor_adafactor`` (torch/optim/_adafactor.py) on a float32
    C-contiguous matrix or batch; ``t`` is the float value of the step tensor after its increment."""
    nf = importlib.import_module("statekit.optim.numba_adafactor")
    lr, wd, d = hp["lr"], hp["weight_decay"], hp["d"]
    eps1, eps2 = hp["eps"]
    if eps1 is None:
        eps1 = torch.finfo(tp.dtype).eps
    one_minus_beta2_t = t ** hp["beta2_decay"]
    rho_t = min(lr, 1 / (t**0.5))
    alpha = max(eps2, tp.norm(2).item() / (tp.numel() ** 0.5)) * rho_t
    if wd != 0:
        tp.mul_(1 - lr * wd)
    m, n = tg.shape[-1], tg.shape[-2]
    # the norms of -grad are those of grad (the squares are equal): the sign is taken in the update
    row_mean = torch.norm(tg, dim=-1, keepdim=True).square_().div_(m)
    row_var.lerp_(row_mean, one_minus_beta2_t)
    g3 = tg.detach().numpy().reshape(-1, n, m)
    col_norm = torch.empty(col_var.shape, dtype=torch.float32)
    nf.torch_col_norms(g3, col_norm.numpy().reshape(-1, m))
    col_var.lerp_(col_norm.square_().div_(n), one_minus_beta2_t)
    denom = row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1)
    (update,) = buffers(torch, tp, 1)
    nf._matrix_update(g3, row_var.numpy().reshape(-1, n), col_var.numpy().reshape(-1, m),
                      denom.numpy().reshape(-1), np.float32(eps1 * eps1), np.float32(1.0), bool(hp["maximize"]),
                      update.numpy().reshape(-1, n, m))
    clip = max(1.0, update.norm(2).item() / ((update.numel() ** 0.5) * d))
    tp.add_(update, alpha=-alpha / clip)


WRITTEN_OUT = {"nadam": _nadam, "radam": _radam, "adamax": _adamax, "adadelta": _adadelta, "asgd": _asgd,
               "rprop": _rprop, "adafactor": _adafactor}


# ---------------------------------------------------------------------------------- torch's functional API


def _functional_nadam(torch, tp, tg, ts, zero_dim, steps, hp, foreach):
    from torch.optim.nadam import nadam

    nadam([tp], [tg], [ts["exp_avg"]], [ts["exp_avg_sq"]], [zero_dim["mu_product"]], steps,
          decoupled_weight_decay=hp["decoupled_weight_decay"], foreach=foreach, maximize=hp["maximize"],
          beta1=hp["beta1"], beta2=hp["beta2"], lr=hp["lr"], weight_decay=hp["weight_decay"],
          momentum_decay=hp["momentum_decay"], eps=hp["eps"])


def _functional_radam(torch, tp, tg, ts, zero_dim, steps, hp, foreach):
    from torch.optim.radam import radam

    radam([tp], [tg], [ts["exp_avg"]], [ts["exp_avg_sq"]], steps, decoupled_weight_decay=hp["decoupled_weight_decay"],
          foreach=foreach, maximize=hp["maximize"], beta1=hp["beta1"], beta2=hp["beta2"], lr=hp["lr"],
          weight_decay=hp["weight_decay"], eps=hp["eps"])


def _functional_adamax(torch, tp, tg, ts, zero_dim, steps, hp, foreach):
    from torch.optim.adamax import adamax

    adamax([tp], [tg], [ts["exp_avg"]], [ts["exp_inf"]], steps, foreach=foreach, maximize=hp["maximize"],
           eps=hp["eps"], beta1=hp["beta1"], beta2=hp["beta2"], lr=hp["lr"], weight_decay=hp["weight_decay"])


def _functional_adadelta(torch, tp, tg, ts, zero_dim, steps, hp, foreach):
    from torch.optim.adadelta import adadelta

    adadelta([tp], [tg], [ts["square_avg"]], [ts["acc_delta"]], steps, foreach=foreach, lr=hp["lr"], rho=hp["rho"],
             eps=hp["eps"], weight_decay=hp["weight_decay"], maximize=hp["maximize"])


def _functional_asgd(torch, tp, tg, ts, zero_dim, steps, hp, foreach):
    from torch.optim.asgd import asgd

    asgd([tp], [tg], [ts["ax"]], [zero_dim["mu"]], [zero_dim["eta"]], steps, foreach=foreach,
         maximize=hp["maximize"], lambd=hp["lambd"], lr=hp["lr"], t0=hp["t0"], alpha=hp["alpha"],
         weight_decay=hp["weight_decay"])


def _functional_rprop(torch, tp, tg, ts, zero_dim, steps, hp, foreach):
    from torch.optim.rprop import rprop

    (etaminus, etaplus), (smin, smax) = hp["etas"], hp["step_sizes"]
    rprop([tp], [tg], [ts["prev"]], [ts["step_size"]], steps, foreach=foreach, maximize=hp["maximize"],
          step_size_min=smin, step_size_max=smax, etaminus=etaminus, etaplus=etaplus)


def _functional_adafactor(torch, tp, tg, ts, zero_dim, steps, hp, foreach):
    from torch.optim._adafactor import adafactor

    eps1, eps2 = hp["eps"]
    matrix = tp.dim() > 1
    adafactor([tp], [tg], [ts["row_var"] if matrix else None], [ts["col_var"] if matrix else None],
              [None if matrix else ts["variance"]], steps, foreach=foreach, d=hp["d"], lr=hp["lr"],
              beta2_decay=hp["beta2_decay"], weight_decay=hp["weight_decay"], eps1=eps1, eps2=eps2,
              maximize=hp["maximize"])


def _functional_muon(torch, tp, tg, ts, zero_dim, steps, hp, foreach):
    from torch.optim._muon import muon

    muon([tp], [tg], [ts["momentum_buffer"]], lr=hp["lr"], weight_decay=hp["weight_decay"], momentum=hp["momentum"],
         nesterov=hp["nesterov"], ns_coefficients=tuple(hp["ns_coefficients"]), ns_steps=int(hp["ns_steps"]),
         eps=hp["eps"], adjust_lr_fn=hp["adjust_lr_fn"], has_complex=False)


FUNCTIONAL = {"nadam": _functional_nadam, "radam": _functional_radam, "adamax": _functional_adamax,
              "adadelta": _functional_adadelta, "asgd": _functional_asgd, "rprop": _functional_rprop,
              "adafactor": _functional_adafactor, "muon": _functional_muon}
