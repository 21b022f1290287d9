"""Megatron-Core's Adam step, as the ``megatron`` replay flavor.

What megatron-core 0.19.2 runs (``megatron/core/optimizer/__init__.py``):

- the optimizer class is TransformerEngine's ``FusedAdam`` when TE imports, else apex's ``FusedAdam``,
  else torch's (``USING_PYTORCH_OPTIMIZER``): ``torch.optim.AdamW`` when ``decoupled_weight_decay``
  (the default, ``--decoupled-weight-decay``), else ``torch.optim.Adam``. Its arguments: ``lr``,
  ``weight_decay``, ``betas=(adam_beta1, adam_beta2)``, ``eps=adam_eps``, ``capturable=
  optimizer_cuda_graph``; a FusedAdam gets ``adam_w_mode=decoupled_weight_decay`` instead of the class
  choice (its ``bias_correction`` keeps FusedAdam's default, True);
- the parameters it steps are the fp32 **masters** (the distributed optimizer's shard of each main
  param, or ``fp32_from_fp16_params``); each param group's ``lr`` and ``weight_decay`` are set by the
  ``OptimizerParamScheduler`` before the step as ``lr × lr_mult`` (of the group's ``max_lr``/``min_lr``
  schedule) and ``wd × wd_mult``: the values a checkpoint's groups hold are the ones the next step uses;
- after the step the master is copied into the model's bf16/fp16 weight, rounded to nearest even
  (``statekit.frameworks.megatron.proof.rounded_bits``, which every read proves against the stored weight).

On a machine without TE and apex (the CPU runs statekit's fixtures come from) the step is torch's
single-tensor ``AdamW`` / ``Adam`` on float32 CPU tensors (``foreach`` defaults to off there): exactly the
``torch`` flavor's arithmetic (:mod:`statekit.optim.adam`), which the ``megatron`` flavor runs. A FusedAdam
run (a GPU with TE or apex) leaves ``adam_w_mode`` / ``bias_correction`` in its param groups
(:func:`fused_adam`); its CUDA kernel (``m/bc1 / (sqrt(v/bc2) + eps)``, another order of roundings) is not
modelled, and such a state is refused rather than replayed in the wrong arithmetic.
"""

from __future__ import annotations

#: the flavor's name (statekit.optim.common.FLAVORS)
MEGATRON = "megatron"
#: the flavor whose arithmetic it runs (megatron-core on CPU: torch.optim.AdamW / Adam, single-tensor)
ARITHMETIC = "torch"
#: the param group keys a TE or apex FusedAdam keeps that torch's Adam does not
FUSED_KEYS = ("adam_w_mode", "bias_correction")


def fused_adam(groups) -> str | None:
    """The FusedAdam key a state's param groups hold (they were stepped by TE/apex FusedAdam), else None."""
    for g in groups:
        hp = getattr(g, "hyperparams", g)
        for key in FUSED_KEYS:
            if key in hp:
                return key
    return None

