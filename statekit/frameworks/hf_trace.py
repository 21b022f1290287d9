"""How a model's forward uses each weight, seen by running it on the meta device.

A module's class says how *its* code uses a weight (``nn.Linear``: ``F.linear(x, W)``, so ``[out,
in]``), but the weights that matter most in new architectures sit in modules no table knows: a
mixture of experts' router (``MixtralTopKRouter``: a bare parameter passed to ``F.linear``), its
3-D experts (``[E, 2·I, H]``, indexed per expert and multiplied with ``bmm``), peft's trainable
token rows (copied into the embedding matrix before ``F.embedding``). The forward itself says how
each is used. :func:`trace` runs it once on the meta device, in fake-tensor mode (no byte is
allocated; transformers takes its tracing paths, as under ``torch.compile``), with a
``TorchFunctionMode`` that sees every ``F.linear``, ``F.embedding``, ``matmul``/``bmm``/grouped
``mm``, convolution and norm call and follows each parameter through the view-like operations
between (indexing leading dimensions, transposes, casts, chunks, reshapes that keep the trailing
dimensions, weight arithmetic of one shape such as DoRA's ``W + B·A``).

What it records per parameter is the use and which of the parameter's dimensions was the input
(contracted) one and which the output one; :func:`layouts` turns that into the layout names of
:mod:`statekit.frameworks.hf_model`. A parameter the forward never reaches, or reaches only
through operations not followed (``einsum``), gets no layout from the trace; two uses that
disagree are reported, never settled by a guess. Facts: ``../shared/docs/names-and-layouts.md`` §3, §7.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

LINEAR, EMBEDDING, CONV, NORM = "linear", "embedding", "conv", "norm"

# operations that keep a tensor's trailing dimensions where they were (casts, copies, views)
_SAME = frozenset({
    "to", "type", "type_as", "float", "half", "bfloat16", "double", "contiguous", "clone", "detach",
    "requires_grad_", "data", "expand", "expand_as", "repeat", "index_select", "narrow", "masked_fill",
    "clamp", "neg", "abs", "sign", "conj", "resolve_conj", "resolve_neg", "_to_copy",
})
# elementwise arithmetic: followed when the result has the weight's own shape (W + ΔW, W * s)
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
    "__truediv__", "__rtruediv__", "true_divide", "where", "lerp",
})
_RESHAPE = frozenset({"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as", "reshape_as"})
_SPLIT = frozenset({"chunk", "split", "tensor_split", "split_with_sizes", "unbind", "unsafe_chunk", "unsafe_split"})
_CAT = frozenset({"cat", "concat", "concatenate", "stack"})
_SWAP = frozenset({"transpose", "swapaxes", "swapdims", "transpose_"})
_MATMUL = frozenset({"matmul", "mm", "bmm", "__matmul__", "__rmatmul__"})
_ADDMM = frozenset({"addmm", "baddbmm", "addbmm"})
_GROUPED = frozenset({"grouped_mm", "_grouped_mm", "_scaled_grouped_mm"})
_CONV = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
_NORM = frozenset({"layer_norm", "group_norm", "batch_norm", "instance_norm", "rms_norm"})
_INDEX_INTO = frozenset({"index_copy", "index_add", "index_put", "scatter", "scatter_add", "masked_scatter"})


@dataclass(frozen=True)
class Link:
    """A tensor's trailing dimensions as dimensions of one parameter: ``rows`` / ``cols`` are the
    parameter dimensions the tensor's dims -2 / -1 are (None: not a dimension of the parameter)."""

    name: str
    rows: int | None
    cols: int | None

    def swapped(self) -> Link:
        return Link(self.name, self.cols, self.rows)


@dataclass
class Uses:
    """What the forward did with each parameter: ``{name: {(kind, out_dim, in_dim), ...}}``."""

    seen: dict[str, set] = field(default_factory=lambda: defaultdict(set))
    calls: int = 0

    def add(self, link: Link, kind: str, out: int | None, inp: int | None) -> None:
        self.seen[link.name].add((kind, out, inp))


class TraceError(Exception):
    """The forward could not be run on the meta device (the message says why)."""


def _name(func) -> str:
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # a property: Tensor.T, .mT, .data
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", "") or ""
    return name


