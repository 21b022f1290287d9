"""Write ``fixtures/fit/``: the optimizer state of a real run whose trainable set then changes.

    PYTHONPATH=. python scripts/make_fit_fixtures.py     # torch 2.13, CPU

The tiny model of ``tests/fit_runs.py`` (embed 10×8, l1 and l2 Linear 8→8, head Linear 8→10) is
trained 2 steps by torch's AdamW (lr 1e-2) with ``l1`` frozen, over Trainer-like groups built from
``named_parameters()`` (weights with weight_decay 0.1, biases with 0.0; ``param_names`` saved):

- ``frozen-optim.pt``: ``optimizer.state_dict()`` after the 2 steps (l1 has no position);
- ``model.pt``: ``model.state_dict()`` after them (every parameter: the model the next run unfreezes).

``statekit fit fixtures/fit/frozen-optim.pt --model fixtures/fit/model.pt --group decay='*.weight'
--group no_decay='*' -o fitted.pt`` gives the state the unfrozen run's AdamW loads
(tests/test_fit.py runs the whole continuation against the in-memory one).
"""

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import fit_runs  # noqa: E402 - the test suite's model, so that the tests rebuild it

OUT = os.path.join(ROOT, "fixtures", "fit")


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    m = fit_runs.tiny(0)
    m.l1.requires_grad_(False)
    opt = torch.optim.AdamW(fit_runs.decay_groups(m), lr=1e-2)
    fit_runs.steps(m, [opt], 0, 2)
    torch.save(opt.state_dict(), os.path.join(OUT, "frozen-optim.pt"))
    torch.save(m.state_dict(), os.path.join(OUT, "model.pt"))
    print(f"wrote {OUT} with torch {torch.__version__}")


if __name__ == "__main__":
    main()
