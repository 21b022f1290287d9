"""Two more legacy (``--ckpt-format torch``) checkpoints for the bucket layout, written by
megatron-core through the fixture generator's own driver (``scripts/make_megatron_fixtures.py``:
Megatron's argument parser, ``setup_model_and_optimizer``, ``train_step``, ``save_checkpoint``, on
CPU with gloo; its CPU shim ``scripts/mcore_cpu_shim.py`` says what it redirects and why no
layout changes). Only the cases are added here:

- ``legacy_distopt_dp2_2buckets``: DP 2, ``--overlap-grad-reduce --ddp-num-buckets 2`` (bucket
  size = parameters // 2, Megatron's own resolution), untied embeddings;
- ``legacy_distopt_tp2dp2_bucket5000_tied``: TP 2 × DP 2, ``--overlap-grad-reduce
  --ddp-bucket-size 5000`` (several buckets per rank), tied embeddings.

Output: ``fixtures/megatron_buckets/<mcore-version>/<case>/`` and its ``manifest.json``. Run::

    /work/venvs/mcore-0.19.2/bin/python scripts/make_megatron_legacy_buckets.py
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import make_megatron_fixtures as fixtures  # noqa: E402

CASES = {
    "legacy_distopt_dp2_2buckets": (
        1, 1, 1, 2,
        ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer", "--ckpt-format", "torch",
         "--overlap-grad-reduce", "--ddp-num-buckets", "2"],
        [3], "legacy torch format, distributed optimizer, 2 buckets (overlap_grad_reduce, ddp_num_buckets 2)"),
    "legacy_distopt_tp2dp2_bucket5000_tied": (
        2, 1, 1, 2,
        ["--use-distributed-optimizer", "--ckpt-format", "torch", "--overlap-grad-reduce",
         "--ddp-bucket-size", "5000"],
        [3], "legacy torch format, distributed optimizer, TP 2, bucket size 5000 (several buckets), tied embeddings"),
}


def main() -> None:
    fixtures.CASES.update(CASES)
    out = HERE.parent / "fixtures" / "megatron_buckets"
    sys.argv = [sys.argv[0], "--out", str(out), "--port", "29611"] + [a for c in CASES for a in ("--case", c)]
    fixtures.main()


if __name__ == "__main__":
    main()
