"""The inverse of the legacy reader's joins: a whole-model Megatron tensor → one rank's shard.

The legacy reader (:mod:`.legacy`) names every rank-local parameter globally (:mod:`.names`) and
joins its TP shards (:func:`.legacy.joined`); this module goes the other way, for a target
TP × PP × EP layout (``/work/shared/docs/megatron-formats.md`` §1.1, §4.4, §4.5):

- **TP**: the axis is the reader's (:func:`.legacy.tp_axis`, by name): column-parallel weights
  (``linear_qkv``, ``linear_fc1``, the embedding and output layer) are cut on axis 0, row-parallel
  weights (``linear_proj``, ``linear_fc2``) on axis 1, norms, row-parallel biases and the router
  replicated; SwiGLU's ``linear_fc1`` ``[W; V]`` gives rank ``r`` ``[W_r; V_r]``
  (:func:`tp_shard`). A name with no known axis is refused when TP > 1.
- **PP**: uniform stages only (``num_layers / PP`` layers each, :func:`stage_of_layer`); uneven
  first/last stages, custom layouts, virtual pipelines and ``account_for_*_in_pipeline_split``
  are refused in one line. The embedding is the first stage's, the final norm and the output
  layer the last stage's (:func:`place`).
- **EP**: expert ``e`` of ``E`` is local expert ``e mod E/EP`` of EP rank ``e div E/EP``.
- **Vocabulary padding**: Megatron pads the vocabulary to a multiple of
  ``make_vocab_size_divisible_by × TP`` (:func:`.config.padded_vocab`); :func:`resize_rows` adds
  zero rows (what Megatron's own load fills them with) or removes rows that :func:`rows_zero` has
  checked hold zeros (a row holding anything is refused by the writer, never dropped).

Everything here is pure (numpy arrays in, arrays out); the writer (:mod:`.write_legacy`) calls it
one parameter at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from statekit.errors import FormatError
from statekit.frameworks.megatron.config import MegatronConfig
from statekit.frameworks.megatron.legacy import _FC1, tp_axis
from statekit.lazy import numpy as np

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..+)$")
_LOCAL_EXPERT = re.compile(r"(\.experts\.local_experts\.)(\d+)(\.)")
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_FIRST_STAGE = ("embedding.",)
_LAST_STAGE = ("decoder.final_layernorm.", "decoder.final_norm.", "output_layer.")
VOCAB_ROWS = re.compile(r"(^|\.)(word_embeddings|output_layer)\.weight$")


def is_swiglu_fc1(name: str, cfg: MegatronConfig) -> bool:
    return bool(cfg.swiglu) and bool(_FC1.search(name))


def tp_shard(array: np.ndarray, name: str, tp: int, rank: int, swiglu: bool = False) -> np.ndarray:
    """Rank ``rank``'s shard of the whole tensor ``array`` of parameter ``name`` at TP ``tp``
    (the inverse of :func:`.legacy.joined`); a replicated tensor is returned whole."""
    if tp == 1:
        return array
    known, axis = tp_axis(name)
    if not known:
        raise FormatError(f"parameter {name}: statekit knows no TP axis for it; refusing to guess how to cut it "
                          f"into {tp} shards")
    if axis is None:
        return array
    size = array.shape[axis]
    if swiglu:
        if axis != 0 or size % (2 * tp):
            raise FormatError(f"parameter {name}: SwiGLU rows {size} do not split into 2 × TP {tp} equal parts")
        half = size // 2
        part = half // tp
        w = array[rank * part:(rank + 1) * part]
        v = array[half + rank * part:half + (rank + 1) * part]
        return np.concatenate([w, v], axis=0)
    if size % tp:
        raise FormatError(f"parameter {name}: axis {axis} of size {size} does not split into TP {tp} equal shards")
    part = size // tp
    index = [slice(None)] * array.ndim
    index[axis] = slice(rank * part, (rank + 1) * part)
    return np.ascontiguousarray(array[tuple(index)])


def check_uniform(cfg: MegatronConfig, what: str) -> None:
    """Refuse the pipeline layouts statekit does not write (one line naming the arg)."""
    for arg, value in (("decoder_first_pipeline_num_layers", cfg.first_stage_layers),
                       ("decoder_last_pipeline_num_layers", cfg.last_stage_layers),
                       ("pipeline_model_parallel_layout", cfg.pipeline_layout),
                       ("virtual_pipeline_model_parallel_size", cfg.vp),
                       ("account_for_embedding_in_pipeline_split", cfg.account_for_embedding or None),
                       ("account_for_loss_in_pipeline_split", cfg.account_for_loss or None)):
        if value is not None:
            raise FormatError(f"{what}: args.{arg} is {value!r}: statekit writes uniform pipeline stages only")


def stage_of_layer(layer: int, num_layers: int, pp: int) -> tuple[int, int]:
    """(pipeline rank, local index) of global layer ``layer`` with ``num_layers / pp`` per stage."""
    if num_layers % pp:
        raise FormatError(f"{num_layers} layers do not split into PP {pp} equal stages")
    per = num_layers // pp
    if not 0 <= layer < num_layers:
        raise FormatError(f"layer {layer} is outside the model's {num_layers} layers")
    return layer // per, layer % per


@dataclass(frozen=True)
class Place:
    """Where a global name lives at the target layout: the stage, the EP rank (None: every EP
    rank holds it) and its rank-local name."""

    pp: int
    ep: int | None
    local: str


def place(name: str, cfg: MegatronConfig, num_layers: int, pp: int, ep: int) -> Place:
    """The target stage, EP rank and local name of the global ``name`` (any state_dict key:
    parameters, ``_extra_state`` entries, buffers)."""
    stage = None
    local = name
    m = _LAYER.match(name)
    if m:
        stage, index = stage_of_layer(int(m.group(2)), num_layers, pp)
        local = f"{m.group(1)}{index}{m.group(3)}"
    elif name.startswith(_FIRST_STAGE):
        stage = 0
    elif name.startswith(_LAST_STAGE):
        stage = pp - 1
    else:
        raise FormatError(f"{name}: statekit does not know which pipeline stage holds it")
    ep_rank = None
    e = _LOCAL_EXPERT.search(local) or _GROUPED_EXPERT.search(local)
    if e:
        experts = cfg.need("num_experts", "the expert-parallel split")
        if experts % ep:
            raise FormatError(f"args.num_experts {experts} is not a multiple of EP {ep}")
        per = experts // ep
        ep_rank, index = divmod(int(e.group(2)), per)
        local = f"{local[:e.start(2)]}{index}{local[e.end(2):]}"
    return Place(stage, ep_rank, local)


def resize_rows(array: np.ndarray, rows: int) -> np.ndarray:
    """``array`` with ``rows`` rows: zero rows appended, or trailing rows removed (the caller has
    checked those hold zeros: :func:`rows_zero`)."""
    have = array.shape[0]
    if rows == have:
        return array
    if rows < have:
        return array[:rows]
    pad = np.zeros((rows - have, *array.shape[1:]), dtype=array.dtype)
    return np.concatenate([array, pad], axis=0)


def rows_zero(array: np.ndarray, start: int) -> int:
    """How many elements of rows ``start…`` are not zero (0: removing them loses nothing)."""
    tail = array[start:]
    return int(np.count_nonzero(tail != 0))
