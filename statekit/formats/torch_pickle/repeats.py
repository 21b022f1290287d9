"""Where the opcode loop hands a container's items to templates (:mod:`.template`): which
templates to try at an item's start, and when to learn new ones.

The loop calls :meth:`Repeats.run` after each MARK: a container's items may start there. From
then on, at each item's start, the templates learned so far whose first opcode is the item's are
tried; one that fits runs as many items as fit. When none fits, the item is read as a segment
(:func:`.segment.read_segment`) and learned: a *general* template, whose slots are all its
literals (it fits any item written with the same opcodes), and, where the next item also fits
it, a *specialised* one whose slots are only the literals that changed between the two (a
name, an offset): everything else is fixed and computed once.

An item where learning fails returns to the loop, and learning at that first opcode and MARK
depth waits until the loop has gone a distance on (256 bytes, doubling with each failure in a
row up to 1 MiB: a container whose items are too large to learn does not hold back the one
nested in its first item); so
does learning that succeeds but whose templates are not used again (more than eight learned at
one first opcode, running fewer than four items each). A pickle with nothing repeating thus
pays little for the looks, and one that repeats after a while is still found.

Items that take turns (a weight's 2-D sizes, then a bias's 1-D ones) are met by remembering, per
family, the family that ran the next item, and trying it first. Specialising that finds nothing
worth fixing backs off as a short-lived specialised template does."""

from __future__ import annotations

import pickle

from statekit.formats.torch_pickle.segment import read_segment
from statekit.formats.torch_pickle.structure import MAX_DEPTH, MAX_STEPS
from statekit.formats.torch_pickle.template import Template, build, slot_ops

_FRAME = pickle.FRAME[0]
# opcodes that end a container's items or never start one: no item to learn there
_NOT_FIRST = frozenset(op[0] for op in (
    pickle.SETITEMS, pickle.APPENDS, pickle.ADDITEMS, pickle.TUPLE, pickle.LIST, pickle.DICT, pickle.STOP,
    pickle.POP_MARK, pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE, pickle.SETITEM, pickle.APPEND,
    pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3, pickle.REDUCE, pickle.BUILD, pickle.PROTO))
_MAX_FAMILIES = 8  # templates of different opcodes kept per first opcode
_MAX_SPECIAL = 4  # specialised templates kept per general one
_FIRST_GAP, _MAX_GAP = 256, 1 << 20  # bytes learning waits after a failure, doubling


class _Family:
    """A general template and the specialised ones made from it (most recently run first)."""

    def __init__(self, general: Template):
        self.general = general
        self.special: list[Template] = []
        self.wait = self.misses = 0  # back-off of specialising: calls to skip, short-lived ones so far
        self.after: _Family | None = None  # the family whose templates ran the item after this one's last run


