"""Dump the distributed optimizer's bucket layouts as megatron-core itself computes them.

For a fixed grid of cases (parameter sizes, shared-embedding flags, DP size, bucket size, the
pad-for-bus-bandwidth option) this calls megatron-core's own layout code — no process group, no
model, no GPU:

- mcore >= 0.17 (0.19.2 checked): ``DistributedOptimizer._compute_per_buffer_param_layout``, a
  static function of (params, bucket size, DP size, ddp config);
- mcore 0.14: the layout is computed inside ``_ParamAndGradBuffer.__init__``; the buffer is built
  with a stand-in data-parallel group (only ``size()`` is read for the layout) and its one
  log call (``log_on_each_pipeline_stage``, which asserts an initialized process group) made a
  no-op, its storage allocated on the CPU (``torch.cuda.current_device`` answers ``"cpu"``: where
  the bytes live, not where a parameter sits in them); the layout is read from the buffer's ``param_index_map``, ``bucket_indices`` and buckets.

and writes ``fixtures/megatron_layouts/mcore-<version>.json``: per case the inputs and, per
parameter (in registration order), ``(start, end, bucket)``, the buckets' ``(start, end)`` and their
``numel_unpadded``. ``tests/test_megatron_buckets.py`` checks statekit's layout against them.

Run with a venv's interpreter that has megatron-core (statekit never imports it)::

    /work/venvs/mcore-0.19.2/bin/python scripts/make_megatron_layouts.py
    /work/venvs/mcore-0.14/bin/python scripts/make_megatron_layouts.py
"""

from __future__ import annotations

import json
import random
import unittest.mock as mock
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import megatron.core  # noqa: E402
import torch  # noqa: E402
from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig  # noqa: E402


def cases() -> list[dict]:
    rng = random.Random(20261207)
    out = [
        {"sizes": [10, 100, 3], "shared": [False, False, False], "dp": 4, "bucket_size": 100, "busbw": False},
        {"sizes": [50, 10], "shared": [True, False], "dp": 1, "bucket_size": None, "busbw": False},
        {"sizes": [64, 64, 64], "shared": [False, False, True], "dp": 2, "bucket_size": None, "busbw": True},
    ]
    for _ in range(60):
        n = rng.randint(1, 9)
        sizes = [rng.choice([rng.randint(1, 300), rng.randint(1, 5000), 64 * rng.randint(1, 20)]) for _ in range(n)]
        shared = [False] * n
        if rng.random() < 0.3:
            shared[0] = True
        if rng.random() < 0.3:
            shared[-1] = True
        out.append({"sizes": sizes, "shared": shared, "dp": rng.randint(1, 8),
                    "bucket_size": rng.choice([None, rng.randint(1, 3000), rng.randint(100, 20000)]),
                    "busbw": rng.random() < 0.2})
    return out


class _Group:
    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return 0


def layout(case: dict) -> dict:
    params = []
    for numel, shared in zip(case["sizes"], case["shared"], strict=True):
        p = torch.nn.Parameter(torch.empty(numel, dtype=torch.bfloat16))
        if shared:
            p.shared_embedding = True
        params.append(p)
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                        pad_buckets_for_high_nccl_busbw=case["busbw"])
    try:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        compute = DistributedOptimizer._compute_per_buffer_param_layout
    except AttributeError:
        compute = None
    if compute is not None:
        lay = compute(params, case["bucket_size"], case["dp"], cfg)
        index, buckets, unpadded = lay.param_index_map, lay.bucket_indices, lay.per_bucket_numel_unpadded
    else:
        from megatron.core.distributed import param_and_grad_buffer as pgb

        # the buffer's storage is allocated on torch.cuda.current_device(): CPU here (placement only)
        with mock.patch.object(pgb, "log_on_each_pipeline_stage", lambda *a, **k: None), \
                mock.patch("torch.cuda.current_device", lambda: "cpu"):
            buf = pgb._ParamAndGradBuffer(cfg, torch.bfloat16, torch.float32, params, _Group(case["dp"]),
                                          case["bucket_size"], {p: str(i) for i, p in enumerate(params)}, 1.0,
                                          list(range(len(params))), False)
        index, buckets = buf.param_index_map, buf.bucket_indices
        unpadded = [b.numel_unpadded for b in buf.buckets]
    return {**case, "params": [list(index[p]) for p in params], "buckets": [list(b) for b in buckets],
            "numel_unpadded": list(unpadded)}


def main() -> None:
    version = megatron.core.__version__
    out = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_layouts" / f"mcore-{version}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"about": "bucket layouts computed by megatron-core's own code (scripts/make_megatron_layouts.py)",
            "megatron_core_version": version, "torch_version": torch.__version__,
            "cases": [layout(c) for c in cases()]}
    out.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    print(out, len(data["cases"]))


if __name__ == "__main__":
    main()
