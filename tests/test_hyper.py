"""One table of hyperparameter defaults (statekit.hyper) behind convert, replay and candle."""

from __future__ import annotations

import pytest

from statekit import hyper
from statekit.errors import UsageError
from statekit.frameworks import candle
from statekit.optim import registry


@pytest.mark.parametrize("family", sorted(registry.ALGORITHMS))
def test_the_compute_core_reads_the_one_table(family):
    for framework, column in registry.ALGORITHMS[family].frameworks.items():
        assert dict(column.defaults) == hyper.core_defaults(framework, family)
        assert column.fixed == hyper.fixed(framework, family)


def test_burn_defaults_are_burns_own():
    """burn 0.22's configs (burn-formats.md §2.5): eps 1e-5 (not torch's 1e-8), AdamW decay 1e-4,
    RMSProp momentum 0.9, Adan betas 0.98/0.92/0.99, MomentumConfig 0.9 with dampening 0.1."""
    adam, adamw = hyper.core_defaults("burn", "adam"), hyper.core_defaults("burn", "adamw")
    assert (adam["eps"], adam["beta1"], adam["beta2"], adam["weight_decay"]) == (1e-5, 0.9, 0.999, 0.0)
    assert (adamw["weight_decay"], adamw["decoupled_weight_decay"]) == (1e-4, True)
    assert hyper.core_defaults("burn", "rmsprop")["momentum"] == 0.9
    assert hyper.core_defaults("burn", "adagrad")["eps"] == 1e-5
    adan = hyper.core_defaults("burn", "adan")
    assert (adan["beta1"], adan["beta2"], adan["beta3"], adan["eps"]) == (0.98, 0.92, 0.99, 1e-8)
    assert hyper.BURN_MOMENTUM == {"momentum": 0.9, "dampening": 0.1, "nesterov": False}
    # SgdConfig has no momentum unless configured: the core's burn SGD starts without it
    assert hyper.core_defaults("burn", "sgd")["momentum"] == 0.0


def test_burn_has_no_learning_rate_default():
    with pytest.raises(UsageError, match="needs lr"):
        registry.resolve("adam", "burn", {})
    # a conversion assumes torch's default for the family, and says so (plan.assumed)
    assert hyper.conversion_defaults("rmsprop")["lr"] == hyper.TORCH_GROUPS["rmsprop"]["lr"] == 1e-2


@pytest.mark.parametrize("family", ["adam", "adamw", "rmsprop", "adagrad"])
def test_convert_and_replay_assume_the_same_burn_values(family):
    assumed = hyper.split_betas(hyper.conversion_defaults(family))
    core = hyper.core_defaults("burn", family)
    assert {k: v for k, v in assumed.items() if k != "lr"} == {k: core[k] for k in assumed if k != "lr"}


def test_candle_writer_defaults_come_from_the_table():
    assert candle.DEFAULTS == {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 1e-2}
    values, assumed = candle.hyperparams({"betas": (0.8, 0.9), "lr": 0.1})
    assert values["beta1"] == 0.8 and values["beta2"] == 0.9 and assumed == ["eps", "weight_decay"]
