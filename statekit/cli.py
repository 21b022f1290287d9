"""The ``statekit`` command line: a thin typer layer over :mod:`statekit.ops`.

Errors are one line on stderr (``statekit: error: FILE: problem``) with exit code 1 (2 for usage
errors); ``STATEKIT_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import gc
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
import typer.core

from statekit import typer_fast
from statekit.errors import StatekitError, UsageError
from statekit.output import Output, error_line, names_as_given

typer_fast.install()  # plain options without typer's pydantic adapters (statekit/typer_fast.py)
# help shows an argument's metavar (FILE), not its Python type (<path>) beside it
typer.core.TyperArgument.display_type_rich = lambda self, ctx: None

app = typer.Typer(
    name="statekit",
    help=(
        "See, move and replay optimizer state: burn burnpack (.bpk), burn <= 0.21 records "
        "(.mpk/.bin), PyTorch (.pt), candle and safetensors.\n\n"
        "\b\n"
        "  statekit inspect optim-10.bpk                    one row per parameter (--json for scripts)\n"
        "  statekit doctor optim-10.bpk --model model.bpk   what would break at resume\n"
        "  statekit convert optim-10.bpk opt.pt --optimizer adam --names names.txt --transpose '*.weight'\n"
        "  statekit remap optim-10.bpk --model new.bpk -o new-optim.bpk --rename 'enc\\.=encoder.'\n"
        "  statekit verify-resume optim-10.bpk opt.pt       does the converted state resume the same?\n\n"
        "Errors are one line on stderr (exit 1; usage errors 2); STATEKIT_DEBUG=1 shows tracebacks."
    ),
    no_args_is_help=True,
    add_completion=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)

FileArg = Annotated[Path, typer.Argument(metavar="FILE", help="A burnpack .bpk, PyTorch .pt, burn .mpk/.bin or safetensors file.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables (same as --format json).")]
FormatOpt = Annotated[str | None, typer.Option("--format", metavar="table|json|tsv", help="Output: tables (default), one JSON object, or tab-separated lines with one header.")]
ParamOpt = Annotated[list[str] | None, typer.Option("--param", "-p", metavar="PARAM", help="Only this parameter: a path or a glob of paths ('l1.*'), a ParamId (decimal or the 13-character form) or #index; repeatable.")]
JobsOpt = Annotated[int | None, typer.Option("--jobs", min=1, metavar="N", help="Tensors read and transformed at once (threads; default: the cores). The output never depends on it.")]
KeyOpt = Annotated[str | None, typer.Option("--key", metavar="KEY", help="Entry of a training checkpoint that holds the optimizer state (e.g. optimizer_state_dict).")]


def _output(fmt: str | None, json_out: bool) -> Output:
    """The output of one command: ``--format`` (table, json, tsv); ``--json`` is ``--format json``."""
    from statekit.render import FORMATS

    if fmt is not None and fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if json_out and fmt not in (None, "json"):
        raise UsageError(f"--json and --format {fmt} disagree")
    return Output(fmt=fmt or ("json" if json_out else "table"))


def _jobs(n: int | None) -> None:
    """--jobs for the rest of this command (statekit.stream reads it)."""
    if n is not None:
        from statekit import stream

        stream.set_jobs(n)


def _version(value: bool) -> None:
    if value:
        from statekit import __version__

        print(f"statekit {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    pass


ModelConfigOpt = Annotated[Path | None, typer.Option("--model-config", metavar="CONFIG", help="A Hugging Face config.json: its architecture, built on the meta device (needs transformers: pip install 'statekit[hf]'), names a torch state's positions and gives each parameter's layout by module class. A Trainer folder's own config.json is used without it.")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Let a model whose code is in its checkpoint (config.json auto_map) run that code to build its definition; never by default.")]


@app.command()
def inspect(
    file: FileArg,
    stats: Annotated[bool, typer.Option("--stats", help="Add min/max/mean/RMS and NaN/Inf counts per field (reads all data).")] = False,
    param: ParamOpt = None,
    names: Annotated[Path | None, typer.Option("--names", metavar="FILE", help="Names for a torch state's positions: see convert --help.")] = None,
    names_order: Annotated[str | None, typer.Option("--names-order", metavar="model|optimizer", help="What order the --names list is in: 'model' (model.named_parameters()) or 'optimizer' (its param groups, one after the other).")] = None,
    model: Annotated[Path | None, typer.Option("--model", metavar="MODEL", help="The model file, to name a torch state's positions by solving order and shapes.")] = None,
    model_config: ModelConfigOpt = None,
    trust_remote_code: TrustOpt = False,
    key: KeyOpt = None,
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
    jobs: JobsOpt = None,
) -> None:
    """Show what a file holds: kind, optimizer family, one row per parameter.

    Reads only the header and metadata unless --stats is given. Parameters are grouped by module
    prefix with element and byte totals. burn ids are shown in both spellings (decimal u64 and
    the 13-character form burn prints).

    \b
      statekit inspect optim-10.bpk --param 6j5mg0dcb1hvu --stats
    """
    _jobs(jobs)
    from statekit import io
    from statekit.ops.inspect import inspect as describe
    out = _output(fmt, json_out)
    open_opts = {"key": key} if key else {}
    if trust_remote_code:
        open_opts["trust_remote_code"] = True
    with _no_cycle_collection(), io.open_checkpoint(file, **open_opts) as ckpt:
        if (names or model or model_config) and ckpt.optimizer is not None:
            from statekit.ops.convert import name_checkpoint
            from statekit.ops.options import make_options

            name_checkpoint(ckpt, make_options(names=names, names_order=names_order, model=model,
                                               model_config=model_config, trust_remote_code=trust_remote_code),
                            str(file))
        total = len(ckpt.optimizer.params) if ckpt.optimizer else len(ckpt.model.params) if ckpt.model else 0
        with out.progress("statistics", total if stats else None) as advance:
            result = describe(ckpt, stats=stats, on_param=advance, only=param, stream=True)
        out.show("inspect", result, stats=stats, width=out.width)
        if _ONE_COMMAND:
            _KEPT.append((ckpt, result))  # freed by the process's exit, not one object at a time (see main)


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cycle collector paused while a header becomes a description and a table.

    inspect builds a few objects per tensor, all alive until the table is written: the collector
    scans them again and again as they pile up (measured: 40 % of a 10,000-parameter inspect's
    CPU time). What inspect holds is bounded by the header, tensor data is never held, and plain
    reference counting still frees everything that is not a cycle; collection resumes after.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _ONE_COMMAND:  # the process ends after this command: what it built is never scanned again
            gc.freeze()
        if was:
            gc.enable()


#: True in the ``statekit`` process itself (:func:`main`), False when the CLI runs in-process (tests)
_ONE_COMMAND = False
#: what a command built and the process may leave to its exit (:func:`_exit`)
_KEPT: list = []


OptimizerOpt = Annotated[str | None, typer.Option("--optimizer", metavar="NAME", help="Optimizer family (adam, adamw, sgd, muon, rmsprop, adagrad, adafactor, …); needed when the file cannot tell: burn's Adam vs AdamW, SGD-with-momentum vs Muon.")]
LrOpt = Annotated[float | None, typer.Option("--lr", metavar="LR", help="Learning rate for the target's param group.")]
BetasOpt = Annotated[str | None, typer.Option("--betas", metavar="B1,B2", help="Adam betas as 'B1,B2'.")]
EpsOpt = Annotated[float | None, typer.Option("--eps", metavar="EPS", help="Adam/RMSprop/Adagrad eps (burn's default 1e-5 is written when converting from burn).")]
WdOpt = Annotated[float | None, typer.Option("--weight-decay", metavar="WD", help="Weight decay.")]
AmsOpt = Annotated[bool | None, typer.Option("--amsgrad/--no-amsgrad", help="AMSGrad; default: whether the state holds max_exp_avg_sq.")]
MomOpt = Annotated[float | None, typer.Option("--momentum", metavar="M", help="SGD/RMSprop momentum.")]
DampOpt = Annotated[float | None, typer.Option("--dampening", metavar="D", help="SGD dampening (burn's default is 0.1, torch's 0).")]
NestOpt = Annotated[bool | None, typer.Option("--nesterov/--no-nesterov", help="SGD Nesterov momentum.")]
HyperOpt = Annotated[list[str] | None, typer.Option("--hyper", metavar="KEY=VALUE", help="Any other hyperparameter of the family, e.g. burn Adafactor's relative_step=false or Muon's ns_steps=5 (burn files store none: say what the run used); repeatable.")]
RenameOpt = Annotated[list[str] | None, typer.Option("--rename", metavar="REGEX=REPLACEMENT", help="Ordered rename rule 'REGEX=REPLACEMENT' ($1 for groups); repeatable.")]
RulesOpt = Annotated[list[Path] | None, typer.Option("--rules", metavar="FILE", help="File of rename rules, one per line.")]
FuseOpt = Annotated[list[str] | None, typer.Option("--fuse", metavar="NEW=OLD1,OLD2", help="NEW is the OLDs joined in that order (torch: along the first axis; burn matrices: the second; NEW@AXIS=... to choose); '*' matches one path component on both sides: 'layers.*.qkv.weight=layers.*.q.weight,layers.*.k.weight,layers.*.v.weight'. Repeatable.")]
SplitOpt = Annotated[list[str] | None, typer.Option("--split", metavar="OLD=NEW1,NEW2", help="The inverse of --fuse; the parts' sizes come from --model. Repeatable.")]
StackOpt = Annotated[list[str] | None, typer.Option("--stack", metavar="NEW=OLD_GLOB", help="NEW's first axis stacks the OLDs numbered by the glob's last '*' (0, 1, ...); several globs join each number's tensors first: 'experts.gate_up_proj=experts.*.w1.weight,experts.*.w3.weight'. Repeatable.")]
UnstackOpt = Annotated[list[str] | None, typer.Option("--unstack", metavar="OLD=NEW_GLOB", help="The inverse of --stack: OLD's first axis becomes the NEWs numbered by the glob's last '*'. Repeatable.")]
PresetOpt = Annotated[bool, typer.Option("--preset/--no-preset", help="Apply the burn⇄torch norm preset (gamma/beta ⇄ weight/bias).")]
TransposeOpt = Annotated[list[str] | None, typer.Option("--transpose", metavar="GLOB", help="Glob of parameters whose state is transposed (burn Linear weights are [d_in, d_out], torch's [out, in]); repeatable.")]
NoTransposeOpt = Annotated[list[str] | None, typer.Option("--no-transpose", metavar="GLOB", help="Glob of rank-2 parameters kept as they are (e.g. embeddings); repeatable.")]
NamesOpt = Annotated[Path | None, typer.Option("--names", metavar="FILE", help="Names for a torch state's positions: one per line (optionally with its shape, 'fc.weight [16, 4]') or JSON. A list with shapes is read in model.named_parameters() order and each param group is placed in it by shape; a flat list without shapes for a state with several param groups needs --names-order.")]
NamesOrderOpt = Annotated[str | None, typer.Option("--names-order", metavar="model|optimizer", help="What order the --names list is in: 'model' (model.named_parameters(); give --model for the shapes) or 'optimizer' (the optimizer's param groups one after the other).")]
ModelOpt = Annotated[Path | None, typer.Option("--model", metavar="MODEL", help="The model file: burn .bpk (ParamIds, shapes), torch .pt/.bin state_dict (named_parameters() order, shapes) or .safetensors (shapes only).")]
DtypeOpt = Annotated[str | None, typer.Option("--dtype", metavar="DTYPE", help="Cast every state tensor, e.g. f32.")]
NoScheduleOpt = Annotated[bool, typer.Option("--no-schedule", help="Drop the LR schedule beside the source (scheduler.pt, scheduler-N.bpk, trainer counters) where the target cannot carry it (else refused); the plan says it was dropped.")]
DryOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")]
NonfiniteOpt = Annotated[bool, typer.Option("--allow-nonfinite", help="Write NaN/Inf state instead of refusing it.")]
PlanOutOpt = Annotated[Path | None, typer.Option("--plan-out", metavar="FILE", help="Also save the plan as JSON.")]
PlanInOpt = Annotated[Path | None, typer.Option("--plan", metavar="FILE", help="Apply a saved plan instead of building one.")]


def _show_plan(plan, out: Output, full: bool = False) -> None:
    """The plan, before anything is written, in the chosen format (``full``: every row, as a dry
    run shows it; else a long plan's first and last rows); its warnings on stderr."""
    out.show("plan", plan, full=full)
    if not out.json_mode:
        for w in plan.warnings:
            out.warn(w)


def _finish(result, out: Output) -> None:
    """What convert / remap did: writers' warnings, then the closing lines."""
    for w in result.warnings:
        out.warn(w)
    if out.json_mode and getattr(result, "summary", None) is not None:
        out.json(result.summary)
    for line in result.messages:
        out.info(line)


def _step_policy(step: str | None) -> str | None:
    if step not in (None, "max"):
        raise UsageError(f"--step {step!r}: the only policy is 'max'")
    return step


@app.command()
def convert(
    src: FileArg,
    dst: Annotated[Path, typer.Argument(metavar="DST", help="Output file; its extension picks the format (.bpk, .pt, .safetensors; an existing directory: DCP) unless --to is given.")],
    to: Annotated[str | None, typer.Option("--to", metavar="FORMAT", help="Output format: burnpack, torch, safetensors, candle, dcp, megatron (torch_dist), megatron-legacy, or hf-trainer (a Megatron source to a Trainer folder; also chosen by a DST named checkpoint-N).")] = None,
    shards: Annotated[int | None, typer.Option("--shards", metavar="N", help="DCP output (a directory): the number of data files; torch.distributed reshards on load.")] = None,
    shard: Annotated[str | None, typer.Option("--shard", metavar="I/N", help="Write share I of N of a DCP output (default: from torchrun RANK/WORLD_SIZE or SLURM); the last share to finish writes .metadata.")] = None,
    key: KeyOpt = None,
    also: Annotated[Path | None, typer.Option("--also", metavar="FILE", help="A second torch optimizer state over the same model (a Muon run's AdamW for the parameters that are not 2-D): its parameters join the burn output as further groups.")] = None,
    also_key: Annotated[str | None, typer.Option("--also-key", metavar="KEY", help="Entry of the --also file (default: SRC) that holds the second state, e.g. adamw.")] = None,
    also_out: Annotated[Path | None, typer.Option("--also-out", metavar="FILE", help="burn → torch for a record of two optimizers (Muon + AdamW): DST gets the family --optimizer names first (else the first group's), FILE the other, as its own state_dict.")] = None,
    optimizer: OptimizerOpt = None,
    lr: LrOpt = None,
    betas: BetasOpt = None,
    eps: EpsOpt = None,
    weight_decay: WdOpt = None,
    amsgrad: AmsOpt = None,
    momentum: MomOpt = None,
    dampening: DampOpt = None,
    nesterov: NestOpt = None,
    hyper: HyperOpt = None,
    rename: RenameOpt = None,
    rules: RulesOpt = None,
    fuse: FuseOpt = None,
    split: SplitOpt = None,
    stack: StackOpt = None,
    unstack: UnstackOpt = None,
    preset: PresetOpt = True,
    transpose: TransposeOpt = None,
    no_transpose: NoTransposeOpt = None,
    names: NamesOpt = None,
    names_order: NamesOrderOpt = None,
    model: ModelOpt = None,
    model_config: ModelConfigOpt = None,
    trust_remote_code: TrustOpt = False,
    dtype: DtypeOpt = None,
    step: Annotated[str | None, typer.Option("--step", metavar="max", help="candle keeps one step for all parameters: 'max' writes the largest when they differ (else refused).")] = None,
    allow_nonfinite: NonfiniteOpt = False,
    no_schedule: NoScheduleOpt = False,
    dry_run: DryOpt = False,
    plan_out: PlanOutOpt = None,
    plan: PlanInOpt = None,
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
    jobs: JobsOpt = None,
    tp: Annotated[int | None, typer.Option("--tp", metavar="N", help="--to megatron / megatron-legacy: the tensor-parallel size of the run that loads it (default: the source's).")] = None,
    pp: Annotated[int | None, typer.Option("--pp", metavar="N", help="--to megatron / megatron-legacy: the pipeline-parallel size (uniform stages; default: the source's).")] = None,
    dp: Annotated[int | None, typer.Option("--dp", metavar="N", help="--to megatron / megatron-legacy: the data-parallel size (the distributed optimizer's layout; default: the source's).")] = None,
    cp: Annotated[int | None, typer.Option("--cp", metavar="N", help="--to megatron / megatron-legacy: the context-parallel size (the distributed optimizer shards over DP × CP; default: the source's).")] = None,
    sharding: Annotated[str | None, typer.Option("--sharding", metavar="TYPE", help="--to megatron: the distributed optimizer's sharding type (fully_reshardable).")] = None,
    megatron_args: Annotated[Path | None, typer.Option("--megatron-args", metavar="DIR", help="--to megatron from an HF / torch state: a Megatron torch_dist checkpoint of the same model whose args and layout to write (the masters come from --model).")] = None,
    ep: Annotated[int | None, typer.Option("--ep", metavar="N", help="--to megatron / megatron-legacy: the target expert-parallel size (default: the source's).")] = None,
    distributed_optimizer: Annotated[bool | None, typer.Option("--distributed-optimizer/--no-distributed-optimizer", help="--to megatron-legacy: the optimizer's form, the distributed optimizer's distrib_optim.pt or the non-distributed state (default: the source's).")] = None,
    vocab_divisible_by: Annotated[int | None, typer.Option("--vocab-divisible-by", metavar="N", help="--to megatron-legacy: the target's make_vocab_size_divisible_by (the padded vocabulary is a multiple of N × TP; default: the source's).")] = None,
    hf_model_type: Annotated[str | None, typer.Option("--hf-model-type", metavar="TYPE", help="A Megatron source: the Hugging Face model its names are for (llama, qwen2, qwen3, mixtral, qwen3_moe; default: what the run's args describe).")] = None,
    hf_config: Annotated[Path | None, typer.Option("--hf-config", metavar="CONFIG", help="A Megatron source to a Trainer folder: this config.json (checked against the run's args) instead of one built from them.")] = None,
    weights: Annotated[str | None, typer.Option("--weights", metavar="WHICH", help="A Megatron source to a Trainer folder: model.safetensors holds the fp32 masters (master, the default) or them rounded to the run's dtype (model).")] = None,
) -> None:
    """Convert optimizer state between burn (.bpk), PyTorch (.pt), candle and safetensors.

    The plan (every rename, transpose, cast and assumed hyperparameter) is printed before anything
    is written; --dry-run stops there. The output is written atomically.

    \b
    burn → PyTorch:
      statekit convert optim-10.bpk optim.pt --optimizer adamw --names names.txt --transpose '*.weight' --lr 3e-4
    PyTorch → burn (ids from the burn model, joined by path):
      statekit convert opt.pt optim.bpk --model model-10.bpk --transpose 'fc*.weight'
    A torch Muon run (Muon + AdamW, two state_dicts) ⇄ one burn record with two groups:
      statekit convert muon.pt optim.bpk --also adamw.pt --names names.txt --transpose '*.weight'
      statekit convert optim.bpk muon.pt --also-out adamw.pt
    A Megatron torch_dist checkpoint for a run at another TP/PP/DP (a new save root):
      statekit convert ckpt/ ckpt-tp2/ --to megatron --tp 2
    A Megatron legacy checkpoint (mp_rank_*) resharded as legacy files:
      statekit convert ckpt/ ckpt-tp1/ --to megatron-legacy --tp 1 --pp 1 --dp 2
    A torch state's positions are named by solving, never by assuming an order: --model MODEL.pt (a
    state_dict keeps named_parameters() order) or --names with shapes; ambiguity is refused.
    """
    from types import SimpleNamespace

    _convert(SimpleNamespace(**locals()))


def _convert(a) -> None:
    """The body of :func:`convert` (its parameters as ``a``'s attributes)."""
    _jobs(a.jobs)
    from statekit.ops.convert import convert as run_convert
    from statekit.ops.options import make_options
    from statekit.ops.shares import resolve as resolve_share

    out = _output(a.fmt, a.json_out)
    if a.to == "megatron-legacy":  # a Megatron legacy checkpoint at other parallel sizes (ops/megatron_reshard.py)
        if a.sharding is not None or a.megatron_args is not None:
            raise UsageError("--sharding/--megatron-args: only with --to megatron (torch_dist)")
        from statekit.ops.megatron_reshard import reshard

        result = reshard(str(a.src), str(a.dst), tp=a.tp, pp=a.pp, ep=a.ep, dp=a.dp,
                         vocab_divisible_by=a.vocab_divisible_by, distributed=a.distributed_optimizer,
                         dry_run=a.dry_run, cp=a.cp)
        if out.json_mode:
            out.json(result.to_json())
        else:
            _finish(result, out)
        return
    if any(v is not None for v in (a.vocab_divisible_by, a.distributed_optimizer)):
        raise UsageError("--vocab-divisible-by/--[no-]distributed-optimizer: only with --to megatron-legacy")
    if a.ep is not None and a.to != "megatron":
        raise UsageError("--ep: only with --to megatron or --to megatron-legacy")
    opts = make_options(optimizer=a.optimizer, lr=a.lr, betas=a.betas, eps=a.eps, weight_decay=a.weight_decay,
                        amsgrad=a.amsgrad, momentum=a.momentum, dampening=a.dampening, nesterov=a.nesterov,
                        rename=a.rename, rules=a.rules, preset=a.preset, transpose=a.transpose,
                        no_transpose=a.no_transpose, names=a.names, names_order=a.names_order, model=a.model,
                        dtype=a.dtype, step_policy=_step_policy(a.step), allow_nonfinite=a.allow_nonfinite,
                        model_config=a.model_config, trust_remote_code=a.trust_remote_code, settings=a.hyper,
                        fuse=a.fuse, split=a.split, stack=a.stack, unstack=a.unstack)
    parallel = {k: v for k, v in (("tp", a.tp), ("pp", a.pp), ("ep", a.ep), ("dp", a.dp), ("cp", a.cp),
                                   ("sharding", a.sharding),
                                  ("megatron_args", str(a.megatron_args) if a.megatron_args else None),
                                  ("model_path", str(a.model) if a.megatron_args and a.model else None))
                if v is not None}
    result = run_convert(str(a.src), str(a.dst), opts, to=a.to, key=a.key, dry_run=a.dry_run,
                         plan_in=str(a.plan) if a.plan else None, plan_out=str(a.plan_out) if a.plan_out else None,
                         progress=out.progress, on_plan=lambda p: _show_plan(p, out, a.dry_run), shards=a.shards,
                         share=resolve_share(a.shard), also=str(a.also) if a.also else None, also_key=a.also_key,
                         also_out=str(a.also_out) if a.also_out else None, no_schedule=a.no_schedule,
                         parallel=parallel or None, hf_model_type=a.hf_model_type,
                         hf_config=a.hf_config and str(a.hf_config), weights=a.weights)
    _finish(result, out)


@app.command()
def remap(
    state: FileArg,
    model: Annotated[Path, typer.Option("--model", metavar="MODEL", help="The NEW model (.bpk with ParamIds, .pt/.safetensors state_dict, a Trainer folder).")],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="FILE", help="Output file (format from its extension, or --to).")],
    old_model: Annotated[Path | None, typer.Option("--old-model", metavar="MODEL", help="The model the state was saved with: its weights, before your conversion, prove where every new tensor's elements came from (with --model's weights); also names a state's parameters by ParamId.")] = None,
    to: Annotated[str | None, typer.Option("--to", metavar="FORMAT", help="Output format: burnpack, torch, safetensors or candle.")] = None,
    match: Annotated[str, typer.Option("--match", metavar="HOW", help="How old and new tensors are paired: values (a map learned from the --old-model and --model weights and proved on them), paths (by module path and --rename), or auto: values when both models hold weights that share any.")] = "auto",
    rename: RenameOpt = None,
    rules: RulesOpt = None,
    fuse: FuseOpt = None,
    split: SplitOpt = None,
    stack: StackOpt = None,
    unstack: UnstackOpt = None,
    new: Annotated[list[str] | None, typer.Option("--new", metavar="GLOB", help="New-model tensors that start fresh even where an old tensor of the same name exists (re-initialised layers); repeatable.")] = None,
    resize: Annotated[bool, typer.Option("--resize", help="Pad with zeros or truncate state whose shape changed (vocabulary growth).")] = False,
    reset_step: Annotated[list[str] | None, typer.Option("--reset-step", metavar="GLOB", help="Glob of resized parameters whose state restarts from step 0 (moments cleared); repeatable.")] = None,
    names: NamesOpt = None,
    names_order: NamesOrderOpt = None,
    allow_nonfinite: NonfiniteOpt = False,
    no_schedule: NoScheduleOpt = False,
    dry_run: DryOpt = False,
    plan_out: PlanOutOpt = None,
    plan: PlanInOpt = None,
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
    jobs: JobsOpt = None,
) -> None:
    """Move optimizer state onto a refactored model: renamed, fused, split, permuted, stacked, grown.

    With the weights before and after your conversion (--old-model, --model), statekit learns
    where every element of every new tensor came from, by exact values, proves it bit for bit
    on the weights, and moves each moment as its weight moved: q/k/v fused into qkv (RoPE rows
    permuted), gate/up fused, experts stacked, Conv1D ⇄ Linear and torch ⇄ burn transposes, grown
    vocabularies (new rows start fresh). What the weights cannot prove is refused, naming the tensor
    and the first element that disagrees. Without the old weights, --fuse/--split/--stack/--unstack
    say the same by rule; --rename moves by path.

    \b
      statekit remap optim.pt --old-model llama.safetensors --model phi3.safetensors -o phi3-optim.pt
      statekit remap optim.pt --model phi3.pt -o out.pt --fuse 'layers.*.qkv_proj.weight=layers.*.q_proj.weight,layers.*.k_proj.weight,layers.*.v_proj.weight'
      statekit remap optim-10.bpk --model model-new.bpk -o optim-new.bpk --rename 'encoder\\.(\\d+)=layers.$1' --dry-run
    """
    _jobs(jobs)
    from statekit.ops.options import make_options
    from statekit.ops.remap import remap as run_remap

    out = _output(fmt, json_out)
    opts = make_options(rename=rename, rules=rules, names=names, names_order=names_order, model=model, resize=resize,
                        reset_step=reset_step, old_model=old_model, allow_nonfinite=allow_nonfinite, fuse=fuse,
                        split=split, stack=stack, unstack=unstack, new=new, match=match)
    result = run_remap(str(state), str(output), opts, to=to, dry_run=dry_run, plan_in=str(plan) if plan else None,
                       plan_out=str(plan_out) if plan_out else None, progress=out.progress,
                       on_plan=lambda p: _show_plan(p, out, dry_run), no_schedule=no_schedule)
    _finish(result, out)


