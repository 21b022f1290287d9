"""Write megatron-core 0.7.0 torch_dist checkpoints with the real program, on CPU.

``fully_sharded_bucket_space`` (the distributed optimizer's torch_dist sharding of mcore 0.6-0.7,
chosen by ``--ckpt-fully-parallel-save``) and, for a cross-check, ``dp_zero_gather_scatter`` (the
same run without it) are written by Megatron-LM's own ``pretrain_gpt.py`` at tag ``core_v0.7.0``:
its argument parser, model builder, distributed optimizer, training loop and ``save_checkpoint``,
in 2 gloo processes, a few real steps on a tiny GPT. The fixtures go to
``fixtures/megatron/0.7.0/<case>/`` with ``fixtures/megatron/0.7.0/manifest.json``.

    python scripts/make_megatron_07_fixtures.py --mlm-src /work/venvs/src/Megatron-LM-core_v0.7.0 \
        [--out fixtures/megatron] [--case NAME ...]

Run it with the python of a venv holding ``torch==2.13.0`` (CPU), ``numpy<2``, ``packaging``,
``einops`` and the ``megatron-core==0.7.0`` wheel (``pip install --no-deps``). The source tree is
``git archive core_v0.7.0 megatron pretrain_gpt.py`` of NVIDIA/Megatron-LM with its
``megatron/core`` removed (the wheel supplies it).

The device shim is :func:`make_megatron_old_fixtures.install_cpu_shim` (device placement, streams,
the CUDA RNG: see that module's docstring). mcore 0.7 also *imports* Apex and Transformer Engine
unconditionally, neither of which exists for a CPU; :func:`install_07_stubs` puts stand-ins in
their place before Megatron is imported. Each computes what the CUDA kernel it replaces computes,
and none creates, orders, names or shapes a parameter or a buffer:

* ``apex.optimizers.FusedAdam``: Apex's Adam with its defaults (``adam_w_mode=True``: decoupled
  weight decay, bias correction), written in torch. Like Apex (and unlike torch's Adam) it keeps
  ``step`` in the param group and only ``exp_avg`` / ``exp_avg_sq`` per parameter, which is what
  0.7's distributed optimizer saves (``get_parameter_state_fs_bucket_space`` stores every
  per-parameter state as a bucket range and asserts each is 1-D). ``FusedSGD`` is torch's SGD
  (unused: the runs use Adam).
* ``apex.multi_tensor_apply.multi_tensor_applier`` with ``amp_C.multi_tensor_scale`` /
  ``multi_tensor_l2norm``: the fused copy-and-scale and the gradient norm, as loops over the
  tensor lists.
* ``apex.normalization.fused_layer_norm.FusedLayerNormAffineFunction``: ``F.layer_norm``. The
  module using it is Megatron's own ``FusedLayerNorm`` (its ``weight`` and ``bias`` registered by
  Megatron's code); 0.7's local spec has no RMSNorm, so these runs use LayerNorm.
* (torch, not a kernel) 0.7's save planner adds the ShardedObjects to a non-coordinator rank's
  plan, which torch 2.13's default plan already holds: :func:`_once_per_plan` adds each once;
  and its file writer calls torch 2.3's ``_write_item`` signature (:func:`_old_write_item`, which
  also copies a view into a tensor of its own, as the writer's device-to-host copy does on a GPU).
* ``megatron.core.transformer.custom_layers.transformer_engine`` (Megatron's TE wrappers, which
  import TE at module level): a module with the same names. The local spec never builds a TE
  class; the one TE module a local-spec model holds is the final norm (``TransformerBlock`` builds
  ``TENorm`` whatever the spec), a ``te.pytorch.LayerNorm`` registering ``weight`` then ``bias``
  of the hidden size: the stand-in builds Megatron's ``FusedLayerNorm``, which registers the same
  two parameters in the same order. ``SplitAlongDim`` and ``get_cpu_offload_context`` are
  ``None``, as Megatron's own module sets them when TE lacks them.

Everything else (parallel layout, buckets and their padding, sharding types, the dist-checkpoint
files) is megatron-core 0.7.0's own code, unchanged.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import shutil
import subprocess
import sys
import types
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("make_megatron_old_fixtures", _HERE / "make_megatron_old_fixtures.py")
old = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(old)

VERSION = "0.7.0"
# the 0.14 fixtures' tiny GPT, with LayerNorm (0.7's local spec has no RMSNorm)
MODEL = [("LayerNorm" if a == "RMSNorm" else a) for a in old.MODEL]
TRAIN = [*old.TRAIN, "--use-mcore-models"]
BUCKET = 40000  # the model has 76416 parameters: two buckets with --overlap-grad-reduce


def _case(dp=2, tp=1, fully_parallel=True, buckets=1, bucket_size=BUCKET, note=""):
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", "1",
            "--num-layers", "2", "--global-batch-size", str(2 * dp), "--untie-embeddings-and-output-weights",
            "--use-distributed-optimizer", "--use-dist-ckpt", "--dist-ckpt-format", "torch_dist"]
    if fully_parallel:
        argv += ["--ckpt-fully-parallel-save"]
    if buckets > 1:
        argv += ["--overlap-grad-reduce", "--ddp-bucket-size", str(bucket_size)]
    sharding = "fully_sharded_bucket_space" if fully_parallel else "dp_zero_gather_scatter"
    facts = {"format": "torch_dist", "optimizer_sharding": sharding, "distributed_optimizer": True,
             "tp": tp, "pp": 1, "ep": 1, "dp": dp, "cp": 1, "processes": tp * dp, "num_layers": 2,
             "tied_embeddings": False, "num_experts": None,
             "buckets": buckets, "ddp_bucket_size": bucket_size if buckets > 1 else None}
    if note:
        facts["note"] = note
    return {"facts": facts, "argv": argv}


CASES: dict[str, dict] = {
    "torch_dist-fsbs-tp1-dp2": _case(),
    "torch_dist-dpzero-tp1-dp2": _case(fully_parallel=False, note="the fsbs run without --ckpt-fully-parallel-save"),
    "torch_dist-fsbs-bucket40000-tp1-dp2": _case(buckets=2),
    "torch_dist-dpzero-bucket40000-tp1-dp2": _case(fully_parallel=False, buckets=2,
                                                note="the 2-bucket fsbs run without --ckpt-fully-parallel-save"),
    "torch_dist-fsbs-tp2-dp2": _case(tp=2),
    # bucket size 7230: the first bucket closes after the output layer and the final norm's bias,
    # 7232 elements (an odd multiple of 64), padded to 7296 by 0.7's lcm(DP, 128) (0.6: 7232)
    "torch_dist-fsbs-bucket7230-tp1-dp2": _case(buckets=7, bucket_size=7230,
                                            note="bucket ends padded: 0.7's rule and 0.6's give different layouts"),
    "torch_dist-dpzero-bucket7230-tp1-dp2": _case(fully_parallel=False, buckets=7, bucket_size=7230,
                                              note="the padded fsbs run without --ckpt-fully-parallel-save"),
}


# ------------------------------------------------------------------ the Apex / TE stand-ins

def _fused_adam():
    import torch

    class FusedAdam(torch.optim.Optimizer):
        """Apex FusedAdam's arithmetic (adam_w_mode, bias correction) in torch; step in the group."""

        def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                     adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True):
            defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
            super().__init__(params, defaults)
            self.adam_w_mode = adam_w_mode

        @torch.no_grad()
        def step(self, closure=None):
            loss = closure() if closure is not None else None
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                beta1, beta2 = group["betas"]
                bc1 = 1 - beta1 ** group["step"] if group["bias_correction"] else 1.0
                bc2 = 1 - beta2 ** group["step"] if group["bias_correction"] else 1.0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if len(state) == 0:
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    g = p.grad
                    if not self.adam_w_mode and group["weight_decay"]:
                        g = g + group["weight_decay"] * p
                    m, v = state["exp_avg"], state["exp_avg_sq"]
                    m.mul_(beta1).add_(g, alpha=1 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                    update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                    if self.adam_w_mode and group["weight_decay"]:
                        update = update + group["weight_decay"] * p
                    p.add_(update, alpha=-group["lr"])
            return loss

    return FusedAdam


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def install_07_stubs() -> None:
    """Apex and Transformer Engine stand-ins (see the module docstring), before Megatron imports."""
    import torch
    import torch.nn.functional as F

    def multi_tensor_applier(op, noop_flag, tensor_lists, *args):
        return op(2048 * 32, noop_flag, tensor_lists, *args)

    def multi_tensor_scale(_chunk, _noop, lists, scale):
        for src, dst in zip(lists[0], lists[1], strict=True):
            dst.copy_(src * scale)

    def multi_tensor_l2norm(_chunk, _noop, lists, per_tensor):
        norms = [torch.linalg.vector_norm(t.float()) for t in lists[0]]
        total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
        return total.reshape(1), (torch.stack(norms) if per_tensor and norms else None)

    class FusedLayerNormAffineFunction:
        @staticmethod
        def forward(ctx, x, weight, bias, shape, eps):  # (Megatron inspects its argument names)
            raise NotImplementedError

        @staticmethod
        def apply(x, weight, bias, shape, eps, *rest):
            return F.layer_norm(x, tuple(shape), weight, bias, eps)

    apex = _module("apex")
    apex.optimizers = _module("apex.optimizers", FusedAdam=_fused_adam(), FusedSGD=torch.optim.SGD)
    apex.multi_tensor_apply = _module("apex.multi_tensor_apply", multi_tensor_applier=multi_tensor_applier)
    apex.normalization = _module("apex.normalization")
    apex.normalization.fused_layer_norm = _module("apex.normalization.fused_layer_norm",
                                                  FusedLayerNormAffineFunction=FusedLayerNormAffineFunction)
    _module("amp_C", multi_tensor_scale=multi_tensor_scale, multi_tensor_l2norm=multi_tensor_l2norm)
    _te_wrappers()


def _te_wrappers() -> None:
    """Megatron's TE wrapper module with the names others import; only TENorm is ever built."""

    class _Absent:
        def __init__(self, *a, **k):
            raise RuntimeError("Transformer Engine is not installed (CPU fixture run): the local spec never builds "
                               f"{type(self).__name__}")

    def te_norm(config, hidden_size, eps=1e-5):
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

        return FusedLayerNorm(config=config, hidden_size=hidden_size, eps=eps)

    names = ("TEDotProductAttention", "TELayerNormColumnParallelLinear", "TERowParallelLinear",
             "TEColumnParallelLinear", "TELinear", "TEDelayedScaling", "TEColumnParallelGroupedLinear",
             "TERowParallelGroupedLinear", "TEGroupedMLP")
    attrs = {n: type(n, (_Absent,), {}) for n in names}
    _module("megatron.core.transformer.custom_layers.transformer_engine", TENorm=te_norm,
            SplitAlongDim=None, get_cpu_offload_context=None,
            te_checkpoint=lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no TE checkpointing on CPU")),
            **attrs)


def patch_megatron() -> None:
    """What the 0.14 generator patches, as far as 0.7 has it (the CPU RNG, no helper or kernel builds)."""
    import torch
    from megatron.core.datasets import utils as dutils
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    dutils.compile_helpers = lambda: None  # the wheel ships helpers compiled
    from megatron.legacy import fused_kernels

    fused_kernels.load = lambda *a, **k: None  # the legacy model's CUDA kernels: unused by the mcore model
    _once_per_plan()


def _once_per_plan() -> None:
    """torch 2.13's ``create_default_local_save_plan`` already puts every rank's BytesIO values
    (Megatron's ShardedObjects) in its local plan; torch 2.3, which 0.7 was written for, did so on
    the coordinator only, and 0.7's ``MCoreSavePlanner`` adds them on the other ranks itself. Add
    each one once, as 0.7 meant to: the same objects, each written once."""
    import io

    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    def add_missing(self, plan):
        have = {item.index.fqn for item in plan.items}
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, io.BytesIO) and fqn not in have:
                plan.items.extend(mtorch._create_write_items(fqn, obj))

    mtorch.MCoreSavePlanner._add_non_coordinator_iobytes_request = add_missing
    _old_write_item()


