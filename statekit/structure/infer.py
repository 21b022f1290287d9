"""Inferring the structural map from the weights before and after the user's own conversion.

Structure first, in the order that costs least:

1. **whole tensors** — a new tensor equal to an old one (renamed, reshaped) or to an old matrix
   transposed, found by a key of sampled elements and proved by comparing all the bits;
2. **lines** — the rest are cut into rows (or columns), each looked up among the old tensors' rows
   and columns (:mod:`statekit.structure.lines`): joins along any axis, GQA interleaves, permuted rows
   (RoPE), stacked or unstacked experts, transposed joins (torch weights onto a burn model), grown
   tensors whose last rows or columns come from nowhere (fresh state);
3. **vectors beside their matrix** — a fused bias follows the rows its weight was built from;
4. **grown in place** — an old tensor of the same name that is the new one's leading block.

Value-identical candidates are settled by names and structure alone
(:mod:`statekit.structure.settle`); every line-built tensor is proved bit for bit
(:mod:`statekit.structure.proof`) and its coverage checked (:mod:`statekit.structure.coverage`).
Whatever cannot be produced is refused, all problems at once, naming the tensor and the first element
that disagrees.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from statekit.errors import MappingError
from statekit.lazy import numpy as np
from statekit.structure import access, coverage, proof, readahead
from statekit.structure.access import Weight
from statekit.structure.lines import (
    COL,
    ROW,
    LineIndex,
    Lines,
    Picked,
    pick,
    pieces_of,
    runs,
    uncovered_tail,
)
from statekit.structure.pieces import Piece, StructureMap, TargetMap, transposed, whole
from statekit.structure.settle import settle

MAX_PROBLEMS = 8


class Unproduced(MappingError):
    """Some new tensors cannot be produced from the old weights; ``related``: whether the two sets of
    weights share values at all (:attr:`Inference.related`)."""

    def __init__(self, message: str, path: str | None, related: bool):
        super().__init__(message, path)
        self.related = related


@dataclass
class Inference:
    """The inferred map, the old tensors nothing reads, how each tie was settled, and whether the old
    and the new weights are related: some new tensor that is not one value throughout (an untrained
    norm, a zero bias: what any two initialisations share) was produced, or its keys found candidates
    among the old tensors' whole tensors or lines. Weights that are not related share no values: the
    only pairs a caller may move by path instead."""

    map: StructureMap
    unused: list[str] = field(default_factory=list)
    settled: dict[str, str] = field(default_factory=dict)
    related: bool = True


@dataclass
class _Shaped:  # a stand-in with a path and a shape, for vectors read as lines of one element
    path: str
    shape: tuple[int, ...]


class _Inferrer:
    def __init__(self, old: list[Weight], new: list[Weight], names: Callable[[str], set[str]] | None,
                 declared_new: list[str], advance):
        self.old = {w.path: w for w in old}
        self.new = new
        self.names = names
        self.declared_new = declared_new
        self.advance = advance
        self.targets: dict[str, TargetMap] = {}
        self.sources: dict[str, list[str]] = {}  # target → old paths, once settled
        self.picked: dict[str, tuple[Lines, Picked, list]] = {}  # line-built targets, for their vectors
        self.settled: dict[str, str] = {}
        self.problems: list[str] = []
        self.used: set[str] = set()
        self.found: set[str] = set()  # new tensors whose keys found old candidates (or that were produced)
        self.near: dict[str, tuple[TargetMap, str]] = {}  # new tensors a candidate's proof refuted: its map, why tried
        self._keys: dict[tuple, int] = {}
        self._equals: dict[int, int] = {}  # id of a tensor → id of one proved bit-equal to it (union-find)
        self._by_size: dict[tuple, list[Weight]] = {}  # (dtype, numel) → old tensors: candidates by size
        for o in old:
            if o.comparable:
                self._by_size.setdefault((o.dtype, o.numel), []).append(o)

    # ------------------------------------------------------------------ the phases
    def run(self, where: str | None, cold: set[int] = frozenset()) -> Inference:
        todo = [w for w in self.new if self._comparable(w)]
        if cold:
            _ask_for_keys([*self.old.values(), *todo], cold)
        early = _EarlyKeys(self._likely_lines(todo))
        try:
            todo = [w for w in todo if not self._whole(w)]
            todo = self._by_lines(todo, early)
        finally:
            early.stop()
        todo = [w for w in todo if not self._vector(w)]
        todo = [w for w in todo if not self._grown_in_place(w)]
        for w in todo:
            self._unproduced(w)
        self._grown_beside_unread_lines()
        if self.problems:
            more = f" (+{len(self.problems) - MAX_PROBLEMS} more)" if len(self.problems) > MAX_PROBLEMS else ""
            raise Unproduced("the new weights cannot be produced from the old ones: "
                             + "; ".join(self.problems[:MAX_PROBLEMS]) + more, where, self._related())
        sizes = {p: w.numel for p, w in self.old.items()}
        for t in self.targets.values():
            coverage.check(t, sizes, where)
        ordered = {w.path: self.targets[w.path] for w in self.new if w.path in self.targets}
        unused = [p for p in self.old if p not in self.used]
        return Inference(StructureMap(ordered, "weights"), unused, self.settled, self._related())

    def _related(self) -> bool:
        """Whether a new tensor that is not one value throughout found old candidates (see :class:`Inference`)."""
        return any(not _constant(w) for w in self.new if w.path in self.found)

    def _likely_lines(self, todo: list[Weight]) -> list[tuple[Weight, int]]:
        """(old tensor, orientation) whose line keys the line phase will want, as far as the whole-tensor
        keys tell before any proof (the same keys the whole phase reads): old tensors no new one has
        the key of (nor, transposed, the key of a new one of the reversed shape), cut along the
        lengths of the new tensors no old one has the key of. Their keys are read on a thread while the
        whole tensors are proved (:class:`_EarlyKeys`); a wrong guess costs a tensor's keys, never the
        map: the index takes only what it would have read."""
        olds = [o for o in self.old.values() if o.comparable and o.numel]
        new_sizes, old_sizes = {(w.dtype, w.numel) for w in todo}, set(self._by_size)
        new_keys = {self._key(w, None) for w in todo if (w.dtype, w.numel) in old_sizes}
        old_keys = {self._key(o, None) for o in olds if (o.dtype, o.numel) in new_sizes}
        lone = [w for w in todo if w.numel and ((w.dtype, w.numel) not in old_sizes
                                                or self._key(w, None) not in old_keys)]
        wanted = {w.shape[-1] if w.shape else 1 for w in lone} | {w.shape[-2] for w in lone if len(w.shape) >= 2}
        flipped = {}  # old shape → the keys of the new 2-D tensors of that shape reversed
        for w in todo:
            if len(w.shape) == 2 and (w.dtype, w.numel) in old_sizes:
                flipped.setdefault((w.dtype, w.shape[::-1]), []).append(w)

        def transposable(o: Weight) -> bool:  # (the keys the whole phase's transposed candidates read)
            return any(self._key(o, w.shape) == self._key(w, None) for w in flipped.get((o.dtype, o.shape), ()))

        likely = [o for o in olds if not transposable(o) and ((o.dtype, o.numel) not in new_sizes
                                                              or self._key(o, None) not in new_keys)]
        return [(o, orient) for o in likely for orient in (ROW, COL)
                if (len(o.shape) >= 2 or orient == ROW) and Lines(o.shape, orient).length in wanted]

    def _comparable(self, w: Weight) -> bool:
        if w.comparable:
            return True
        self.problems.append(f"{w.path}: its dtype {w.dtype} cannot be compared bit for bit")
        return False

    # ------------------------------------------------------------------ 1. whole tensors
    def _whole(self, w: Weight) -> bool:
        candidates = [(o, "whole") for o in self._whole_candidates(w)]
        found = [(o, how) for o, how in candidates if self._equal(w, o, transposed_=False)]
        if len(w.shape) == 2:
            flat = {o.path for o, _ in found}
            flipped = [(o, "transposed") for o in self._transposed_candidates(w)]
            candidates += flipped
            found += [(o, how) for o, how in flipped if o.path not in flat and self._equal(w, o, transposed_=True)]
        if candidates:
            self.found.add(w.path)
        if not found:
            if candidates:  # (its key says it is one of them; the proof says not: remembered for the refusal)
                o, how = candidates[0]
                piece = transposed(o.path, o.shape) if how == "transposed" else whole(o.path, o.shape)
                self.near.setdefault(w.path, (TargetMap(w.path, w.shape, [piece]), f"its key is {o.path}'s"))
            return False
        chosen = found[0]
        if len(found) > 1:
            names = [o.path for o, _ in found]
            pick_, how = settle(w.path, names, self.names, self.sources)
            if pick_ is None:
                self.problems.append(f"{w.path}: value-identical old tensors {_listed(names)} could each be it; "
                                     "settle it with --rename (or give it as --new)")
                return True
            self.settled[w.path] = how
            chosen = next(f for f in found if f[0].path == pick_)
        o, how = chosen
        if how == "transposed":
            t = TargetMap(w.path, w.shape, [transposed(o.path, o.shape)], kind="transposed")
        else:
            t = TargetMap(w.path, w.shape, [whole(o.path, o.shape)], kind="whole" if o.shape == w.shape else "reshaped")
        self._keep(t)
        return True

    def _whole_candidates(self, w: Weight) -> list[Weight]:
        same_size = self._by_size.get((w.dtype, w.numel), [])
        if not same_size:
            return []
        key = self._key(w, None)
        return [o for o in same_size if self._key(o, None) == key]

    def _transposed_candidates(self, w: Weight) -> list[Weight]:
        same_size = [o for o in self._by_size.get((w.dtype, w.numel), []) if o.shape == w.shape[::-1]]
        if not same_size:
            return []
        key = self._key(w, None)
        return [o for o in same_size if self._key(o, w.shape) == key]

    def _key(self, w: Weight, transposed_to: tuple | None) -> int:
        k = (id(w), transposed_to)
        if k not in self._keys:
            order = access.transposed_positions(transposed_to) if transposed_to else None
            self._keys[k] = access.whole_key(w, order)
        return self._keys[k]

    def _equal(self, new: Weight, old: Weight, transposed_: bool) -> bool:
        """Whether ``new`` holds the bits of ``old`` (transposed): proved, or known from proofs already
        made — bit equality is transitive, so a tensor proved equal to one of a set of tensors proved
        equal to each other equals them all (23 all-ones norms cost 45 proofs, not 529)."""
        if not transposed_ and self._root(id(new)) == self._root(id(old)):
            return True
        piece = transposed(old.path, old.shape) if transposed_ else whole(old.path, old.shape)
        t = TargetMap(new.path, new.shape, [piece])
        equal = proof.disagreement(t, new, {old.path: old}, self.advance) is None
        if equal and not transposed_:
            self._equals[self._root(id(new))] = self._root(id(old))
        return equal

    def _root(self, key: int) -> int:
        while key in self._equals:
            key = self._equals[key]
        return key

    # ------------------------------------------------------------------ 2. lines
    def _by_lines(self, todo: list[Weight], early: _EarlyKeys | None = None) -> list[Weight]:
        if not todo:
            return []
        index = self._index([o for p, o in self.old.items() if p not in self.used], todo, early)
        left: list[Weight] = []
        staged: list[tuple[Weight, object]] = []  # in order: outcomes, some with a proof under way
        try:
            for w in todo:
                staged.append((w, self._line_stage(w, index) if w.numel else None))
                while staged and (not _proving(staged[0][1]) or staged[0][1][-1].done()):  # (what is ready)
                    self._settle_line(*staged.pop(0), index, left)
            while staged:
                self._settle_line(*staged.pop(0), index, left)
        finally:  # (an error: the proofs still under way are stopped before the files may close)
            for _, outcome in staged:
                if _proving(outcome):
                    outcome[-1].cancel()
        return left

    def _line_stage(self, w: Weight, index: LineIndex):
        """:meth:`_line_map` up to the proof, which is left under way: ("proving", target, lines, picked,
        weights, proving), or the outcome when there is nothing to prove. The next tensor's keys are
        read while the cores compare this one."""
        found = self._line_choice(w, index)
        if found is None or found[0] == "problem":
            return found
        _, lines, picked = found
        t = self._line_target(w, index, lines, picked)
        return ("proving", t, lines, picked, index.weights, proof.start(t, w, self.old, self.advance))

    def _settle_line(self, w: Weight, staged, index: LineIndex, left: list[Weight]) -> None:
        """A staged outcome taken, in the tensors' order; a proof that failed is made again the whole
        way (:meth:`_line_map`: the rows' map after refuted columns, and the message)."""
        outcome = staged
        if _proving(staged):
            outcome = ("proved", *staged[1:5]) if staged[5].result() is None else self._line_map(w, index)
        if outcome is None:
            left.append(w)
        elif outcome[0] == "problem":
            self.problems.append(outcome[1])
        else:
            _, t, lines, picked, weights = outcome
            self.picked[w.path] = (lines, picked, weights)
            self._keep(t)

    def _index(self, olds: list[Weight], todo: list[Weight], early: _EarlyKeys | None = None) -> LineIndex:
        """Old rows and columns of the lengths the new tensors' lines have (only those are read; those
        read early are taken from ``early``)."""
        wanted = {w.shape[-1] if w.shape else 1 for w in todo} | {w.shape[-2] for w in todo if len(w.shape) >= 2}
        index = LineIndex()
        for o in olds:
            if not o.comparable or not o.numel:
                continue
            orients = tuple(orient for orient in (ROW, COL)
                            if (len(o.shape) >= 2 or orient == ROW) and Lines(o.shape, orient).length in wanted)
            if orients:
                index.add(o, orients, early.take if early is not None else None)
        return index

    def _line_map(self, w: Weight, index: LineIndex):
        """What ``w``'s lines make of it: None (nothing), ("problem", message), or ("proved", target,
        lines, picked, weights). Columns are tried first (only a few rows are read); a column map the
        proof refutes (rows changed off the sampled ones) is followed by the rows' map before refusing."""
        found = self._line_choice(w, index)
        if found is None or found[0] == "problem":
            return found
        tried, lines, picked = found
        outcome = self._proved(w, index, lines, picked)
        if outcome[0] == "proved" or tried == ROW:
            return outcome
        found = self._lines_picked(w, index, ROW)  # (the columns' map refuted: the rows')
        if found is None or found[0] == "problem":
            return outcome
        lines, picked = found
        covered = int(picked.covered.sum())
        if covered == lines.count or (covered and uncovered_tail(picked, lines)):
            again = self._proved(w, index, lines, picked)
            if again[0] == "proved":
                return again
        return outcome

    def _line_choice(self, w: Weight, index: LineIndex):
        """The lines to build ``w`` from, before any proof: (the last orientation tried, lines, picked)
        — columns first, rows when the columns do not cover it —, ("problem", message), or None."""
        modes = (COL, ROW) if len(w.shape) >= 2 else (ROW,)
        best = partial = None
        for orient in modes:
            found = self._lines_picked(w, index, orient)
            if found is None:
                continue
            if found[0] == "problem":
                return found
            lines, picked = found
            covered = int(picked.covered.sum())
            if covered == lines.count:
                return orient, lines, picked
            if covered and uncovered_tail(picked, lines) and (best is None or covered > int(best[1].covered.sum())):
                best = (lines, picked)
            elif covered and (partial is None or covered > int(partial[1].covered.sum())):
                partial = (lines, picked)
        if best is None and partial is not None and not self._declared(w.path):
            return ("problem", self._same_name_difference(w)
                    or _partly(w, *partial, index, self._unread_lines(partial[1], index.weights)))
        if best is None:
            return None
        return ROW, *best

    def _lines_picked(self, w: Weight, index: LineIndex, orient: int):
        """(lines, picked) for ``w`` cut as ``orient``, ("problem", message) when ambiguous, or None
        (no old line is as long)."""
        lines = Lines(w.shape, orient)
        if lines.length not in index.lengths:  # (no old line is this long: its keys need not be read)
            return None
        picked = pick(index, lines.keys(w))
        if picked.ambiguous or picked.covered.any():
            self.found.add(w.path)
        if picked.ambiguous:
            line, cands = picked.ambiguous[0]
            names = sorted({index.weights[t].path for t, _, _ in cands})
            return ("problem", f"{w.path}: {'row' if orient == ROW else 'column'} {line} is equal to lines of "
                               f"{_listed(names)} alike and its neighbours do not settle which")
        return lines, picked

    def _line_target(self, w: Weight, index: LineIndex, lines: Lines, picked: Picked) -> TargetMap:
        t = TargetMap(w.path, w.shape, pieces_of(runs(picked), lines, index.weights),
                      new=(lines.count - int(picked.covered.sum())) * lines.length)
        t.kind = _kind(t, self.old, picked)
        return t

    def _proved(self, w: Weight, index: LineIndex, lines: Lines, picked: Picked):
        t = self._line_target(w, index, lines, picked)
        problem = proof.disagreement(t, w, self.old, self.advance)
        if problem:
            return ("problem", problem)
        return ("proved", t, lines, picked, index.weights)

    # ------------------------------------------------------------------ 3. vectors beside their matrix
    def _vector(self, w: Weight) -> bool:
        """A 1-D tensor whose sibling matrix was built line by line, with as many lines as it has elements
        (torch's rows, burn's columns): element i from the same-named vector of the old matrix whose
        line built line i."""
        if len(w.shape) != 1:
            return False
        module, _, leaf = w.path.rpartition(".")
        for path, (lines, picked, weights) in self.picked.items():
            if path.rpartition(".")[0] != module or lines.count != w.shape[0] or picked.tensor.min() < 0:
                continue
            vectors, numbers = [], {}
            for number in np.unique(picked.tensor):
                src = weights[int(number)]
                vec = self.old.get(f"{src.path.rpartition('.')[0]}.{leaf}")
                if vec is None or vec.shape != (Lines(src.shape, int(picked.orient[picked.tensor == number][0])).count,):
                    break
                numbers[int(number)] = len(vectors)
                vectors.append(_Shaped(vec.path, (vec.shape[0], 1)))
            else:
                as_elements = Picked(np.array([numbers[int(n)] for n in picked.tensor], np.int64),
                                     np.zeros_like(picked.orient), picked.line.copy(), [])
                t = TargetMap(w.path, w.shape, pieces_of(runs(as_elements), Lines((w.shape[0], 1), ROW), vectors))
                t.kind = self.targets[path].kind
                t.notes.append(f"its elements follow the lines of {path}")
                problem = proof.disagreement(t, w, self.old, self.advance)
                if problem is None:
                    self._keep(t)
                    return True
                self.found.add(w.path)  # (its sibling's lines lead to old vectors it does not hold)
                self.near.setdefault(w.path, (t, f"the {'rows' if lines.orient == ROW else 'columns'} of {path} "
                                                 "lead there"))
        return False

    # ------------------------------------------------------------------ 4. grown in place
    def _grown_in_place(self, w: Weight) -> bool:
        o = self._same_name(w.path)
        if o is None or o.path in self.used or len(o.shape) != len(w.shape) or o.dtype != w.dtype \
                or not all(a <= b for a, b in zip(o.shape, w.shape, strict=True)) or o.shape == w.shape or not o.numel:
            return False
        piece = Piece(o.path, o.shape, 0, _strides(o.shape), 0, _strides(w.shape))
        t = TargetMap(w.path, w.shape, [piece], new=w.numel - o.numel, kind="grown")
        if proof.disagreement(t, w, self.old, self.advance) is not None:
            return False
        self._keep(t)
        return True

    # ------------------------------------------------------------------ what is left
    def _declared(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, g) for g in self.declared_new)

    def _unproduced(self, w: Weight) -> None:
        """A new tensor nothing produced: new (fresh state) when declared so, or when no old tensor is
        like it (none of its name, none a proof was tried on); else a problem naming where it differs."""
        o = self._same_name(w.path)
        near = self.near.get(w.path)
        if self._declared(w.path) or (o is None and near is None):
            self.targets[w.path] = TargetMap(w.path, w.shape, [], new=w.numel, kind="new")
            return
        if o is None:
            problem = proof.disagreement(near[0], w, self.old, None)
            self.problems.append(f"{problem} ({near[1]}; no part of the old weights produces it): the conversion "
                                 "changed values; give it as --new GLOB only if it is meant to start fresh")
            return
        problem = self._same_name_difference(w)
        if problem:
            self.problems.append(problem)
        else:
            self.problems.append(f"{w.path} {list(w.shape)}: no part of the old weights produces it (the old "
                                 f"{o.path} is {o.dtype} {list(o.shape)}); give it as --new GLOB to start it fresh")

    def _same_name_difference(self, w: Weight) -> str | None:
        """Where a new tensor first differs from the old one of its name and shape (None: no such one)."""
        o = self._same_name(w.path)
        if o is None or o.shape != w.shape or o.dtype != w.dtype or not o.comparable:
            return None
        problem = proof.disagreement(TargetMap(w.path, w.shape, [whole(o.path, o.shape)]), w, self.old, None)
        return f"{problem} (no part of the old weights produces it)" if problem else None

    def _same_name(self, path: str) -> Weight | None:
        if path in self.old:
            return self.old[path]
        if self.names is not None:
            named = [o for p, o in self.old.items() if path in self.names(p)]
            if len(named) == 1:
                return named[0]
        return None

    def _keep(self, t: TargetMap) -> None:
        self.targets[t.path] = t
        self.sources[t.path] = t.sources
        self.used.update(t.sources)
        self.found.add(t.path)

    def _grown_beside_unread_lines(self) -> None:
        """A line-built tensor with lines from none of the old weights is grown only when the old tensors
        it reads are read whole: lines of them that go into no new tensor beside new lines are a value the
        conversion changed (qkv's last row edited leaves v's last row unread), refused naming the element."""
        for path, (lines, picked, weights) in self.picked.items():
            t = self.targets[path]
            if not t.new:
                continue
            unread = self._unread_lines(picked, weights)
            if not unread:
                continue
            w = next(n for n in self.new if n.path == path)
            missing = int(np.flatnonzero(~picked.covered)[0])
            word = "row" if lines.orient == ROW else "column"
            left = [f"{len(ls)} {word}{'s' if len(ls) > 1 else ''} of {weights[n].path}" for (n, _), ls in unread.items()]
            verb = "goes" if len(unread) == 1 and len(next(iter(unread.values()))) == 1 else "go"
            said = (f"{int(picked.covered.sum())} of its {lines.count} {word}s come from "
                    f"{_listed(_sources_of(picked, weights))}, {word} {missing} from none of the old weights, while "
                    f"{_listed(left)} {verb} into none of the new tensors")
            self.problems.append(_changed_line(w, lines, missing, _candidates(None, unread), weights, said)
                                 or f"{path}: {said}: a tensor grows only beside old tensors read whole; give it "
                                    "as --new GLOB only if it is meant to start fresh")

    def _unread_lines(self, picked: Picked, weights: list[Weight]) -> dict[tuple[int, int], list[int]]:
        """(tensor number, orientation) → the lines of the old tensors ``picked`` reads that no new tensor
        reads (an old tensor some other target reads otherwise than by lines counts as read whole)."""
        whole = {s for p, t in self.targets.items() if p not in self.picked for s in t.sources}
        out = {}
        for number in np.unique(picked.tensor[picked.covered]):
            n = int(number)
            orient = int(picked.orient[picked.tensor == n][0])
            if weights[n].path in whole:
                continue
            read = np.zeros(Lines(weights[n].shape, orient).count, bool)
            for other in [picked] + [q for _, q, ws in self.picked.values() if ws is weights]:
                read[other.line[(other.tensor == n) & (other.orient == orient)]] = True
            if not read.all():
                out[(n, orient)] = [int(i) for i in np.flatnonzero(~read)]
        return out