KernelOpt = Annotated[str, typer.Option("--kernel", metavar="NAME", help="Code that runs the steps: auto (torch's own kernels when installed, else numba, else the numpy reference; CuPy's on CuPy arrays), torch, numba, cupy or reference; all give the same bits.")]
FlavorOpt = Annotated[str | None, typer.Option("--flavor", metavar="FLAVOR", help="Arithmetic to reproduce: torch-fused, torch, torch-foreach, burn, candle or megatron (megatron-core's Adam over its fp32 masters; default: the state's framework).")]


@app.command()
def replay(
    grads: Annotated[list[Path], typer.Option("--grads", metavar="G1", help="Gradient files, one per step, in step order (same keys as --params): --grads G1 G2 ... or --grads G1 --grads G2.")],
    out_params: Annotated[Path, typer.Option("--out-params", metavar="FILE", help="Where to write the parameters after the last step.")],
    params: Annotated[Path | None, typer.Option("--params", metavar="FILE", help="Parameters before the first step (.safetensors, .pt state_dict or .bpk model), keyed by path; omit for a Megatron --state (its fp32 masters are the parameters).")] = None,
    state: Annotated[Path | None, typer.Option("--state", metavar="FILE", help="Optimizer state before the first step (any format); omit to reconstruct it from the gradients.")] = None,
    out_state: Annotated[Path | None, typer.Option("--out-state", metavar="FILE", help="Where to write the state after the last step (format by extension).")] = None,
    optimizer: OptimizerOpt = None,
    flavor: FlavorOpt = None,
    lr: LrOpt = None,
    betas: BetasOpt = None,
    eps: EpsOpt = None,
    weight_decay: WdOpt = None,
    amsgrad: AmsOpt = None,
    momentum: MomOpt = None,
    dampening: DampOpt = None,
    nesterov: NestOpt = None,
    device: Annotated[str, typer.Option("--device", metavar="DEVICE", help="cpu, or cuda (through torch, or CuPy with --backend cupy).")] = "cpu",
    backend: Annotated[str | None, typer.Option("--backend", metavar="NAME", help="Array namespace: numpy (default on cpu), torch or cupy.")] = None,
    kernel: KernelOpt = "auto",
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
    more_grads: Annotated[list[Path] | None, typer.Argument(metavar="G2 ...", help="Further gradient files after --grads G1.", show_default=False)] = None,
) -> None:
    """Apply optimizer steps to a state and its parameters with a framework's exact arithmetic.

    A state without an entry for a parameter starts it fresh, as the framework would; with no
    --state at all the state is reconstructed from the gradient history.

    \b
      statekit replay --state opt.pt --params p.safetensors --grads g1.safetensors g2.safetensors \\
          --optimizer adam --flavor torch-fused --lr 1e-3 --out-state opt2.pt --out-params p2.safetensors
    """
    from statekit.ops.options import given_hyperparams
    from statekit.ops.replay import replay_files

    out = _output(fmt, json_out)
    given = given_hyperparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                              momentum=momentum, dampening=dampening, nesterov=nesterov)
    result = replay_files(str(params) if params else None, [str(g) for g in [*grads, *(more_grads or [])]], str(out_params),
                          state=str(state) if state else None, out_state=str(out_state) if out_state else None,
                          optimizer=optimizer, flavor=flavor, hyperparams=given, device=device, backend=backend,
                          progress=out.progress, kernel=kernel)
    out.show("replay", result)
    for w in () if out.json_mode else result.get("warnings", ()):  # JSON: in the result
        out.warn(w)