def _old_write_item() -> None:
    """0.7's async file writer calls torch 2.3's ``_write_item(stream, data, item, key)``; torch
    2.13's takes the writer's transforms first and the serialization format last. Called with no
    transforms and ``TORCH_SAVE`` (torch.save of each item: what 2.3 always did)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint import filesystem

    def write_item(stream, data, write_item, storage_key):
        import torch

        if isinstance(data, torch.Tensor) and data.untyped_storage().nbytes() != data.numel() * data.element_size():
            # On a GPU the writer's ``.to("cpu")`` copies the item's elements into a tensor of their
            # own; on the CPU it returns the view, whose torch.save would hold the whole buffer.
            data = data.clone()
        return filesystem._write_item(filesystem._StorageWriterTransforms(), stream, data, write_item, storage_key,
                                      filesystem.SerializationFormat.TORCH_SAVE)

    filesystem_async._write_item = write_item


def worker(mlm_src: str, argv: list[str]) -> None:
    old.install_cpu_shim()
    install_07_stubs()
    sys.path.append(mlm_src)  # the wheel's megatron.core first; the source tree adds megatron.training
    patch_megatron()
    script = os.path.join(mlm_src, "pretrain_gpt.py")
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def run_case(mlm_src: str, out_root: Path, name: str, log_dir: Path) -> dict:
    from megatron.core import package_info  # (0.7 has no megatron.core.__version__)

    version = package_info.__version__
    if version != VERSION:
        raise SystemExit(f"this python has megatron-core {version}, not {VERSION}")
    case = CASES[name]
    nproc = case["facts"]["processes"]
    case_dir = out_root / version / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    data = log_dir / "data" / "tokens"
    old.make_data(data)
    argv = [*MODEL, *TRAIN, *case["argv"], "--data-path", str(data),
            "--data-cache-path", str(log_dir / "data" / f"cache-{name}"), "--save", str(case_dir)]
    port = old.free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1",
                   TORCHDYNAMO_DISABLE="1")
        log = open(log_dir / f"{name}.rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, "--worker", "--mlm-src", mlm_src, "--", *argv],
                                       env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for p, log in procs:
        codes.append(p.wait(timeout=600))
        log.close()
    if any(codes):
        raise SystemExit(f"{name}: ranks exited {codes}; see {log_dir}/{name}.rank*.log")
    return {
        "case": name, "mcore_version": version,
        "megatron_lm_source": f"Megatron-LM tag core_v{version} (megatron/training, pretrain_gpt.py)",
        "torch": __import__("torch").__version__,
        "device": "CPU, gloo backend; make_megatron_old_fixtures' CUDA shim and this script's Apex/TE stand-ins "
                  "(see its docstring)",
        **case["facts"],
        "model": {"hidden": 64, "ffn_hidden": 96, "heads": 4, "query_groups": 2, "kv_channels": 16, "swiglu": True,
                  "norm": "LayerNorm", "bias": False, "position_embedding": "rope", "seq_length": 16,
                  "vocab_size": 100, "tokenizer": "NullTokenizer (vocab 100 + eod)", "make_vocab_size_divisible_by": 16,
                  "params_dtype": "bf16", "main_params": "fp32", "transformer_impl": "local"},
        "training": {"optimizer": "adam (Apex FusedAdam's arithmetic in torch: this script's stand-in)",
                     "train_iters": 3, "micro_batch_size": 2, "lr": 1e-3, "schedule": "warmup 1 iter, cosine to 1e-4",
                     "weight_decay": 0.1, "clip_grad": 1.0, "seed": 1234},
        "command": ["pretrain_gpt.py", *[{str(case_dir): f"<{name}>", str(data): "<tokens>"}.get(a, a)
                                         for a in argv if not a.startswith(str(log_dir / "data" / "cache-"))]],
        "data": "<tokens>: 64 documents of 8-47 random tokens in [0, 100), numpy seed 0, written by megatron.core's "
                "IndexedDatasetBuilder",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mlm-src", required=True, help="Megatron-LM's megatron/training at tag core_v0.7.0")
    ap.add_argument("--out", default="fixtures/megatron")
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--log-dir", default="/tmp/mcore-07-logs")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    if args.worker:
        worker(args.mlm_src, args.rest)
        return
    out_root = Path(args.out)
    for name in args.case or list(CASES):
        entry = run_case(args.mlm_src, out_root, name, Path(args.log_dir))
        manifest = out_root / entry["mcore_version"] / "manifest.json"
        data = json.loads(manifest.read_text()) if manifest.exists() else {"cases": {}}
        data["cases"][name] = entry
        manifest.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"{name}: written under {out_root / entry['mcore_version'] / name}")


if __name__ == "__main__":
    main()
