"""Megatron's names made global: layer and expert indices, and the legacy rank folders.

A legacy checkpoint's ``model`` dict is one rank's: its layer indices count from the start of
its pipeline stage (or virtual chunk), its expert indices from the start of its expert-parallel
rank (``/work/shared/docs/megatron-formats.md`` §1.2, §4.5, §7.7). The rules here are Megatron's
``get_transformer_layer_offset`` (uniform, virtual-pipeline and uneven first/last-stage splits,
``account_for_embedding/loss_in_pipeline_split``) and ``ep_rank × E/EP + e``.

The API (stable; ``mcore-dist`` builds on it):

- ``layer_offset(cfg, pp_rank, vp_stage=None) -> int``;
- ``globalize(name, cfg, pp_rank, vp_stage, ep_rank) -> str``: a local name made global
  (``decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight`` → layer and expert global);
- ``RankDir`` and ``parse_rank_dir(name, cfg) -> RankDir``: ``mp_rank_TT[_PPP][_EEE]`` resolved
  with PP and EP from args (``mp_rank_00_001`` is (TP0, PP1) or (TP0, EP1): args decide).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from statekit.errors import FormatError
from statekit.frameworks.megatron.config import MegatronConfig

_LAYER = re.compile(r"(^|\.)(decoder\.layers|layers)\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def layer_offset(cfg: MegatronConfig, pp_rank: int, vp_stage: int | None = None) -> int:
    """The global index of local layer 0 on pipeline rank ``pp_rank`` (virtual chunk ``vp_stage``)."""
    pp = cfg.pp or 1
    if pp == 1 and not cfg.vp:
        return 0
    layers = cfg.need("num_layers", "global layer indices")
    vp = cfg.vp
    if vp is not None and vp_stage is None:
        raise FormatError("a virtual-pipeline checkpoint needs the chunk of each model entry (model0, model1, …)",
                          cfg.source)
    if cfg.pipeline_layout:
        raise FormatError("args.pipeline_model_parallel_layout is set: statekit does not read custom pipeline "
                          "layouts yet", cfg.source)
    if pp == 1:
        return 0
    first, last = cfg.first_stage_layers, cfg.last_stage_layers
    if first is not None or last is not None:
        middle_stages = pp - (first is not None) - (last is not None)
        first_n, last_n = first or 0, last or 0
        middle = layers - first_n - last_n
        middle_rank = pp_rank if first is None else pp_rank - 1
        if vp is not None:
            first_v, last_v, middle_v = first_n // vp, last_n // vp, middle // vp
            total = first_v + middle_v + last_v
            if pp_rank == 0:
                return vp_stage * total
            return vp_stage * total + first_v + middle_rank * (middle_v // middle_stages)
        per_rank = middle // middle_stages if middle_stages > 0 else 0
        return 0 if pp_rank == 0 else middle_rank * per_rank + first_n
    total_layers = layers + bool(cfg.account_for_embedding) + bool(cfg.account_for_loss)
    per_rank = total_layers // pp
    if vp is not None:
        offset = vp_stage * (total_layers // vp) + pp_rank * (per_rank // vp)
        first_chunk = vp_stage == 0 and pp_rank == 0
    else:
        offset = pp_rank * per_rank
        first_chunk = pp_rank == 0
    if cfg.account_for_embedding and not first_chunk:
        offset -= 1
    return offset


def globalize(name: str, cfg: MegatronConfig, pp_rank: int, vp_stage: int | None, ep_rank: int) -> str:
    """``name`` with its layer index (and expert index) made global."""
    m = _LAYER.search(name)
    if m:
        offset = layer_offset(cfg, pp_rank, vp_stage)
        if offset:
            index = int(m.group(3)) + offset
            name = f"{name[:m.start(3)]}{index}{name[m.end(3):]}"
    ep = cfg.ep or 1
    local = _LOCAL_EXPERT.search(name) or _GROUPED_EXPERT.search(name)
    if local and ep > 1:
        experts = cfg.need("num_experts", "global expert indices")
        if experts % ep:
            raise FormatError(f"args.num_experts {experts} is not a multiple of EP {ep}", cfg.source)
        index = int(local.group(2)) + ep_rank * (experts // ep)
        name = f"{name[:local.start(2)]}{index}{name[local.end(2):]}"
    return name


@dataclass(frozen=True)
class RankDir:
    name: str
    tp: int
    pp: int
    ep: int


def parse_rank_dir(name: str, cfg: MegatronConfig | None) -> RankDir:
    """``mp_rank_TT[_PPP][_EEE]`` as (tp, pp, ep): Megatron writes ``_PPP`` only when PP > 1 and
    ``_EEE`` only when EP > 1 (``get_checkpoint_name``), so one three-digit part is the PP rank or
    the EP rank as args say; without args only ``mp_rank_TT`` and ``mp_rank_TT_PPP_EEE`` are certain."""
    m = _RANK_DIR.match(name)
    if not m:
        raise FormatError(f"{name!r} is not a Megatron rank folder (mp_rank_TT[_PPP][_EEE])")
    tp, a, b = int(m.group(1)), m.group(2), m.group(3)
    if b is not None:
        return RankDir(name, tp, int(a), int(b))
    if a is None:
        return RankDir(name, tp, 0, 0)
    if cfg is None or (cfg.pp is None and cfg.ep is None):
        raise FormatError(f"{name}: one three-digit part is the pipeline or the expert rank, and args do not say "
                          "which (no pipeline_model_parallel_size / expert_model_parallel_size)")
    pp, ep = cfg.pp or 1, cfg.ep or 1
    if pp > 1 and ep > 1:
        raise FormatError(f"{name}: args say PP {pp} and EP {ep}, so the folder should have both parts")
    if pp > 1:
        return RankDir(name, tp, int(a), 0)
    if ep > 1:
        return RankDir(name, tp, 0, int(a))
    raise FormatError(f"{name}: args say PP 1 and EP 1, so the folder should be mp_rank_{tp:02d}")


# a parameter's TP axis by the end of its Megatron name (None: replicated over TP); first match wins
TP_AXES: tuple[tuple[re.Pattern, int | None], ...] = (
    (re.compile(r"\.layer_norm_(weight|bias)$"), None),
    (re.compile(r"(layernorm|_norm|\.norm)\.(weight|bias)$"), None),
    (re.compile(r"\.router\.(weight|bias)$"), None),
    (re.compile(r"\.linear_qkv\.(weight|bias)$"), 0),
    (re.compile(r"\.linear_fc1\.(weight|bias)\d*$"), 0),
    (re.compile(r"(^|\.)word_embeddings\.weight$"), 0),
    (re.compile(r"(^|\.)output_layer\.weight$"), 0),
    (re.compile(r"(^|\.)position_embeddings\.weight$"), None),
    (re.compile(r"\.linear_(proj|fc2)\.weight\d*$"), 1),
    (re.compile(r"\.linear_(proj|fc2)\.bias\d*$"), None),
)
_FC1 = re.compile(r"\.linear_fc1\.(weight|bias)\d*$")


def tp_axis(name: str) -> tuple[bool, int | None]:
    """(known, axis) of a parameter by its name (:data:`TP_AXES`)."""
    for pattern, axis in TP_AXES:
        if pattern.search(name):
            return True, axis
    return False, None