def trace(model, params: dict[int, tuple[str, int]], make_inputs) -> Uses:
    """Run ``model`` forward on the meta device and record how each parameter is used.

    ``params``: ``{id(parameter): (name, rank)}`` of the parameters to follow; ``make_inputs()``
    returns the forward's keyword arguments (called inside the fake-tensor mode). Raises
    :class:`TraceError` when the forward cannot run there.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode

    follower = _Follower(model, params, torch)

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            result = func(*args, **kwargs)
            follower.uses.calls += 1
            try:
                follower.follow(_name(func), args, kwargs, result)
            except Exception:  # noqa: BLE001 - following is best effort: an op it misreads is not followed
                pass
            return result

    try:
        with FakeTensorMode(allow_non_fake_inputs=True), Mode(), torch.no_grad():
            model(**make_inputs())
    except Exception as exc:  # the model's own code on meta tensors: any failure is reported, never raised
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise TraceError(f"{type(exc).__name__}: {text}"[:300]) from None
    return follower.uses


class _Follower:
    """Each tensor the forward makes from a parameter, with that parameter's dimensions (its links),
    and the uses of the parameters at the calls that consume them."""

    def __init__(self, model, params: dict[int, tuple[str, int]], torch):
        self.torch = torch
        self.params = params
        self.objects = {id(p): p for p in model.parameters() if id(p) in params}
        self.links: dict[int, tuple[object, tuple[Link, ...]]] = {}  # id(tensor) -> (tensor, its links)
        self.uses = Uses()

    def of(self, t) -> tuple[Link, ...]:
        if not isinstance(t, self.torch.Tensor):
            return ()
        known = self.params.get(id(t))
        if known is not None and self.objects.get(id(t)) is t:
            name, rank = known
            return () if rank == 0 else (Link(name, rank - 2 if rank >= 2 else None, rank - 1),)
        entry = self.links.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else ()

    def keep(self, t, found) -> None:
        if isinstance(t, self.torch.Tensor) and found:
            self.links[id(t)] = (t, tuple(dict.fromkeys(found)))

    def follow(self, name: str, args, kwargs, result) -> None:
        if not self._consumed(name, args, kwargs, result) and isinstance(result, self.torch.Tensor | tuple | list):
            self._carried(name, args, kwargs, result)

    def _consumed(self, name: str, args, kwargs, result) -> bool:
        """The calls that use a weight: record how (True when ``name`` is one)."""
        def arg(i: int, *keys):
            return args[i] if len(args) > i else next((kwargs[k] for k in keys if k in kwargs), None)

        if name == "linear":
            for link in self.of(arg(1, "weight")):
                self.uses.add(link, LINEAR, link.rows, link.cols)
        elif name in _MATMUL or name in _ADDMM:
            self._product(name, args, result)
        elif name in _GROUPED:
            for link in self.of(arg(1, "mat2", "weight")):  # (S, in) × grouped (E, in, out)
                self.uses.add(link, LINEAR, link.cols, link.rows)
        elif name == "embedding":
            for link in self.of(arg(1, "weight")):
                self.uses.add(link, EMBEDDING, link.rows, link.cols)
        elif name in _CONV:
            for link in self.of(arg(1, "weight")):
                self.uses.add(link, CONV, None, None)
        elif name in _NORM:
            for value in list(args[1:]) + list(kwargs.values()):
                for link in self.of(value):
                    self.uses.add(link, NORM, None, None)
        else:
            return False
        return True

    def _product(self, name: str, args, result) -> None:
        a, b = (args[1], args[2]) if name in _ADDMM else (args[0], args[1])
        if name == "__rmatmul__":
            a, b = b, a
        la, lb = self.of(a), self.of(b)
        if la and lb:  # weight × weight (DoRA's B·A): the product's rows are a's, its columns b's
            if a.dim() >= 2 and b.dim() >= 2:
                self.keep(result, [Link(x.name, x.rows, None) for x in la] + [Link(x.name, None, x.cols) for x in lb])
            return
        if lb and b.dim() >= 2:  # x @ W: W's rows are contracted (in), its columns are out
            for link in lb:
                self.uses.add(link, LINEAR, link.cols, link.rows)
        if la and a.dim() >= 2:  # W @ x: W's columns are contracted (in), its rows are out
            for link in la:
                self.uses.add(link, LINEAR, link.rows, link.cols)

    def _carried(self, name: str, args, kwargs, result) -> None:
        """The operations that hand a weight on: the result's links."""
        torch = self.torch
        first = args[0] if args else None
        of, keep = self.of, self.keep
        if name in _SAME:
            keep(result, of(first))
        elif name in _ELEMENTWISE:
            keep(result, [x for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)
                          and isinstance(result, torch.Tensor) and tuple(t.shape) == tuple(result.shape) for x in of(t)])
        elif name in ("t", "T", "mT", "H", "mH", "adjoint"):
            if isinstance(first, torch.Tensor) and (first.dim() == 2 or name in ("mT", "mH", "adjoint")):
                keep(result, [x.swapped() for x in of(first)])
        elif name in _SWAP:
            n = first.dim()
            d0, d1 = (args[1] % n, args[2] % n) if len(args) >= 3 else (kwargs["dim0"] % n, kwargs["dim1"] % n)
            if {d0, d1} == {n - 2, n - 1}:
                keep(result, [x.swapped() for x in of(first)])
            elif d0 < n - 2 and d1 < n - 2:
                keep(result, of(first))
        elif name == "permute":
            dims = args[1:] if len(args) > 2 or not isinstance(args[1], tuple | list) else tuple(args[1])
            n = first.dim()
            dims = [d % n for d in dims]
            if set(dims[-2:]) <= {n - 2, n - 1}:
                keep(result, [_permuted(x, dims[-2:], n) for x in of(first)])
        elif name == "__getitem__":
            keep(result, _indexed(of(first), first, args[1], torch))
        elif name in _RESHAPE and isinstance(result, torch.Tensor):
            keep(result, _reshaped(of(first), first, result))
        else:
            self._gathered(name, args, kwargs, result, first)

    def _gathered(self, name: str, args, kwargs, result, first) -> None:
        """Pieces and joins of weights: splits, concatenations, rows copied into a weight."""
        torch = self.torch
        if name in _SPLIT:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            for piece in result if isinstance(result, tuple | list) else ():
                if name == "unbind" and isinstance(first, torch.Tensor) and dim % first.dim() >= first.dim() - 2:
                    continue
                self.keep(piece, self.of(first))
        elif name in _CAT:
            tensors = first if isinstance(first, tuple | list) else ()
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if name == "stack" and isinstance(result, torch.Tensor) and dim % result.dim() >= result.dim() - 2:
                return
            self.keep(result, [x for t in tensors if isinstance(t, torch.Tensor)
                               and t.dim() == result.dim() - (name == "stack") for x in self.of(t)])
        elif name in _INDEX_INTO:
            source = args[3] if len(args) > 3 else kwargs.get("source", kwargs.get("src", kwargs.get("values")))
            found = list(self.of(first))
            if isinstance(source, torch.Tensor) and isinstance(first, torch.Tensor) and source.dim() == first.dim():
                found += list(self.of(source))
            self.keep(result, found)