@app.command("verify-resume")
def verify_resume_cmd(
    original: Annotated[Path, typer.Argument(metavar="ORIGINAL", help="The state as the original run left it (a file or a Trainer/Accelerate folder).")],
    migrated: Annotated[Path, typer.Argument(metavar="MIGRATED", help="The converted / remapped state to check.")],
    steps: Annotated[int, typer.Option("--steps", "-k", metavar="K", help="Steps to run.", min=1)] = 10,
    seed: Annotated[int, typer.Option("--seed", metavar="N", help="Seed of the synthetic parameters and gradients.")] = 0,
    optimizer: OptimizerOpt = None,
    flavor_original: Annotated[str | None, typer.Option("--flavor-original", metavar="FLAVOR", help="Arithmetic of the original run (default: its framework's).")] = None,
    flavor_migrated: Annotated[str | None, typer.Option("--flavor-migrated", metavar="FLAVOR", help="Arithmetic of the resumed run (default: its framework's).")] = None,
    lr: LrOpt = None,
    betas: BetasOpt = None,
    eps: EpsOpt = None,
    weight_decay: WdOpt = None,
    amsgrad: AmsOpt = None,
    momentum: MomOpt = None,
    dampening: DampOpt = None,
    nesterov: NestOpt = None,
    transpose: Annotated[list[str] | None, typer.Option("--transpose", metavar="GLOB", help="Glob of square rank-2 parameters whose state the conversion transposed, when the migrated file does not record it; repeatable.")] = None,
    names: Annotated[Path | None, typer.Option("--names", metavar="FILE", help="Names for torch positions (model.named_parameters() order), for a side that has none.")] = None,
    model: Annotated[Path | None, typer.Option("--model", metavar="MODEL", help="A model file naming a side's torch positions.")] = None,
    model_config: ModelConfigOpt = None,
    trust_remote_code: TrustOpt = False,
    plan: Annotated[Path | None, typer.Option("--plan", metavar="FILE", help="The remap plan (--plan-out) that made MIGRATED: renamed parameters are paired through it, resized ones compared on the kept region.")] = None,
    key: KeyOpt = None,
    kernel: KernelOpt = "auto",
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
) -> int:
    """Check that a migrated state resumes like the original: exit 0 if it tracks, 1 if not.

    Runs k seeded steps from the original, from the migrated state and from a cold (empty) state.
    Parameters are paired through --plan, else through the sources the migrated file records
    (statekit records them, and every transpose, in the .bpk/.safetensors it writes), else by
    path. The migrated run must match bit for bit when both use the same arithmetic, else stay
    within |Δp| ≤ 4·ulp(p) + 2e-5·lr·n; the cold run shows how far a silent no-op restore would
    drift. A resized state is compared on the region both hold, and its new elements must step
    exactly like a new parameter's state (zero; Adagrad's sum its initial accumulator).

    \b
      statekit verify-resume checkpoint-500/ optim.bpk
      statekit verify-resume optim.pt optim-new.bpk --plan remap-plan.json
    """
    from statekit.ops.options import given_hyperparams, read_names
    from statekit.ops.replay import verify_resume_files

    out = _output(fmt, json_out)
    hp = given_hyperparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                           momentum=momentum, dampening=dampening, nesterov=nesterov)
    with out.progress("steps", steps) as advance:
        report = verify_resume_files(
            str(original), str(migrated), names=read_names(str(names)) if names else None,
            model=_load_model(model), plan=str(plan) if plan else None, key=key, steps=steps, seed=seed,
            model_config=str(model_config) if model_config else None, trust_remote_code=trust_remote_code,
            optimizer=optimizer, given=hp, flavor_original=flavor_original, flavor_migrated=flavor_migrated,
            transpose=list(transpose or []), progress=advance, kernel=kernel)
    out.show("verify", report)
    return 0 if report["tracks"] else 1


