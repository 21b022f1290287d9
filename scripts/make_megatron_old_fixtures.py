"""Write Megatron-Core (<= 0.14) optimizer checkpoints with the real program, on CPU.

The fixtures under ``fixtures/megatron/<mcore-version>/<case>/`` are written by
Megatron-LM's own ``pretrain_gpt.py`` (its argument parser, model builder,
distributed optimizer, training loop and ``save_checkpoint``), run on CPU with
the gloo backend in 1-4 processes, on mock data, for a few real Adam steps.
Nothing of Megatron is copied into this repository: the installed
``megatron-core`` wheel supplies ``megatron.core``, and a Megatron-LM source
tree at the matching tag supplies ``megatron.training`` and ``pretrain_gpt.py``
(the wheel has no ``megatron/training``). Its path is an argument:

    python scripts/make_megatron_old_fixtures.py --mlm-src /path/to/Megatron-LM@core_v0.14.0 \
        [--out fixtures/megatron] [--case NAME ...]

Run it with a Python that has ``torch`` and ``megatron-core==<ver>`` installed
(a venv of its own: ``pip install torch megatron-core==<ver> --no-deps`` plus
numpy<2, packaging, einops). The source tree's ``megatron/core`` is never
imported: it goes to the end of ``sys.path``, after the wheel.

CPU shim. Megatron assumes a CUDA device; the worker redirects, before
Megatron is imported, only device placement, streams and RNG to the CPU:

* ``torch.cuda.is_available`` / ``device_count`` report one device and
  ``set_device`` does nothing, so Megatron takes its one-device-per-rank path
  (local rank 0); the process groups are gloo (``--distributed-backend gloo``).
* ``torch.cuda.current_device`` returns ``"cpu"``, ``Tensor.cuda`` /
  ``Module.cuda`` return the object on the CPU, and a ``TorchFunctionMode``
  rewrites any ``device="cuda..."`` argument to ``"cpu"`` (and drops
  ``pin_memory``). Where a tensor lives changes no shape, dtype, order or
  bucket: the buffers, their padding and the optimizer's shards are computed
  from parameter sizes and the DP size, never from the device.
* ``Tensor.type()`` (no argument) gives the CUDA type name
  (``torch.cuda.BFloat16Tensor``) Megatron's optimizers dispatch on: the name
  of the same dtype on the device the tensor was redirected from.
* ``torch.cuda.Stream`` / ``Event`` / ``stream()`` / ``synchronize`` /
  ``empty_cache`` / memory statistics become no-ops or zeros: on one CPU
  stream every operation is already ordered, so waits have nothing to wait for.
* The CUDA RNG (``torch.cuda.get_rng_state``/``set_rng_state``/
  ``manual_seed``, and Megatron's ``_get_cuda_rng_state``/
  ``_set_cuda_rng_state`` used by its model-parallel RNG tracker) is the CPU
  generator: it changes which random numbers initialise the weights and the
  dropout masks, not any layout. The ``cuda_rng_state`` saved in the
  checkpoint's ``rng_state`` is therefore a CPU generator state.

Everything else (parallel layout, bucketing, sharding types, dist-checkpoint
metadata, file names) is Megatron's own code, unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import shutil
import socket
import subprocess
import sys
from pathlib import Path

# ---------------------------------------------------------------- the model

# Tiny GPT: hidden 64, GQA (4 heads, 2 query groups), SwiGLU, RMSNorm, RoPE,
# vocab 100 (+1 for the NullTokenizer's eod) padded to a multiple of 16*TP.
MODEL = [
    "--num-layers", "2",
    "--hidden-size", "64",
    "--ffn-hidden-size", "96",
    "--num-attention-heads", "4",
    "--group-query-attention",
    "--num-query-groups", "2",
    "--kv-channels", "16",
    "--swiglu",
    "--normalization", "RMSNorm",
    "--disable-bias-linear",
    "--position-embedding-type", "rope",
    "--seq-length", "16",
    "--max-position-embeddings", "16",
    "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "100",
    "--make-vocab-size-divisible-by", "16",
    "--attention-dropout", "0.0",
    "--hidden-dropout", "0.0",
]

TRAIN = [
    "--micro-batch-size", "2",
    "--train-iters", "3",
    "--lr", "1e-3",
    "--min-lr", "1e-4",
    "--lr-warmup-iters", "1",
    "--lr-decay-style", "cosine",
    "--weight-decay", "0.1",
    "--adam-beta1", "0.9",
    "--adam-beta2", "0.95",
    "--clip-grad", "1.0",
    "--bf16",
    "--seed", "1234",
    "--split", "100,0,0",
    "--eval-iters", "0",
    "--eval-interval", "1000",
    "--save-interval", "3",
    "--log-interval", "1",
    "--num-workers", "0",
    "--distributed-backend", "gloo",
    "--transformer-impl", "local",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--attention-softmax-in-fp32",
]

def _case(tp=1, pp=1, ep=1, dp=1, fmt="torch_dist", distopt=True, fully_parallel=True,
          tied=True, layers=2, moe=False, note=""):
    """One fixture: its layout facts (for the manifest) and the Megatron arguments they mean."""
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-layers", str(layers), "--ckpt-format", fmt,
            # one micro-batch of 2 per DP rank per step
            "--global-batch-size", str(2 * dp)]
    if ep > 1 or moe:
        argv += ["--num-experts", "4", "--expert-model-parallel-size", str(ep),
                 "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
                 "--moe-token-dispatcher-type", "allgather"]
    if distopt:
        argv += ["--use-distributed-optimizer"]
    if fmt == "torch_dist" and not fully_parallel:
        argv += ["--no-ckpt-fully-parallel-save"]
    if not tied:
        argv += ["--untie-embeddings-and-output-weights"]
    if fmt == "torch_dist" and distopt:
        sharding = "fully_sharded_model_space" if fully_parallel else "dp_zero_gather_scatter"
    elif fmt == "torch_dist":
        sharding = "model space, no distributed optimizer"
    else:
        sharding = "distrib_optim.pt" if distopt else "model_optim_rng.pt only"
    facts = {"format": fmt, "optimizer_sharding": sharding, "distributed_optimizer": distopt,
             "tp": tp, "pp": pp, "ep": ep, "dp": dp, "cp": 1,
             "processes": tp * pp * dp, "num_layers": layers,
             "tied_embeddings": tied, "num_experts": 4 if (ep > 1 or moe) else None}
    if note:
        facts["note"] = note
    return {"facts": facts, "argv": argv}


# The fixtures, in the order the brief ranks them. The DP size is what is left of the
# world: processes = TP * PP * DP (EP lives inside DP).
CASES: dict[str, dict] = {
    "torch_dist-fsms-tp2-dp2": _case(tp=2, dp=2, tied=False),
    "torch_dist-dpzero-tp1-dp2": _case(dp=2, fully_parallel=False),
    "torch_dist-nodistopt-tp2-pp2": _case(tp=2, pp=2, distopt=False, layers=4),
    "legacy-distopt-tp2-pp2": _case(tp=2, pp=2, fmt="torch", layers=4, tied=False),
    "legacy-distopt-tp1-pp2-dp2": _case(pp=2, dp=2, fmt="torch", layers=4),
    "moe-ep2-fsms-dp2": _case(ep=2, dp=2, moe=True),
    "moe-ep2-dpzero-dp2": _case(ep=2, dp=2, moe=True, fully_parallel=False),
}


def _device(value) -> bool:
    import torch

    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, int) and not isinstance(value, bool)


def install_cpu_shim() -> None:
    """Redirect Megatron's CUDA device placement, streams and RNG to the CPU (see the module doc)."""
    import contextlib

    import torch
    from torch.overrides import TorchFunctionMode

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            pass

        def wait_event(self, *a, **k):
            pass

        def record_event(self, *a, **k):
            return _Event()

        def synchronize(self):
            pass

        def query(self):
            return True

    class _Event:
        def __init__(self, *a, **k):
            pass

        def record(self, *a, **k):
            pass

        def wait(self, *a, **k):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

        def elapsed_time(self, other):
            return 0.0

    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.Stream = _Stream
    cuda.Event = _Event
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = lambda *a, **k: None
    for stat in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(cuda, stat, lambda *a, **k: 0)
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.reset_max_memory_allocated = lambda *a, **k: None
    cuda.memory_stats = lambda *a, **k: {}
    cuda.get_device_properties = lambda *a, **k: type(
        "Props", (), {"total_memory": 0, "name": "cpu", "major": 9, "minor": 0})()
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.get_device_name = lambda *a, **k: "cpu"
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self

    orig_type = torch.Tensor.type

    def cuda_type_name(self, dtype=None, non_blocking=False, **kwargs):
        # Megatron dispatches on the type name ('torch.cuda.BFloat16Tensor'...): report the
        # name the tensor would have on the device it was redirected from.
        if dtype is None and not kwargs:
            name = orig_type(self)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return orig_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = cuda_type_name

    orig_to = torch.Tensor.to

    class CpuDeviceMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs and _device(kwargs["device"]):
                kwargs["device"] = "cpu"
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            if func is orig_to or getattr(func, "__name__", "") == "to":
                args = tuple("cpu" if i > 0 and _device(a) else a for i, a in enumerate(args))
            return func(*args, **kwargs)

    CpuDeviceMode().__enter__()


