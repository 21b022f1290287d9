"""megatron-core 0.19.2's own load of a statekit conversion of the 0.7.0 fully_sharded_bucket_space fixture.

scripts/check_megatron_load.py with one case added: the 0.7 fixture's model in 0.19's arguments
(LayerNorm and FFN 96 as the 0.7 run; its lr / min-lr so that the param groups' keys match;
``--override-opt_param-scheduler`` because the 0.7 run's horizon, 3 iterations, is not the
driver's 8: the scheduler then comes from the command line, the tensors from the checkpoint).
There is no run A (0.19 does not load the 0.7 source itself): ``--no-reference``. The script
looks the source up under ``<fixtures>/0.19.2/<name>``, so point ``--fixtures`` at a folder with
that symlink::

    PYTHONPATH=$PWD python -m statekit convert fixtures/megatron/0.7.0/torch_dist-fsbs-tp1-dp2 /tmp/cv07 --to megatron
    mkdir -p /tmp/lc07fx/0.19.2 && ln -s $PWD/fixtures/megatron/0.7.0/torch_dist-fsbs-tp1-dp2 /tmp/lc07fx/0.19.2/
    /work/venvs/mcore-0.19.2/bin/python scripts/check_megatron_load_07.py --source torch_dist-fsbs-tp1-dp2 \
        --fixtures /tmp/lc07fx --written /tmp/cv07 --tp 1 --no-reference \
        --result fixtures/megatron/0.7.0/load_checks/fsbs_tp1dp2_to_fully_reshardable_same_sizes.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_megatron_load as c  # noqa: E402

c.gen.CASES["torch_dist-fsbs-tp1-dp2"] = (
    1, 1, 1, 2, ["--untie-embeddings-and-output-weights", "--use-distributed-optimizer", "--ckpt-format",
                 "torch_dist", "--normalization", "LayerNorm", "--ffn-hidden-size", "96", "--lr", "1e-3",
                 "--min-lr", "1e-4", "--override-opt_param-scheduler"], [3], "0.7.0 fully_sharded_bucket_space")

if __name__ == "__main__":
    c.main()