def _load_model(path: Path | None):
    if path is None:
        return None
    from statekit.ops.options import load_model

    return load_model(str(path))


# ----------------------------------------------------------------------------- diff / merge / doctor
# diff and doctor answer a question with their exit code (0 yes, 1 no), so their errors exit 2.
ERRORS_EXIT_2 = ("diff", "doctor")


@app.command()
def diff(
    a: Annotated[Path, typer.Argument(metavar="A", help="First file (any supported format).")],
    b: Annotated[Path, typer.Argument(metavar="B", help="Second file (any supported format).")],
    atol: Annotated[float, typer.Option("--atol", metavar="TOL", help="Absolute tolerance per element (default 0: equal values).")] = 0.0,
    rtol: Annotated[float, typer.Option("--rtol", metavar="TOL", help="Relative tolerance, times max(|a|, |b|) per element.")] = 0.0,
    param: ParamOpt = None,
    names: NamesOpt = None,
    names_order: NamesOrderOpt = None,
    model: ModelOpt = None,
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
    jobs: JobsOpt = None,
) -> int:
    """Compare two optimizer states (or two models) parameter by parameter.

    Parameters are matched by burn ParamId when both files have them, else by module path, else
    by torch parameter index. Reports parameters only in A or B, shape / dtype / step
    differences, and per field the max absolute and relative difference and the max distance
    in ULPs. NaN equals NaN at the same place. Exit status: 0 equal within tolerance, 1 they
    differ, 2 error (like GNU diff).
    """
    _jobs(jobs)
    from statekit.ops.diff import diff_files

    out = _output(fmt, json_out)
    result = diff_files(a, b, atol=atol, rtol=rtol, only=param,
                        progress=lambda d, t: out.progress(d, t, unit_bytes=True),
                        names=names, names_order=names_order, model=model)
    out.show("diff", result)
    return 0 if result["equal"] else 1