def _permuted(link: Link, last: list[int], n: int) -> Link:
    by_dim = {n - 2: link.rows, n - 1: link.cols}
    return Link(link.name, by_dim[last[0]], by_dim[last[1]])


def _indexed(found: tuple[Link, ...], t, key, torch) -> list[Link]:
    """``t[key]``'s links: each of the result's last two dimensions that is one of ``t``'s last two
    (a slice keeps a dimension; integers, ``None`` and index tensors make or drop others)."""
    if not found or not isinstance(t, torch.Tensor):
        return []
    dims = _index_dims(key if isinstance(key, tuple) else (key,), t.dim(), torch)
    if dims is None or not dims:
        return []
    n = t.dim()
    out = []
    for x in found:
        by_dim = {n - 2: x.rows, n - 1: x.cols}
        rows = by_dim.get(dims[-2]) if len(dims) >= 2 and dims[-2] is not None else None
        cols = by_dim.get(dims[-1]) if dims[-1] is not None else None
        if rows is not None or cols is not None:
            out.append(Link(x.name, rows, cols))
    return out


def _index_dims(items: tuple, n: int, torch) -> list[int | None] | None:
    """For ``t[items]`` (``t`` of rank ``n``): each result dimension's dimension of ``t`` (None: a
    new one), by numpy's rules (advanced indices broadcast together, placed where they stand when
    adjacent, else first). None when the key is not one statekit follows."""
    def consumes(i) -> int:
        if i is None or i is Ellipsis:
            return 0
        if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            return i.dim()
        return 1

    def advanced(i) -> bool:
        return isinstance(i, torch.Tensor | list) and not (isinstance(i, torch.Tensor) and i.dim() == 0
                                                            and i.dtype != torch.bool)

    items = list(items)
    if sum(1 for i in items if i is Ellipsis) > 1:
        return None
    used = sum(consumes(i) for i in items)
    if used > n:
        return None
    fill = [slice(None)] * (n - used)
    items = (items[:items.index(Ellipsis)] + fill + items[items.index(Ellipsis) + 1:]) if Ellipsis in items \
        else items + fill
    out: list = []
    where: list[int] = []
    width = 0
    d = 0
    any_advanced = any(advanced(i) for i in items)  # then integers count as advanced indices too (numpy)
    for i in items:
        if i is None:
            out.append(None)
        elif isinstance(i, slice):
            out.append(d)
            d += 1
        elif (isinstance(i, int) or (isinstance(i, torch.Tensor) and not advanced(i))) and not any_advanced:
            d += 1
        elif isinstance(i, int) or isinstance(i, torch.Tensor) and not advanced(i):
            where.append(len(out))
            out.append("adv")
            d += 1
        elif advanced(i):
            where.append(len(out))
            width = max(width, i.dim() if isinstance(i, torch.Tensor) and i.dtype != torch.bool else 1)
            out.append("adv")
            d += consumes(i)
        else:
            return None
    if where:
        adjacent = where == list(range(where[0], where[0] + len(where)))
        rest = [x for x in out if x != "adv"]
        at = where[0] if adjacent else 0
        out = rest[:at] + [None] * width + rest[at:]
    return out