def infer(old: list[Weight], new: list[Weight], *, names: Callable[[str], set[str]] | None = None,
          declared_new: list[str] = (), advance=None, where: str | None = None) -> Inference:
    """The map that builds every tensor of ``new`` from ``old``, proved; MappingError listing what cannot be."""
    with readahead.reading_ahead(_files(old) + _files(new)) as cold:
        return _Inferrer(old, new, names, list(declared_new), advance).run(where, cold)


class _EarlyKeys:
    """Line keys of old tensors read on a thread while the whole tensors are proved (the comparisons
    wait on memory, the keys on the page tables: the two go on at once). :meth:`take` gives a tensor's
    keys when they were read (waiting for the thread where it is still at them), else None."""

    def __init__(self, wanted: list[tuple[Weight, int]]):
        self._wanted = wanted
        self._asked = {(id(w), orient) for w, orient in wanted}
        self._keys: dict[tuple[int, int], object] = {}
        self._stop = threading.Event()
        self._thread = None
        if wanted:
            self._thread = threading.Thread(target=self._run, name="statekit-keys", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for w, orient in self._wanted:
            if self._stop.is_set():
                return
            try:
                self._keys[(id(w), orient)] = Lines(w.shape, orient).keys(w)
            except Exception:  # noqa: BLE001 (read again where needed: the error is raised there)
                return

    def take(self, w: Weight, orient: int):
        if self._thread is None or (id(w), orient) not in self._asked:  # (a set: thousands of tensors)
            return None
        self._thread.join()
        return self._keys.get((id(w), orient))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def _ask_for_keys(weights: list[Weight], cold: set[int]) -> None:
    """The pages of the whole-tensor keys' samples of ``weights`` in the files ``cold`` holds (not in
    the page cache), asked for at once."""
    for w in weights:
        span = w.ref.span
        if not w.comparable or not w.numel or not access.on_disk(w) or span.file.fh.fileno() not in cold:
            continue
        readahead.will_need(span.file.fh.fileno(), span.offset + access.positions(w.numel, access.WHOLE_SAMPLES)
                            * w.itemsize)


def _files(weights: list[Weight]) -> list[tuple[int, int, int]]:
    """(fd, first byte, end) of the files ``weights`` lie in, in the order first met."""
    spans: dict[int, list[int]] = {}
    for w in weights:
        span = w.ref.span
        if span is None or w.ref.array_loader is not None or span.file.fh.closed:
            continue
        fd = span.file.fh.fileno()
        lo, hi = spans.setdefault(fd, [span.offset, span.offset + span.length])
        spans[fd] = [min(lo, span.offset), max(hi, span.offset + span.length)]
    return [(fd, lo, hi) for fd, (lo, hi) in spans.items()]


def _proving(staged) -> bool:
    return staged is not None and staged[0] == "proving"


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


MAX_COMPARED = 64  # old lines a changed line is compared with, to name the element that differs


def _partly(w: Weight, lines: Lines, picked: Picked, index: LineIndex, unread: dict) -> str:
    """A new tensor some of whose lines come from the old weights and some from nowhere: the first such
    line compared, element by element, with the old line it is closest to among the one its neighbours'
    run leads to and the old lines no new line was built from (``unread``), naming the element."""
    word = "row" if lines.orient == ROW else "column"
    missing = int(np.flatnonzero(~picked.covered)[0])
    said = (f"{int(picked.covered.sum())} of its {lines.count} {word}s come from "
            f"{_listed(_sources_of(picked, index.weights))}, {word} {missing} from none of the old weights")
    guess = _expected_line(picked, missing)
    changed = _changed_line(w, lines, missing, _candidates(guess, unread), index.weights, said, guess)
    return changed or (f"{w.path}: {said}: the conversion changed values; give it as --new GLOB only if it is "
                       "meant to start fresh")


def _sources_of(picked: Picked, weights: list[Weight]) -> list[str]:
    return sorted({weights[int(t)].path for t in np.unique(picked.tensor[picked.covered])})


def _candidates(guess: tuple[int, int, int] | None, unread: dict) -> list[tuple[int, int, int]]:
    """Old lines to compare a changed line with: ``guess`` first, then the unread lines, those of the
    guess's tensor nearest to it first (at most :data:`MAX_COMPARED`)."""
    out = [guess] if guess is not None else []
    rest = [(n, orient, line) for (n, orient), ls in unread.items() for line in ls if (n, orient, line) != guess]
    if guess is not None:
        rest.sort(key=lambda c: (c[:2] != guess[:2], abs(c[2] - guess[2])))
    return (out + rest)[:MAX_COMPARED]


def _changed_line(w: Weight, lines: Lines, missing: int, candidates, weights: list[Weight], said: str,
                  guess: tuple[int, int, int] | None = None) -> str | None:
    """Line ``missing`` of ``w`` beside the candidate old line that agrees with it in the most elements
    (the first on a tie: ``guess``, where its neighbours' run leads): the first element where they differ,
    with both values (None when no candidate is as long)."""
    new_line = _line_bits(w, lines, missing)
    best = None
    for n, orient, line in candidates:
        src = weights[n]
        src_lines = Lines(src.shape, orient)
        if not 0 <= line < src_lines.count or src_lines.length != lines.length:
            continue
        old_line = _line_bits(src, src_lines, line)
        differ = np.flatnonzero(new_line != old_line)
        if differ.size and (best is None or differ.size < best[0]):
            best = (differ.size, src, src_lines, (n, orient, line), old_line, int(differ[0]))
    if best is None:
        return None
    _, src, src_lines, chosen, old_line, at = best
    word = "row" if lines.orient == ROW else "column"
    which = f"where its neighbours' {word}s lead" if chosen == guess else f"in a {word} no new tensor reads"
    return (f"{w.path}{_element(lines, missing, at, w.shape)} is {_as_value(w, new_line[at])} in the new weights, "
            f"but {src.path}{_element(src_lines, chosen[2], at, src.shape)}, {which}, holds "
            f"{_as_value(src, old_line[at])} ({said}): the conversion changed values; give it as --new GLOB only "
            "if it is meant to start fresh")


def _expected_line(p: Picked, i: int) -> tuple[int, int, int] | None:
    """Where the run of the lines before (or after) line ``i`` would have continued."""
    for step in (1, -1):
        j, k = i - step, i - 2 * step
        if 0 <= j < p.tensor.size and p.tensor[j] >= 0:
            run = 0 <= k < p.tensor.size and p.tensor[k] == p.tensor[j] and p.orient[k] == p.orient[j]
            stride = int(p.line[j] - p.line[k]) * step if run else 1
            return int(p.tensor[j]), int(p.orient[j]), int(p.line[j]) + step * stride
    return None


def _line_bits(w: Weight, lines: Lines, line: int) -> np.ndarray:
    start, stride = lines.offset(line), lines.elem_stride
    if stride == 1:
        return w.read(start, lines.length)
    with w.mapped() as m:  # (a column: one element a row, read from the file's pages)
        return np.array(m.array[start : start + stride * (lines.length - 1) + 1 : stride])


def _constant(w: Weight) -> bool:
    """Whether every element of ``w`` has the same bits (an untrained norm, a zero bias)."""
    first = None
    for _, bits in w.chunks(1 << 18):
        if first is None and bits.size:
            first = bits[0]
        if bits.size and (bits != first).any():
            return False
    return True


def _element(lines: Lines, line: int, at: int, shape) -> list[int]:
    from statekit.structure.pieces import unravel

    return list(unravel(lines.offset(line) + at * lines.elem_stride, shape))


def _as_value(w: Weight, bits) -> str:
    return repr(np.array([bits], dtype=w.bits).view(_numpy_dtype(w))[0].item())


def _numpy_dtype(w: Weight):
    from statekit import dtypes

    return dtypes.numpy_dtype(w.dtype)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


def _kind(t: TargetMap, old: dict[str, Weight], picked: Picked) -> str:
    """What a line-built target is, in the words the plan shows."""
    sources = t.sources
    chosen = picked.tensor[picked.covered]
    stretches = 1 + int((chosen[1:] != chosen[:-1]).sum()) if chosen.size else 0
    if t.new and len(sources) == 1:
        return "grown"
    if len(sources) > 1:
        ranks = {len(old[s].shape) for s in sources}
        if ranks == {len(t.shape) - 1}:
            return "stacked"
        return "interleaved" if stretches > len(sources) else "fused"
    src = old[sources[0]]
    if len(src.shape) == len(t.shape) + 1:
        return "unstacked"
    if src.numel > t.numel:
        return "split"
    return "permuted" if len(t.pieces) == 1 and t.pieces[0].src_strides != _strides(t.pieces[0].shape) else "moved"