def patch_megatron() -> None:
    """Megatron's RNG tracker reads and writes the CUDA generator: make it the CPU one.

    Also skips two start-up build steps and fills one name the no-TE path lacks (below).
    """
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # The wheel ships the dataset helpers compiled (helpers_cpp.*.so) but not their Makefile,
    # which Megatron's start-up runs on rank 0: nothing to build.
    from megatron.core.datasets import utils as dutils

    dutils.compile_helpers = lambda: None
    # Start-up also builds the legacy model's CUDA softmax kernels with nvcc; the mcore model
    # with --no-masked-softmax-fusion never calls them.
    from megatron.legacy import fused_kernels

    fused_kernels.load = lambda *a, **k: None
    # mcore 0.14's MoE router tests `te_general_gemm is not None` to pick its torch.mm path,
    # but the name exists only when Transformer Engine imports: define it as absent.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def worker(mlm_src: str, argv: list[str]) -> None:
    install_cpu_shim()
    # The wheel's megatron.core first; the source tree only adds megatron.training.
    sys.path.append(mlm_src)
    patch_megatron()
    script = os.path.join(mlm_src, "pretrain_gpt.py")
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def make_data(prefix: Path) -> None:
    """A small Megatron indexed dataset (.bin/.idx, Megatron's own writer) of random tokens < 100.

    Megatron's --mock-data counts tokens up to 4095 (a vocab of 100 would see ids past the
    table: zero embeddings, zero gradients), so the run reads this instead.
    """
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    for _ in range(64):
        doc = rng.integers(0, 100, size=int(rng.integers(8, 48)), dtype=numpy.int32)
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(mlm_src: str, out_root: Path, name: str, log_dir: Path) -> dict:
    import megatron.core

    case = CASES[name]
    nproc, extra = case["facts"]["processes"], case["argv"]
    version = megatron.core.__version__
    case_dir = out_root / version / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    case_dir.mkdir(parents=True)
    data = log_dir / "data" / "tokens"
    make_data(data)
    argv = [*MODEL, *TRAIN, *extra, "--data-path", str(data),
            "--data-cache-path", str(log_dir / "data" / f"cache-{name}"), "--save", str(case_dir)]
    port = free_port()
    procs = []
    log_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1",
                   # megatron.core.jit wraps small fused functions in torch.compile;
                   # eager runs the same arithmetic without a compiler.
                   TORCHDYNAMO_DISABLE="1")
        log = open(log_dir / f"{name}.rank{rank}.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, __file__, "--worker", "--mlm-src", mlm_src, "--", *argv],
            env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for p, log in procs:
        codes.append(p.wait(timeout=400))
        log.close()
    if any(codes):
        raise SystemExit(f"{name}: ranks exited {codes}; see {log_dir}/{name}.rank*.log")
    return {
        "case": name,
        "mcore_version": version,
        "megatron_lm_source": "Megatron-LM tag core_v" + version + " (megatron/training, pretrain_gpt.py)",
        "torch": __import__("torch").__version__,
        "device": "CPU, gloo backend, this script's CUDA shim (see its docstring)",
        **case["facts"],
        "model": {"hidden": 64, "ffn_hidden": 96, "heads": 4, "query_groups": 2,
                  "kv_channels": 16, "swiglu": True, "norm": "RMSNorm", "bias": False,
                  "position_embedding": "rope", "seq_length": 16, "vocab_size": 100,
                  "tokenizer": "NullTokenizer (vocab 100 + eod)",
                  "make_vocab_size_divisible_by": 16, "params_dtype": "bf16",
                  "main_params": "fp32", "transformer_impl": "local"},
        "training": {"optimizer": "adam (torch.optim.AdamW: no TE, no Apex)",
                     "train_iters": 3, "micro_batch_size": 2, "lr": 1e-3,
                     "schedule": "warmup 1 iter, cosine to 1e-4", "weight_decay": 0.1,
                     "clip_grad": 1.0, "seed": 1234},
        "command": ["pretrain_gpt.py", *[
            {str(case_dir): f"<{name}>", str(data): "<tokens>"}.get(a, a)
            for a in argv if not a.startswith(str(log_dir / "data" / "cache-"))]],
        "data": "<tokens>: 64 documents of 8-47 random tokens in [0, 100), numpy seed 0, "
                "written by megatron.core's IndexedDatasetBuilder",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mlm-src", required=True,
                    help="a Megatron-LM source tree at the tag of the installed megatron-core")
    ap.add_argument("--out", default="fixtures/megatron")
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--log-dir", default="/tmp/mcore-old-logs")
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
