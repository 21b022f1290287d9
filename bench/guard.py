#!/usr/bin/env python3
"""What the resume guard costs, against one AdamW step of a ~100M-parameter model on CPU.

The model has GPT-2 small's parameter shapes (embeddings 50257×768 and 1024×768, 12 blocks of
attention and MLP weights, biases and layer norms: 124 M parameters in 148 tensors). Gradients are
random; AdamW (torch's default implementation on CPU) steps ``--steps`` times to fill its state,
then, in the same process and run:

- one AdamW step (the median of ``--repeat`` steps);
- ``fingerprint`` (what ``save_fingerprint`` computes), ``save_fingerprint`` (the same, written to a
  JSON file) and ``check_resume`` (fingerprint the live optimizer, read the file, compare), each the
  median of ``--repeat`` runs;

and prints a table of times and their ratio to one step (goal: under 1 % each).

Usage: python bench/guard.py [--threads N] [--repeat 5] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpt2_small_shapes() -> list[tuple[str, tuple[int, ...]]]:
    d, ff, vocab, ctx = 768, 3072, 50257, 1024
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (ctx, d))]
    for i in range(12):
        b = f"h.{i}."
        shapes += [(b + "ln_1.weight", (d,)), (b + "ln_1.bias", (d,)),
                   (b + "attn.c_attn.weight", (d, 3 * d)), (b + "attn.c_attn.bias", (3 * d,)),
                   (b + "attn.c_proj.weight", (d, d)), (b + "attn.c_proj.bias", (d,)),
                   (b + "ln_2.weight", (d,)), (b + "ln_2.bias", (d,)),
                   (b + "mlp.c_fc.weight", (d, ff)), (b + "mlp.c_fc.bias", (ff,)),
                   (b + "mlp.c_proj.weight", (ff, d)), (b + "mlp.c_proj.bias", (d,))]
    return shapes + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="steps before timing (the state exists after one)")
    args = ap.parse_args()
    import torch

    from statekit import guard

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = torch.nn.Module()
    for name, shape in gpt2_small_shapes():
        owner = model
        *parents, leaf = name.split(".")
        for part in parents:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(torch.randn(shape) * 0.02))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def step():
        opt.step()
        sched.step()

    for _ in range(args.steps):
        step()
    step_s = median_time(step, args.repeat)
    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.join(tmp, "checkpoint-1")
        os.makedirs(where)
        fp_s = median_time(lambda: guard.fingerprint(opt, scheduler=sched, model=model), args.repeat)
        save_s = median_time(lambda: guard.save_fingerprint(opt, where, scheduler=sched, model=model), args.repeat)
        size = os.path.getsize(guard.fingerprint_path(where))
        check_s = median_time(lambda: guard.check_resume(opt, where, scheduler=sched, model=model), args.repeat)
    print(f"model: {n / 1e6:.1f} M parameters in {len(params)} tensors; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; AdamW (default implementation); fingerprint file {size:,} bytes")
    print()
    print("| what | time (ms) | ratio to one AdamW step |")
    print("|---|---:|---:|")
    print(f"| one AdamW step (+ scheduler step) | {step_s * 1e3:.1f} | 1 |")
    for label, s in (("fingerprint", fp_s), ("save_fingerprint (fingerprint + JSON file)", save_s),
                     ("check_resume (fingerprint + read + compare)", check_s)):
        print(f"| {label} | {s * 1e3:.2f} | {s / step_s:.2%} |")


if __name__ == "__main__":
    main()