@app.command()
def merge(
    inputs: Annotated[list[Path], typer.Argument(metavar="INPUT...", help="Optimizer state files, in order.")],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="FILE", help="Output file; its extension picks the format (.bpk).")],
    on_conflict: Annotated[str, typer.Option(
        "--on-conflict", metavar="error|first|last|mean",
        help="A parameter in several inputs: refuse (error), take the first or last, or average the moments "
             "elementwise and keep the largest step (mean).")] = "error",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be merged and write nothing.")] = False,
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
    jobs: JobsOpt = None,
) -> None:
    """Merge optimizer states (parameter groups saved apart, or several runs) into one file.

    Parameters are matched by burn ParamId (else path, else torch index); all inputs must hold
    the same optimizer family. The output keeps the inputs' order and is written atomically;
    the inputs are only read.
    """
    _jobs(jobs)
    from statekit.ops.merge import merge_files

    out = _output(fmt, json_out)
    result = merge_files(inputs, output, on_conflict=on_conflict, dry_run=dry_run, progress=out.progress)
    out.show("merge", result)


@app.command()
def split(
    state: Annotated[Path, typer.Argument(metavar="STATE", help="Optimizer state file (or a Trainer checkpoint folder).")],
    into: Annotated[list[str], typer.Option("--into", metavar="NAME=PATTERN[,PATTERN...]", help="A part: the parameters its patterns select (a path, a glob of paths, a ParamId or #index), written to DIR/NAME.<ext>. Repeat it; each parameter goes to the first part that selects it.")],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="DIR", help="Folder the parts are written into.")],
    rest: Annotated[str | None, typer.Option("--rest", metavar="NAME", help="The part that takes every parameter no --into selects (else they are refused).")] = None,
    to: Annotated[str | None, typer.Option("--to", metavar="FORMAT", help="The parts' format (the input's framework); default: the input's.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and write nothing.")] = False,
    names: NamesOpt = None,
    names_order: NamesOrderOpt = None,
    model: Annotated[Path | None, typer.Option("--model", metavar="MODEL", help="The model file, to name a torch state's positions by solving order and shapes.")] = None,
    key: KeyOpt = None,
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
    jobs: JobsOpt = None,
) -> None:
    """Split an optimizer state into one state per optimizer (the inverse of merge).

    Each parameter goes to the first --into part that selects it; its param group's
    hyperparameters go with it (a group left empty is dropped). A parameter no part selects is
    refused unless --rest names a part for them. All parts are written, atomically, or none.

    \b
      statekit split optimizer.pt --names names.txt --into muon='*.weight' --into adamw='*' -o parts/
    """
    _jobs(jobs)
    from statekit.ops.split import split_files

    out = _output(fmt, json_out)
    name_with = None
    if names or model:
        from statekit.ops.convert import name_checkpoint
        from statekit.ops.options import make_options

        def name_with(ckpt):
            name_checkpoint(ckpt, make_options(names=names, names_order=names_order, model=model), str(state))

    # a table shows the plan before anything is written, then the line that says it was; json and tsv the result
    show_plan = out.format == "table" and not dry_run
    result = split_files(state, into, output, rest=rest, to=to, dry_run=dry_run, progress=out.progress,
                         name_with=name_with, key=key, on_plan=(lambda plan: out.show("split", plan)) if show_plan else None)
    if show_plan:
        from statekit.render.reports import split_summary

        out.print(split_summary(result))
    else:
        out.show("split", result)