class Repeats:
    """The templates of one pickle, and when to try them."""

    def __init__(self) -> None:
        self.families: dict[int, list[_Family]] = {}
        # per (first opcode, MARK depth): where learning may be tried again, the distance it
        # waited last; per first opcode: families learned, items their templates ran
        self.next_try: dict[tuple[int, int], int] = {}
        self.gap: dict[tuple[int, int], int] = {}
        # likewise, where the templates learned fit no item and learning waits: when they are tried again
        self.idle_until: dict[tuple[int, int], int] = {}
        self.idle_gap: dict[tuple[int, int], int] = {}
        self.learned, self.ran = [0] * 256, [0] * 256
        self.items = self.ops = 0  # items and opcodes run by templates (the tests count them)
        self.prev: _Family | None = None  # the family that ran the last item (within one run)

    def run(self, u, data, pos: int, stack: list, steps: int) -> tuple[int, int]:
        """Items from ``pos`` (a container's items start or go on there) by templates while
        they fit: (the offset the loop goes on from, its opcode count)."""
        end = len(data)
        if type(u.memo) is not list or len(u.metastack) >= MAX_DEPTH:
            return pos, steps
        self.prev = None
        while pos < end:
            code = data[pos]
            if code == _FRAME:  # between items: what the loop's FRAME does, reading 8 bytes
                if pos + 9 > end:
                    break
                pos, steps = pos + 9, steps + 1
                continue
            if code in _NOT_FIRST:
                break
            where = (code, len(u.metastack))
            if pos < self.idle_until.get(where, 0):
                break
            done = self.known(u, data, pos, stack, steps)
            if done is None:
                if pos < self.next_try.get(where, 0):  # no template fits, and learning waits: so do they
                    self.idle_gap[where] = min(2 * self.idle_gap.get(where, 0) or _FIRST_GAP, _MAX_GAP)
                    self.idle_until[where] = pos + self.idle_gap[where]
                    break
                done = self.learn(u, data, pos, stack, steps)
                if done is None or (self.learned[code] > 8 and self.ran[code] < 4 * self.learned[code]):
                    self.gap[where] = min(2 * self.gap.get(where, 0) or _FIRST_GAP, _MAX_GAP)
                    self.next_try[where] = pos + self.gap[where]
                    if done is None:
                        break
                else:
                    self.gap[where] = 0
            if where in self.idle_gap:
                del self.idle_gap[where]
            pos, steps = done
        return pos, steps

    def attempt(self, t: Template, u, data, pos: int, stack: list, steps: int) -> tuple[int, int] | None:
        """``t`` run from ``pos`` within the opcode budget and MARK depth: (offset, steps) after
        the items it ran, None when it ran none."""
        if len(u.metastack) + t.seg.marks > MAX_DEPTH:
            return None
        after, count = t.run(u, data, pos, stack, (MAX_STEPS - steps) // t.ops)
        if not count:
            return None
        t.items += count
        self.items += count
        self.ops += count * t.ops
        self.ran[data[pos]] += count
        return after, steps + count * t.ops

    def known(self, u, data, pos: int, stack: list, steps: int) -> tuple[int, int] | None:
        """The item at ``pos`` run by a template learned so far: first the family that followed
        the last one's family before (items that alternate, a weight's 2-D shape then a bias's
        1-D one, then cost one attempt each), then the others, most recently run first."""
        families = self.families.get(data[pos])
        if not families:
            return None
        prev, order = self.prev, list(families)
        follow = prev.after if prev is not None else None
        if follow in order:
            order.remove(follow)
            order.insert(0, follow)
        for fam in order:
            if not fam.general.valid(u):
                families.remove(fam)
                continue
            done = self.attempt_family(fam, u, data, pos, stack, steps)
            if done:
                families.remove(fam)
                families.insert(0, fam)
                if prev is not None:
                    prev.after = fam
                self.prev = fam
                return done
        return None

    def attempt_family(self, fam: _Family, u, data, pos: int, stack: list, steps: int) -> tuple[int, int] | None:
        """``fam``'s specialised templates (most recently run first), a new one, then its general one."""
        for t in fam.special:
            if t.valid(u) and (done := self.attempt(t, u, data, pos, stack, steps)):
                fam.special.remove(t)
                fam.special.insert(0, t)
                return done
        special = self.specialise(u, data, pos, fam)
        return (special and self.attempt(special, u, data, pos, stack, steps)) or self.attempt(
            fam.general, u, data, pos, stack, steps)

    def specialise(self, u, data, pos: int, fam: _Family) -> Template | None:
        """A specialised template of ``fam`` for the items from ``pos``, when the general one fits
        this item and the next and the literals they share are worth fixing; else None."""
        if fam.wait:
            fam.wait -= 1
            return None
        if fam.special and fam.special[0].items < 32:  # the last one ran few items: wait longer
            fam.misses = min(2 * fam.misses + 1, 255)
            fam.wait = fam.misses
        else:
            fam.misses = 0
        g = fam.general
        var = _varying(g, data, pos, len(u.memo))
        seg = None if var is None or var == g.var else (
            g.seg if g.seg.start == pos else read_segment(data, pos, len(u.memo)))
        special = None if seg is None else build(u, data, seg, var)
        if special is None:  # nothing worth fixing here (or the next item differs): wait longer too
            fam.misses = min(2 * fam.misses + 1, 255)
            fam.wait = fam.misses
            return None
        fam.special.insert(0, special)
        del fam.special[_MAX_SPECIAL:]
        return special

    def learn(self, u, data, pos: int, stack: list, steps: int) -> tuple[int, int] | None:
        """Read the item at ``pos`` as a segment, make its templates, run them."""
        seg = read_segment(data, pos, len(u.memo))
        if seg is None:
            return None
        general = build(u, data, seg, slot_ops(seg))
        if general is None:
            return None
        fam = _Family(general)
        self.learned[data[pos]] += 1
        families = self.families.setdefault(data[pos], [])
        families.insert(0, fam)
        del families[_MAX_FAMILIES:]
        special = self.specialise(u, data, pos, fam)
        return (special and self.attempt(special, u, data, pos, stack, steps)) or self.attempt(
            general, u, data, pos, stack, steps)


def _varying(general: Template, data, pos: int, n: int) -> frozenset[int] | None:
    """The literals (op indices) that differ between the item at ``pos`` and the next, both
    fitting ``general``; None when the next does not fit it."""
    one = general.slot_bytes(data, pos, n)
    two = one and general.slot_bytes(data, one[1], n + general.puts)
    if not two:
        return None
    ops = sorted(general.var)
    return frozenset(k for k, a, b in zip(ops, one[0], two[0], strict=True) if a != b)
