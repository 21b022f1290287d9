"""Megatron-Core's own load of a statekit-written torch_dist checkpoint at another TP/PP/EP/DP.

Run with the interpreter of a megatron-core venv (as ``make_megatron_fixtures.py``; statekit
never imports Megatron)::

    PYTHONPATH=$PWD python -m statekit convert \
        fixtures/megatron/0.19.2/gpt_torch_dist_dp_reshardable_tp1pp1dp2 /tmp/sk-tp2 --to megatron --tp 2
    /work/venvs/mcore-0.19.2/bin/python scripts/check_megatron_load.py \
        --source gpt_torch_dist_dp_reshardable_tp1pp1dp2 --written /tmp/sk-tp2 --tp 2 \
        --result fixtures/megatron/0.19.2/load_check_tp1dp2_to_tp2dp2.json

``--cp N`` loads at context-parallel size N (default: the source case's; the world is
TP × PP × CP × DP).

A MoE run at another expert-parallel size: ``--ep N`` (statekit's ``convert … --to megatron --ep N``),
e.g. ``--source moe_torch_dist_dp_reshardable_ep2dp2 --written /tmp/sk-ep1 --tp 1 --ep 1``; the
param groups are compared over all optimizer members (an EP change moves the expert groups
between them).

What it does, every step Megatron's own code (the fixture generator's worker:
``initialize_megatron``, ``setup_model_and_optimizer``, ``load_checkpoint``, ``train_step``,
``save_checkpoint``, with the CPU shim):

A. the reference: Megatron loads the *source* fixture at its own sizes and saves it at once with
   ``--dist-ckpt-optim-fully-reshardable`` (Megatron's own documented way to a model-space
   optimizer), then trains one step and saves again;
B. Megatron loads the *statekit-written* folder (fully_reshardable, or dp_reshardable: then its
   optimizer tensors are bucket space and only the comparison with A applies to them) at the target sizes (``--tp``/``--pp``, DP from the
   world), saves it at once the same way (what Megatron holds after the load, gathered), trains
   one step and saves again.

Then, with torch's ``dcp_to_torch_save``: B's first save must equal the statekit folder tensor for
tensor bit for bit (Megatron loaded exactly what statekit wrote), and A's first save element for
element (the source's state as Megatron itself reads it; the vocabulary-padding rows the target
TP adds must be zero). After one step B is compared with A at a tolerance (another TP sums in
another order), and the largest difference is recorded.

The result JSON holds, per tensor of B's first save, its dtype, shape and sha256 (of its bytes,
little-endian, C order): ``tests/test_megatron_write_dist.py`` re-checks statekit's side against
it without Megatron.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_megatron_fixtures as gen  # noqa: E402  (the cases, their arguments and the worker)
import make_megatron_legacy_buckets as bucket_cases  # noqa: E402  (fixtures/megatron_buckets' cases)

gen.CASES.update(bucket_cases.CASES)

VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
NEXT_STEP_NOTE = ("after one more step B and A are compared at a tolerance only: another TP or EP sums in another order; "
                  "when the padded vocabulary changes with TP the extra (zero) logits enter the softmax; at another "
                  "DP the driver's batches differ (seeded per DP rank and micro-batch): then the step is another "
                  "computation; at another CP the fixtures' attention (the CPU shim's, within each CP rank's chunk) "
                  "sees other tokens. At the same sizes it must be equal")


def _run(name: str, load: Path, save: Path, tp: int, pp: int, dp: int, saves: str, port: int, log: Path,
         cp: int = 1, ep: int | None = None) -> None:
    src_tp, src_pp, src_ep, src_dp, extra, _, _ = gen.CASES[name]
    ep = ep or src_ep
    world = tp * pp * cp * dp
    gbs = 2 * src_dp * (2 if src_pp > 1 else 1)  # the source run's global batch (gen.case_argv)
    if gbs % (2 * dp):
        raise SystemExit(f"global batch {gbs} does not split over DP {dp} (micro batch 2)")
    argv = gen.COMMON + [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--expert-model-parallel-size", str(ep), "--global-batch-size", str(gbs),
        "--save", str(save), "--load", str(load),
    ] + extra + ["--dist-ckpt-optim-fully-reshardable", "--context-parallel-size", str(cp)]
    if "torch" in extra and "torch_dist" not in extra:  # a legacy source: Megatron detects it on load, saves torch_dist
        argv += ["--ckpt-format", "torch_dist", "--auto-detect-ckpt-format"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={port}",
           str(HERE / "make_megatron_fixtures.py"), "--worker", "--saves", saves,
           "--facts", str(save.parent / f"{save.name}-facts.json"), "--megatron-args", shlex.join(argv)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir()).returncode
    if rc:
        raise SystemExit(f"Megatron run failed (rc {rc}); log {log}:\n{log.read_text()[-4000:]}")


def _tensors(folder: Path, tmp: Path, tag: str) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{tag}.pt"
    dcp_to_torch_save(str(folder), str(out))
    sd = torch.load(out, weights_only=False)
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def digest(t) -> str:
    import torch

    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _base(key: str) -> str:
    for prefix in ("optimizer.state.param.", "optimizer.state.exp_avg_sq.", "optimizer.state.exp_avg."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _members(common: dict) -> int:
    opt = common["optimizer"]
    return len(opt) if opt and all(isinstance(k, int) for k in opt) else 1


def _param_groups(common: dict) -> list:
    """The param groups of every optimizer member (a ChainedOptimizer's dense + expert: ``{0: …, 1: …}``),
    each without its ``is_expert_parallel`` flag, once each: an EP change moves the expert groups between
    members (joined into the dense twins at EP 1), the groups' values stay."""
    opt = common["optimizer"]
    parts = [opt[k] for k in sorted(opt)] if _members(common) > 1 else [opt]
    out = []
    for part in parts:
        for g in part["optimizer"]["param_groups"]:
            g = {k: v for k, v in g.items() if k not in ("is_expert_parallel", "params")}
            if g not in out:
                out.append(g)
    return sorted(out, key=repr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, help="the fixture case statekit converted (under --fixtures)")
    p.add_argument("--fixtures", default=str(HERE.parent / "fixtures" / "megatron"))
    p.add_argument("--written", required=True, help="the save root statekit wrote")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, help="the expert-parallel size to load at (default: the source's)")
    p.add_argument("--dp", type=int, help="default: the source's")
    p.add_argument("--cp", type=int, help="the context-parallel size to load at (default: the source's)")
    p.add_argument("--result", required=True, help="the JSON to write")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--no-reference", action="store_true", help="the folder was not converted from --source (an HF "
                   "state written with --megatron-args SOURCE): no run A; B is compared with statekit's folder only")
    ns = p.parse_args()

    import megatron.core
    import torch

    version = megatron.core.__version__
    case = gen.CASES[ns.source]
    src_tp, src_pp, src_ep, src_dp = case[:4]
    src_cp = gen.case_cp(ns.source)
    dp = ns.dp or src_dp
    cp = ns.cp or src_cp
    ep = ns.ep or src_ep
    fixture = Path(ns.fixtures) / version / ns.source
    written = Path(ns.written)
    iteration = int((written / "latest_checkpointed_iteration.txt").read_text())
    tmp = Path(tempfile.mkdtemp(prefix="mcore-load-check-"))
    try:
        ref_load = tmp / "ref-load"
        ref_load.mkdir()
        shutil.copytree(fixture / f"iter_{iteration:07d}", ref_load / f"iter_{iteration:07d}")
        (ref_load / "latest_checkpointed_iteration.txt").write_text(str(iteration))
        saves = f"{iteration},{iteration + 1}"
        if not ns.no_reference:
            print(f"A: Megatron {version} loads the source at TP{src_tp} PP{src_pp} EP{src_ep} DP{src_dp} CP{src_cp} ...",
                  flush=True)
            _run(ns.source, ref_load, tmp / "ref", src_tp, src_pp, src_dp, saves, ns.port, tmp / "ref.log", cp=src_cp)
        print(f"B: Megatron loads statekit's folder at TP{ns.tp} PP{ns.pp} EP{ep} DP{dp} CP{cp} ...", flush=True)
        _run(ns.source, written, tmp / "new", ns.tp, ns.pp, dp, saves, ns.port + 1, tmp / "new.log", cp=cp, ep=ep)
        log = (tmp / "new.log").read_text()
        it = f"iter_{iteration:07d}"
        nxt = f"iter_{iteration + 1:07d}"
        s = _tensors(written / it, tmp, "statekit")
        b = _tensors(tmp / "new" / it, tmp, "b")
        b1 = _tensors(tmp / "new" / nxt, tmp, "b1")
        a = {} if ns.no_reference else _tensors(tmp / "ref" / it, tmp, "a")
        a1 = {} if ns.no_reference else _tensors(tmp / "ref" / nxt, tmp, "a1")
        problems = []
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        cb = load_common_state_dict(str(tmp / "new" / it))
        ca = cb if ns.no_reference else load_common_state_dict(str(tmp / "ref" / it))
        common = {}
        for name, get in (("iteration", lambda c: c.get("iteration")),
                          ("opt_param_scheduler", lambda c: c.get("opt_param_scheduler")),
                          ("param_groups", _param_groups),
                          ("consumed_train_samples", lambda c: c["args"].consumed_train_samples)):
            common[name] = {"equal": None if ns.no_reference else get(ca) == get(cb), "loaded": repr(get(cb))[:400]}
            if not ns.no_reference and get(ca) != get(cb):
                problems.append(f"the common state's {name} differs from the reference's")
        bucket_space = any(".optimizer.distributed." in f".{k}" for k in s)
        if bucket_space:  # statekit wrote dp_reshardable; Megatron re-saves model space: the weights compare
            if set(k for k in s if not k.startswith("optimizer.")) != set(k for k in b if not k.startswith("optimizer.")):
                problems.append("model keys differ from statekit's")
        elif set(b) != set(s):
            problems.append(f"keys differ from statekit's: {sorted(set(b) ^ set(s))[:5]}")
        if not ns.no_reference and set(b) != set(a):
            problems.append(f"keys differ from the reference: {sorted(set(b) ^ set(a))[:5]}")
        tensors = {}
        for k in sorted(b):
            t = b[k]
            entry = {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "sha256": digest(t)}
            entry["equals_statekit_written"] = (None if bucket_space and k not in s else
                                                k in s and s[k].dtype == t.dtype and torch.equal(s[k], t))
            ref = a.get(k)
            if ref is not None:
                rows = min(ref.shape[0], t.shape[0]) if t.dim() else None
                if _base(k) in VOCAB_KEYS and ref.shape != t.shape:
                    same = torch.equal(ref[:rows], t[:rows])
                    entry["equals_source_as_megatron_reads_it"] = bool(same)
                    if t.shape[0] > rows:  # padding rows the target TP adds: zero
                        entry["rows_beyond_the_source"] = [rows, int(t.shape[0])]
                        entry["rows_beyond_are_zero"] = bool(torch.count_nonzero(t[rows:]) == 0)
                    else:  # the source's padding rows the target TP does not have
                        entry["source_rows_cut"] = [rows, int(ref.shape[0])]
                else:
                    entry["equals_source_as_megatron_reads_it"] = bool(ref.shape == t.shape and torch.equal(ref, t))
            nt, nr = b1.get(k), a1.get(k)
            if nt is not None and nr is not None:
                rows = min(nt.shape[0], nr.shape[0]) if nt.dim() else None
                x, y = (nt[:rows], nr[:rows]) if rows is not None else (nt, nr)
                if x.shape == y.shape:
                    entry["next_step_max_abs_diff_vs_reference"] = float((x.float() - y.float()).abs().max())
            tensors[k] = entry
        bad_s = [k for k, e in tensors.items() if e["equals_statekit_written"] is False]
        bad_a = [] if ns.no_reference else [
            k for k, e in tensors.items() if not e.get("equals_source_as_megatron_reads_it", False)
            or not e.get("rows_beyond_are_zero", True)]
        result = {
            "about": "Megatron-Core's own load_checkpoint of a statekit-written torch_dist checkpoint at another "
                     "parallel layout (scripts/check_megatron_load.py). Megatron re-saved what it loaded at once; "
                     "these are its tensors.",
            "megatron_core_version": version,
            "torch_version": torch.__version__,
            "source": os.path.relpath(fixture, HERE.parent) if fixture.resolve().is_relative_to(HERE.parent)
                      else str(fixture),
            "source_sizes": {"tp": src_tp, "pp": src_pp, "ep": src_ep, "dp": src_dp}
                            | ({"cp": src_cp} if cp != 1 or src_cp != 1 else {}),
            "loaded_at": {"tp": ns.tp, "pp": ns.pp, "ep": ep, "dp": dp, "world_size": ns.tp * ns.pp * cp * dp}
                         | ({"cp": cp} if cp != 1 or src_cp != 1 else {}),
            "optimizer_members_after_load": _members(cb),
            "iteration": iteration,
            "written_sharding": "dp_reshardable" if bucket_space else "fully_reshardable",
            "common_state_after_load": common,
            "next_step_note": NEXT_STEP_NOTE,
            "megatron_said": [ln.strip() for ln in log.splitlines()
                              if "mismatch" in ln or "sharded_state_dict metadata loaded" in ln][:4],
            "all_equal_statekit_written": not bad_s and not problems,
            "all_equal_source_as_megatron_reads_it": None if ns.no_reference else not bad_a and not problems,
            "reference_run": not ns.no_reference,
            "next_step_max_abs_diff": None if ns.no_reference else max(
                (e.get("next_step_max_abs_diff_vs_reference", 0.0) for e in tensors.values()), default=None),
            "next_step_saved": sorted(b1) == sorted(b),
            "problems": problems + [f"differs from statekit's: {k}" for k in bad_s]
                        + [f"differs from the source: {k}" for k in bad_a],
            "tensors": tensors,
        }
        Path(ns.result).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "tensors"}, indent=1))
        if problems or bad_s or bad_a:
            raise SystemExit(1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