@app.command()
def fit(
    state: Annotated[Path, typer.Argument(metavar="STATE", help="Optimizer state file (or a Trainer checkpoint folder) saved before the change.")],
    model: Annotated[Path, typer.Option("--model", metavar="MODEL", help="The NEW model: a peft adapter folder (its requires_grad parameters), a Hugging Face folder or config.json, or a torch state_dict .pt (named_parameters() order).")],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="FILE", help="The fitted torch optimizer state (.pt).")],
    group: Annotated[list[str] | None, typer.Option("--group", metavar="NAME=GLOB[,GLOB][:KEY=VAL,...]", help="A param group of the new optimizer, in the order it builds them: the trainable parameters its globs select (first group wins), with hyperparameters set (the rest from the state's groups). Repeatable; default: the state's groups.")] = None,
    trainable: Annotated[list[str] | None, typer.Option("--trainable", metavar="GLOB", help="Only the model's parameters these select are trained. Repeatable.")] = None,
    frozen: Annotated[list[str] | None, typer.Option("--frozen", metavar="GLOB", help="The model's parameters these select are frozen. Repeatable.")] = None,
    optimizer: Annotated[str | None, typer.Option("--optimizer", metavar="FAMILY", help="The new optimizer's family: the state's (default), or muon over an Adam/AdamW state (with --momentum-from).")] = None,
    momentum_from: Annotated[str | None, typer.Option("--momentum-from", metavar="exp_avg|fresh", help="--optimizer muon: carry each kept exp_avg as Muon's momentum_buffer (needs momentum = β1), or start every buffer at zero.")] = None,
    reset_step: Annotated[bool, typer.Option("--reset-step", help="Every kept parameter's step restarts at 0 (moments kept), as the new parameters' do.")] = False,
    resize: Annotated[bool, typer.Option("--resize", help="A kept parameter whose shape changed in the same rank (a grown vocabulary): its state padded with fresh elements or truncated, leading block kept.")] = False,
    training_args: Annotated[Path | None, typer.Option("--training-args", metavar="FILE", help="The next run's training_args.bin: the groups HF Trainer builds (decay / no-decay, its lr, betas, eps, weight decay) instead of --group; needs a model definition (HF or peft folder).")] = None,
    names: NamesOpt = None,
    names_order: NamesOrderOpt = None,
    model_config: ModelConfigOpt = None,
    trust_remote_code: TrustOpt = False,
    key: KeyOpt = None,
    dry_run: DryOpt = False,
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
    jobs: JobsOpt = None,
) -> None:
    """Fit an optimizer state to a changed trainable set or a new optimizer split.

    Kept (same name, same shape: state copied, position renumbered to the new optimizer's),
    new (no state: torch starts it at step 0, as any parameter never stepped), dropped (not
    trainable now), refused (same name, other shape). Positions follow named_parameters(),
    group by group in the --group order. The plan is printed first; --dry-run prints it alone.

    \b
      statekit fit optimizer.pt --model model.pt --group decay='*.weight' --group no_decay='*' -o fitted.pt
      statekit fit optimizer.pt --model model.pt --trainable 'layers.*.weight' --optimizer muon --momentum-from exp_avg --group muon='*':lr=0.02,momentum=0.9 -o muon.pt
    """
    _jobs(jobs)
    from statekit.ops.fit import fit_file

    out = _output(fmt, json_out)
    show_plan = out.format == "table" and not dry_run
    result = fit_file(state, model, output, groups=group, trainable=trainable or (), frozen=frozen or (),
                      optimizer=optimizer, momentum_from=momentum_from, reset_step=reset_step, resize=resize,
                      dry_run=dry_run,
                      names=str(names) if names else None, names_order=names_order,
                      model_config=str(model_config) if model_config else None, trust_remote_code=trust_remote_code,
                      key=key, training_args=str(training_args) if training_args else None, progress=out.progress,
                      on_plan=(lambda plan: out.show("fit", plan)) if show_plan else None)
    if show_plan:
        from statekit.render.reports import fit_summary

        out.print(fit_summary(result))
    else:
        out.show("fit", result)