def _reshaped(found: tuple[Link, ...], t, result) -> list[Link]:
    """A row-major reshape keeps the last dimension when its size is unchanged, and the last two
    when both sizes are."""
    if not found or t.dim() == 0 or result.dim() == 0:
        return []
    if t.dim() >= 2 and result.dim() >= 2 and tuple(t.shape[-2:]) == tuple(result.shape[-2:]):
        return list(found)
    if t.shape[-1] == result.shape[-1]:
        return [Link(x.name, None, x.cols) for x in found]
    return []


# ----------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Traced:
    """A parameter's layout as the forward shows it (``layout``: :mod:`hf_model`'s names, None when
    the forward does not decide it), with the uses in words for plans and refusals."""

    layout: str | None
    words: str
    conflict: str | None = None


def layout_of(rank: int, seen: set, names) -> Traced:
    """The layout ``seen`` (a parameter's uses) gives a parameter of ``rank`` (``names``: the
    layout constants of hf_model, passed to keep this module free of it)."""
    out_in, in_out, embedding, norm, conv, experts, experts_in_out = names
    linear = {(o, i) for kind, o, i in seen if kind == LINEAR}
    kinds = {kind for kind, _, _ in seen}
    if not seen:
        return Traced(None, "no F.linear, F.embedding, matrix product, convolution or norm takes it (statekit follows "
                            "a weight through indexing, transposes, casts and reshapes to those)")
    if kinds == {CONV}:
        return Traced(conv, "a convolution's weight")
    if kinds == {NORM}:
        return Traced(norm, "a norm's weight")
    orient = set()
    for o, i in linear:
        if rank == 2:
            orient.add(out_in if (o, i) in ((0, 1), (0, None), (None, 1)) else
                       in_out if (o, i) in ((1, 0), (1, None), (None, 0)) else "?")
        elif rank == 3:
            orient.add(experts if (o, i) in ((1, 2), (1, None), (None, 2)) else
                       experts_in_out if (o, i) in ((2, 1), (2, None), (None, 1)) else "?")
        else:
            orient.add("?")
    if EMBEDDING in kinds:
        rows = {(o, i) for kind, o, i in seen if kind == EMBEDDING}
        if rank == 2 and rows <= {(0, 1), (None, 1)} and orient <= {out_in} and kinds <= {EMBEDDING, LINEAR}:
            said = "F.embedding's weight" + (" (also the output layer's F.linear weight: tied)" if orient else "")
            return Traced(embedding, said)
        return Traced(None, "", conflict=f"used as an embedding and as {_words(kinds - {EMBEDDING}, orient)}")
    if kinds - {LINEAR}:
        return Traced(None, "", conflict=f"used as {', '.join(sorted(kinds))}")
    if len(orient) != 1 or "?" in orient:
        return Traced(None, "", conflict=f"used as a linear map in {len(orient)} orientations "
                                         f"({', '.join(sorted(_orient_words(o) for o in orient))})")
    (only,) = orient
    return Traced(only, f"{_orient_words(only)} as the forward multiplies it")


def _orient_words(layout: str) -> str:
    return {"out_in": "[out, in]", "in_out": "[in, out]", "experts": "[experts, out, in]",
            "experts_in_out": "[experts, in, out]"}.get(layout, "in no orientation statekit follows")


def _words(kinds, orient) -> str:
    return ", ".join(sorted(kinds)) + (f" ({', '.join(sorted(_orient_words(o) for o in orient))})" if orient else "")