@app.command()
def doctor(
    state: Annotated[Path, typer.Argument(metavar="STATE", help="Optimizer state file (any supported format).")],
    model: Annotated[Path | None, typer.Option("--model", metavar="MODEL", help="The model it will be loaded into (burn .bpk with ParamIds, a torch state_dict, or .safetensors); a torch state's positions are named from it by solving order and shapes.")] = None,
    param: ParamOpt = None,
    names: NamesOpt = None,
    names_order: NamesOrderOpt = None,
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
    jobs: JobsOpt = None,
) -> int:
    """Find what bites when training resumes from STATE (and, with --model, into MODEL).

    NaN/Inf, all-zero moments after step 1, differing steps, ranks above 8, __rank vs shape,
    duplicate paths; with --model: orphaned state, parameters without state, shape mismatches
    (transposed ones named as such). Exit status: 0 clean, 1 problems found, 2 error.
    """
    _jobs(jobs)
    from statekit.ops.doctor import doctor_files

    out = _output(fmt, json_out)
    result = doctor_files(state, model, only=param, progress=lambda d, t: out.progress(d, t),
                          names=names, names_order=names_order)
    out.show("doctor", result)
    return 0 if result["clean"] else 1


@app.command()
def schedule(
    state: Annotated[Path, typer.Argument(metavar="STATE", help="A scheduler file (scheduler.pt / scheduler.bin, scheduler-N.bpk) or the folder holding it (an HF Trainer checkpoint-N/).")],
    output: Annotated[Path | None, typer.Option("-o", "--output", metavar="OUT", help="New folder the rewritten schedule is written to (for a folder STATE, with its other files copied).")] = None,
    max_steps: Annotated[int | None, typer.Option("--max-steps", metavar="N", help="The new horizon: the run's total updates.")] = None,
    extend: Annotated[int | None, typer.Option("--extend", metavar="K", help="The new horizon is the saved one plus K updates.")] = None,
    rule: Annotated[str, typer.Option("--rule", metavar="continue|fresh", help="continue: keep the lr now and decay from it over the new horizon (no jump); fresh: the lr a run started with the new horizon has at this step (the lr jumps).")] = "continue",
    horizon_was: Annotated[int | None, typer.Option("--horizon-was", metavar="N", help="The horizon the run was built with, where the files do not save it (burn: the config's num_iters).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the rewrite and the lrs it gives; write nothing.")] = False,
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Re-horizon a saved LR schedule for a run that goes on longer (--max-steps N or --extend K).

    The rule and its formula are printed with the lrs of the next updates. The input is never
    modified; OUT is a new folder, written whole or not at all.

    \b
      statekit schedule checkpoint-500 --max-steps 2000 -o checkpoint-500-long
      statekit schedule run/scheduler.pt --extend 1000 --rule fresh -o longer/
    """
    from statekit.ops.schedule_edit import rehorizon

    out = _output(fmt, json_out)
    result = rehorizon(state, output, max_steps=max_steps, extend=extend, rule=rule, dry_run=dry_run,
                       horizon_was=horizon_was)
    out.show("schedule", result)


@app.command()
def report(
    state: Annotated[Path, typer.Argument(metavar="STATE", help="Optimizer state file (any supported format).")],
    weights: Annotated[Path | None, typer.Option("--weights", metavar="MODEL", help="The model's weights at the same step: adds RMS(w) and the update:weight ratio lr·RMS(u + wd·w)/RMS(w).")] = None,
    against: Annotated[Path | None, typer.Option("--against", metavar="OTHER", help="An earlier state of the same model: per tensor log2 of RMS(v̂) now over then, the cosine of m, the step's change.")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", metavar="PAGE.html", help="Write the report as one self-contained HTML page (needs plotly: pip install 'statekit[report]').")] = None,
    param: ParamOpt = None,
    optimizer: OptimizerOpt = None,
    lr: LrOpt = None,
    betas: BetasOpt = None,
    eps: EpsOpt = None,
    weight_decay: WdOpt = None,
    amsgrad: AmsOpt = None,
    momentum: MomOpt = None,
    dampening: DampOpt = None,
    nesterov: NestOpt = None,
    key: KeyOpt = None,
    fmt: FormatOpt = None,
    json_out: JsonOpt = False,
    jobs: JobsOpt = None,
) -> None:
    """The health of an optimizer state: per tensor effective step sizes, ε-domination, update RMS,
    resets, the depth profile of the moments, and findings.

    Streams the state once. The hyperparameters are the file's (burn files store none: the
    defaults, said so, or the flags). Without -o: findings and per-layer charts that fit the
    terminal; --json for scripts. Formulas per family: docs/report.md.

    \b
      statekit report optim.pt --weights model.pt -o report.html
      statekit report optim-60.bpk --against optim-50.bpk
    """
    _jobs(jobs)
    from statekit.ops.options import given_hyperparams
    from statekit.ops.report import report_files

    out = _output(fmt, json_out)
    given = given_hyperparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                              momentum=momentum, dampening=dampening, nesterov=nesterov)
    if output is not None:
        from statekit.render.report_html import check_available

        check_available()
    result = report_files(state, weights=weights, against=against, key=key, progress=out.progress,
                          given=given, optimizer=optimizer, only=param)
    if output is not None:
        from statekit.render.report_html import write_page

        size = write_page(result, str(output))
        counts = {s: sum(1 for f in result.findings if f["severity"] == s) for s in ("error", "warning", "info")}
        out.info(f"wrote {output} ({size // 1024} KiB): {len(result.tensors)} tensors, "
                 f"{counts['error']} errors, {counts['warning']} warnings, {counts['info']} infos")
        return
    out.show("report", result, width=out.width)


def _json_requested(args: list[str]) -> bool:
    return "--json" in args or "--format=json" in args or any(
        a == "--format" and b == "json" for a, b in zip(args, args[1:], strict=False))


def _is_click(exc: BaseException, *names: str) -> bool:
    """click's exceptions by name: typer vendors its own copy of click, so classes differ."""
    return any(cls.__name__ in names and "click" in cls.__module__ for cls in type(exc).__mro__)


def _error(exc: BaseException, command: str | None) -> tuple[str, int] | None:
    """The one line and the exit code for an exception; None for a bug (an internal error).

    StatekitError → its message and exit code (UsageError 2, others 1); OSError → the file and
    the system's words, 1; click's usage errors → one line with where to find help, 2; Ctrl-C →
    130. diff and doctor answer with 0/1, so their errors exit 2.
    """
    if isinstance(exc, KeyboardInterrupt) or _is_click(exc, "Abort"):
        return "interrupted", 130
    if _is_click(exc, "ClickException"):
        where = f"statekit {command} --help" if command else "statekit --help"
        return f"{exc.format_message()} (see {where})", exc.exit_code
    if isinstance(exc, StatekitError):
        message, code = str(exc), exc.exit_code
    elif isinstance(exc, OSError):
        message, code = f"{exc.filename}: {exc.strerror or exc}" if exc.filename else str(exc.strerror or exc), 1
    else:
        return None
    return message, 2 if command in ERRORS_EXIT_2 else code


def _report(message: str, code: int, json_errors: bool) -> int:
    """Print the error: one line, or with --json one JSON object, on stderr."""
    if json_errors:
        import json

        sys.stderr.write(json.dumps({"error": " ".join(message.split()), "exit_code": code}) + "\n")
        sys.stderr.flush()
    else:
        error_line(message)
    return code


def _app_for(args: list[str]) -> typer.Typer:
    """The app to run ``args`` with: only the command asked for when it comes first.

    typer builds a click command for every registered command before it parses anything
    (measured: 15 ms of a 0.14 s ``statekit inspect``, the signatures of all nine). When the first
    argument names a command, an app holding only that command parses, checks and helps the same
    way; anything else (``--help``, ``--version``, an unknown command, shell completion) gets
    the whole app.
    """
    if not args or any(k.startswith("_STATEKIT_COMPLETE") for k in os.environ):
        return app
    chosen = [c for c in app.registered_commands
              if (c.name or c.callback.__name__.lower().replace("_", "-")) == args[0]]
    if len(chosen) != 1:
        return app
    single = copy.copy(app)
    single.registered_commands = chosen
    return single


def _run(args: list[str] | None = None) -> int:
    """Run the CLI: every error becomes one line (JSON with --json) and an exit code, here only."""
    args = sys.argv[1:] if args is None else list(args)
    command = next((a for a in args if not a.startswith("-")), None)
    names_as_given()
    try:
        # a context of its own: what a command sets (--jobs) ends with it, also when run in-process
        rc = contextvars.copy_context().run(_app_for(args), args=args, standalone_mode=False, prog_name="statekit")
    except (Exception, KeyboardInterrupt) as exc:
        if _is_click(exc, "Exit"):
            return exc.exit_code
        known = _error(exc, command)
        debug = os.environ.get("STATEKIT_DEBUG") and not (known and known[1] == 130) and not _is_click(
            exc, "ClickException")
        if debug:
            raise
        if known is None:
            code = 2 if command in ERRORS_EXIT_2 else 1
            known = (f"internal error: {type(exc).__name__}: {exc} (run with STATEKIT_DEBUG=1 for the traceback)",
                     code)
        return _report(*known, _json_requested(args))
    return rc if isinstance(rc, int) else 0


@app.command()
def finalize(
    directory: Annotated[Path, typer.Argument(metavar="OUT", help="A DCP output directory written by several processes (--shard I/N).")],
) -> None:
    """Write a sharded DCP output's .metadata once every share's part is present and checked.

    The last share to finish does this by itself; run it after a share was re-run by hand, or to
    check that a multi-process conversion is complete.

    \b
      statekit finalize out/ckpt-dcp
    """
    from statekit.formats import dcp

    size = dcp.finalize(str(directory))
    Output(False).info(f"wrote {directory}/.metadata ({size} bytes): every part present")


def main() -> None:
    from statekit.atomic import exit_cleanly_on_sigterm

    global _ONE_COMMAND
    exit_cleanly_on_sigterm()  # SIGTERM unwinds like Ctrl-C: no temporary output file stays behind
    _ONE_COMMAND = True
    # statekit.entry paused the cycle collector for the imports: the modules, classes and functions
    # live until exit, so they leave the collector's view for good (collection resumes for the rest)
    gc.freeze()
    gc.enable()
    _exit(_run())


def _exit(code: int) -> None:
    """End the process with ``code`` once the output is flushed and the atexit handlers have run,
    without freeing every object one by one first: an inspect of 10,000 parameters holds some
    10^5 small objects (measured: 40 ms to free them, a tenth of the command). Only in a process of
    its own (stdout and stderr are the process's, no other thread alive) and once both are flushed;
    else (a caller that redirected them, a broken pipe) Python's own exit."""
    import atexit
    import threading

    if threading.active_count() > 1 or sys.stdout is not sys.__stdout__ or sys.stderr is not sys.__stderr__:
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        sys.exit(code)
    atexit._run_exitfuncs()
    os._exit(code)
