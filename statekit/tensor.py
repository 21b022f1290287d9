"""Lazy tensors: a name, a dtype, a shape, and bytes that are read only when asked for.

Containers hand out :class:`TensorRef` objects. Writers and scans never ask for a whole tensor:
they iterate :meth:`TensorRef.iter_bytes` (raw bytes) or :meth:`TensorRef.pieces` (flat arrays
of elements), which read the file with ``pread`` in bounded pieces (:class:`FileSpan`), so no map
stays resident and memory is one piece, whatever the file's size. :meth:`TensorRef.numpy` still
gives the whole tensor for the few users that need it (replay, small scalars).

Where a tensor's bytes come from, most direct first:

- ``span``: a contiguous little-endian byte range of an input file (burnpack, torch zip,
  safetensors) — read with ``pread``;
- ``piece_source``: a function ``(elements) -> iterator of 1-D arrays`` (the transforms of
  :mod:`statekit.stream`: casts, transposes, resizes, NaN/Inf checks, averages);
- ``array_loader`` / ``loader`` / ``chunk_reader``: an in-memory array, a buffer, a byte stream.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from statekit import dtypes
from statekit.lazy import numpy as np

PIECE = 16 << 20  # bytes per piece: what the data path holds of one tensor at a time


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


class SourceFile:
    """An input file read with ``pread`` at explicit offsets (thread-safe: no shared position).

    Pieces already read are dropped from the page cache (``posix_fadvise(DONTNEED)``) when the
    file is larger than half the machine's memory, where caching it could only evict everything
    else; smaller files stay cached for the next command. ``STATEKIT_DROP_CACHE=1`` (or ``0``)
    forces the choice. The file object stays owned by whoever opened it.
    """

    def __init__(self, fh, path: str, size: int | None = None):
        self.fh = fh
        self.path = path
        size = os.fstat(fh.fileno()).st_size if size is None else size
        self.size = size
        forced = os.environ.get("STATEKIT_DROP_CACHE")
        self.drop_cache = forced == "1" if forced in ("0", "1") else size > _physical_memory() // 2
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass

    @classmethod
    def open(cls, path: str) -> SourceFile:
        return cls(open(path, "rb"), path)  # noqa: SIM115 - closed by close() or with the last span

    def close(self) -> None:
        self.fh.close()

    def pread(self, offset: int, n: int) -> bytes:
        """Exactly ``n`` bytes at ``offset`` (fewer only at the end of the file)."""
        if self.fh.closed:
            from statekit.errors import FormatError

            raise FormatError("file was closed before its tensors were read", self.path)
        fd = self.fh.fileno()
        data = os.pread(fd, n, offset)
        if len(data) < n and data:
            parts = [data]
            got = len(data)
            while got < n:
                more = os.pread(fd, n - got, offset + got)
                if not more:
                    break
                parts.append(more)
                got += len(more)
            data = b"".join(parts)
        if self.drop_cache and data:
            os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)
        return data

    def pread_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes at ``offset`` (``preadv`` into an existing buffer)."""
        if self.fh.closed:
            from statekit.errors import FormatError

            raise FormatError("file was closed before its tensors were read", self.path)
        fd = self.fh.fileno()
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if not n:
                from statekit.errors import FormatError

                raise FormatError(f"file ended while reading a tensor ({got} of {len(view)} bytes at offset "
                                  f"{offset})", self.path)
            got += n
        if self.drop_cache:
            os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)

    @contextlib.contextmanager
    def mapped(self, offset: int, n: int) -> Iterator[memoryview | None]:
        """``n`` bytes at ``offset`` mapped read-only for the block (None when they cannot be: past
        the end of the file, or no ``mmap``; then read them). Nothing is copied: the pages are
        the page cache's. The map is closed after the block — the caller drops every view of it
        first — and its pages are dropped from the cache as :meth:`pread` would."""
        import mmap

        fd = self.fh.fileno()
        if self.fh.closed or n <= 0 or os.fstat(fd).st_size < offset + n:
            yield None
            return
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        try:
            region = mmap.mmap(fd, offset + n - start, flags=flags, prot=mmap.PROT_READ, offset=start)
        except (OSError, ValueError):
            yield None
            return
        view = memoryview(region)[offset - start :]
        try:
            yield view
        finally:
            with contextlib.suppress(BufferError):  # a view still held elsewhere: closed when collected
                view.release()
                region.close()
            if self.drop_cache:
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)


@dataclass(frozen=True, slots=True)
class FileSpan:
    """``length`` contiguous bytes at ``offset`` of a :class:`SourceFile`."""

    file: SourceFile
    offset: int
    length: int

    @classmethod
    def at(cls, file: SourceFile, offset: int, length: int) -> FileSpan:
        """``FileSpan(file, offset, length)``, the same object built in a third of the time: the
        slots set through their descriptors, not the frozen ``__init__``'s ``object.__setattr__``
        per field (a .pt of 10^6 views makes one a view)."""
        span = _new_object(cls)
        _SET_FILE(span, file)
        _SET_OFFSET(span, offset)
        _SET_LENGTH(span, length)
        return span

    def read(self, lo: int = 0, n: int | None = None) -> bytes:
        n = self.length - lo if n is None else n
        data = self.file.pread(self.offset + lo, n)
        if len(data) != n:
            from statekit.errors import FormatError

            raise FormatError(f"file ended while reading a tensor ({len(data)} of {n} bytes at offset "
                              f"{self.offset + lo})", self.file.path)
        return data

    def chunks(self, size: int, ring: int = 0) -> Iterator[bytes | memoryview]:
        """The bytes in pieces of at most ``size``. With ``ring`` > 0 the pieces are read into
        ``ring`` reused buffers (no fresh memory, no page faults per piece): piece ``k`` stays
        valid only until piece ``k + ring`` is read, so only a consumer that holds fewer than
        ``ring`` pieces at once may ask for it (:func:`statekit.stream.ordered` does)."""
        if not ring or self.length <= size:
            for lo in range(0, self.length, size):
                yield self.read(lo, min(size, self.length - lo))
            return
        buffers = [memoryview(bytearray(size)) for _ in range(ring)]
        for k, lo in enumerate(range(0, self.length, size)):
            view = buffers[k % ring][: min(size, self.length - lo)]
            self.file.pread_into(view, self.offset + lo)
            yield view


_new_object = object.__new__
_SET_FILE, _SET_OFFSET, _SET_LENGTH = (getattr(FileSpan, name).__set__ for name in ("file", "offset", "length"))


def run_length(run: FileSpan | int) -> int:
    """A run's bytes: a file span's length, or an int (that many zero bytes)."""
    return run if isinstance(run, int) else run.length


MIN_RUN = 16 << 10  # the least mean bytes per run worth reading run by run (else pieces, as before)


def file_runs(ref: TensorRef) -> list[FileSpan | int] | None:
    """``ref``'s bytes (as :meth:`TensorRef.iter_bytes` gives them) as runs back to back — file
    spans, and ints for so many zero bytes (a bucket's padding) — or None where they are not known
    to be: a plain span, or what its ``runs`` answers (checked to add up to the tensor's size)."""
    if ref.array_loader is not None:
        return None
    if ref.span is not None:
        return [ref.span] if ref.loader is None else None
    if ref.runs is None:
        return None
    spans = ref.runs()
    if spans is None:
        return None
    return spans if sum(run_length(r) for r in spans) == ref.nbytes else None


def worth_runs(runs: list[FileSpan | int]) -> bool:
    """Whether reading ``runs`` one by one beats pieces: few of them, or long ones on average."""
    return len(runs) <= 1 or sum(run_length(r) for r in runs) >= MIN_RUN * len(runs)


def extend_runs(out: list[FileSpan | int], runs: list[FileSpan | int]) -> list[FileSpan | int]:
    """``out`` with ``runs`` appended, neighbours in one file (or zeros) joined; returns ``out``."""
    for run in runs:
        cut_runs([run], 0, run_length(run), out)
    return out


def cut_runs(runs: list[FileSpan | int], lo: int, n: int, out: list[FileSpan | int]) -> bool:
    """Append bytes ``lo:lo + n`` of ``runs`` (back to back) to ``out`` (neighbours in one file,
    or zeros, joined); False where the runs hold fewer bytes."""
    pos = 0
    for run in runs:
        if n <= 0:
            break
        length = run_length(run)
        if lo < pos + length:
            start = lo - pos
            k = min(n, length - start)
            last = out[-1] if out else None
            if isinstance(run, int):
                if isinstance(last, int):
                    out[-1] = last + k
                else:
                    out.append(k)
            elif isinstance(last, FileSpan) and last.file is run.file and last.offset + last.length == run.offset + start:
                out[-1] = FileSpan.at(run.file, last.offset, last.length + k)
            else:
                out.append(FileSpan.at(run.file, run.offset + start, k))
            lo += k
            n -= k
        pos += length
    return n <= 0


def prefix_runs(spans: list[FileSpan | int], n: int) -> list[FileSpan | int]:
    """The first ``n`` bytes of ``spans`` (back to back) as runs."""
    out: list[FileSpan | int] = []
    cut_runs(spans, 0, n, out)
    return out


@dataclass(slots=True)  # no per-object __dict__: a .pt may hold 10^6 of them
class TensorRef:
    """A tensor whose bytes live somewhere else (a file span, a transform, an array).

    ``dtype`` is a statekit dtype name (see :mod:`statekit.dtypes`). ``loader`` returns the raw
    little-endian bytes (a ``bytes``/``memoryview``/array buffer) of exactly ``nbytes`` length;
    ``array_loader``, when given, returns the numpy array directly (used for strided views).
    ``resident`` is how many bytes producing the values holds at once beyond one piece (a
    transpose holds its source): :func:`statekit.stream.ordered` runs such tensors one at a time.
    """

    dtype: str
    shape: tuple[int, ...]
    loader: Callable[[], object] | None = None
    array_loader: Callable[[], np.ndarray] | None = field(default=None, repr=False)
    nbytes_hint: int | None = None
    info: dict = field(default_factory=dict)
    chunk_reader: Callable[[int], Iterator[bytes]] | None = field(default=None, repr=False)
    span: FileSpan | None = field(default=None, repr=False)
    piece_source: Callable[[int], Iterator[np.ndarray]] | None = field(default=None, repr=False)
    resident: int = 0
    checks: tuple | None = field(default=None, repr=False)  # (source, label, path) of stream.checked
    transposed: TensorRef | None = field(default=None, repr=False)  # the source of stream.transpose
    # the bytes ``iter_bytes`` gives are these file spans back to back (asked once, when written; None: they
    # are not): a writer reads them straight into its output (:func:`file_runs`)
    runs: Callable[[], list[FileSpan] | None] | None = field(default=None, repr=False)

    @classmethod
    def from_array(cls, array: np.ndarray, dtype: str | None = None) -> TensorRef:
        arr = np.asarray(array)
        name = dtype or dtypes.from_numpy(arr.dtype)
        if name not in ("QFloat",):
            want = dtypes.numpy_dtype(name)
            if arr.dtype != want:
                arr = arr.astype(want)
        return cls(dtype=name, shape=tuple(int(d) for d in arr.shape), array_loader=lambda: arr)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        if self.nbytes_hint is not None:
            return self.nbytes_hint
        if self.span is not None:
            return self.span.length
        return self.numel * dtypes.itemsize(self.dtype)

    def raw(self) -> memoryview:
        """The tensor's bytes, little-endian, C order (the whole tensor: prefer :meth:`iter_bytes`)."""
        if self.loader is not None:
            return memoryview(self.loader()).cast("B")
        if self.span is not None and self.array_loader is None:
            return memoryview(self.span.read())
        arr = np.ascontiguousarray(self.numpy())
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        return memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")

    def iter_bytes(self, chunk: int | None = None) -> Iterator[bytes | memoryview]:
        """The raw bytes in pieces of at most ``chunk`` bytes (default :data:`PIECE`)."""
        chunk = chunk or PIECE
        if self.span is not None:
            yield from self.span.chunks(chunk)
        elif self.chunk_reader is not None:
            yield from self.chunk_reader(chunk)
        elif self.piece_source is not None:
            for piece in self.piece_source(max(1, chunk // dtypes.itemsize(self.dtype))):
                if piece.size:
                    yield _as_bytes(piece)
        else:
            data = self.raw()
            for lo in range(0, len(data), chunk):
                yield data[lo : lo + chunk]

    def pieces(self, elements: int | None = None) -> Iterator[np.ndarray]:
        """The values flat in C order, as consecutive 1-D arrays of exactly ``elements`` (the last
        one shorter); default: :data:`PIECE` bytes' worth. Read-only views; never the whole file."""
        if self.dtype == "QFloat":
            raise ValueError("QFloat tensors are opaque bytes; use iter_bytes()")
        want = dtypes.numpy_dtype(self.dtype)
        elements = max(1, elements or PIECE // want.itemsize)
        if self.array_loader is None and (self.span is not None or self.chunk_reader is not None):
            raw = self.iter_bytes(elements * want.itemsize)
            source = (np.frombuffer(b, dtype=want) for b in raw)
            if self.span is not None:  # pread returns exact sizes
                yield from source
                return
        elif self.piece_source is not None:
            source = self.piece_source(elements)
        else:
            flat = self.numpy().reshape(-1)
            for lo in range(0, flat.size, elements):
                yield flat[lo : lo + elements]
            return
        yield from rechunk(source, elements)

    @contextlib.contextmanager
    def mapped(self) -> Iterator[np.ndarray | None]:
        """The values as a read-only numpy array over the file's own pages (``mmap``: nothing
        copied, nothing allocated), for the block; None when the tensor is not a plain span of
        its file (a cast, a transform, an array), or cannot be mapped: then use :meth:`numpy`.
        The caller drops every reference to the array before the block ends."""
        if self.span is None or self.array_loader is not None or self.loader is not None or self.dtype == "QFloat":
            yield None
            return
        with self.span.file.mapped(self.span.offset, self.span.length) as view:
            if view is None:
                yield None
                return
            yield np.frombuffer(view, dtype=dtypes.numpy_dtype(self.dtype)).reshape(self.shape)

    def numpy(self) -> np.ndarray:
        """The values as a numpy array of the statekit dtype (the whole tensor in memory)."""
        if self.array_loader is not None:
            return self.array_loader()
        if self.dtype == "QFloat":
            raise ValueError("QFloat tensors are opaque bytes; use raw()")
        if self.loader is None and self.span is None and self.piece_source is not None:
            out = np.empty(self.numel, dtype=dtypes.numpy_dtype(self.dtype))
            lo = 0
            for piece in self.piece_source(max(1, PIECE // out.itemsize)):
                out[lo : lo + piece.size] = piece
                lo += piece.size
            return out.reshape(self.shape)
        buf = self.raw()
        arr = np.frombuffer(buf, dtype=dtypes.numpy_dtype(self.dtype))
        return arr.reshape(self.shape)

    def cast(self, dtype: str) -> TensorRef:
        """A lazy value cast (``F16`` → ``F32`` widens exactly), piece by piece; ``self`` when
        already ``dtype``."""
        if dtype == self.dtype:
            return self
        want = dtypes.numpy_dtype(dtype)
        source = self

        def pieces(elements: int) -> Iterator[np.ndarray]:
            for piece in source.pieces(elements):
                yield piece.astype(want)

        return TensorRef(dtype=dtype, shape=tuple(self.shape), piece_source=pieces, resident=self.resident)

def spanned_ref(dtype: str, shape: tuple[int, ...], info: object, span: FileSpan) -> TensorRef:
    """``TensorRef(dtype, shape, info=info, span=span)``, the same object built in half the time:
    the slots stored directly, every other field its default (a .pt of 10^6 views makes one a
    view; the field list is checked against the dataclass's below, at import)."""
    ref = _new_object(TensorRef)
    ref.dtype = dtype
    ref.shape = shape
    ref.loader = None
    ref.array_loader = None
    ref.nbytes_hint = None
    ref.info = info
    ref.chunk_reader = None
    ref.span = span
    ref.piece_source = None
    ref.resident = 0
    ref.checks = None
    ref.transposed = None
    ref.runs = None
    return ref


def _check_spanned_ref() -> None:
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(TensorRef)}
    if hasattr(TensorRef, "__post_init__") or defaults != {
            "dtype": dataclasses.MISSING, "shape": dataclasses.MISSING, "loader": None, "array_loader": None,
            "nbytes_hint": None, "info": dataclasses.MISSING, "chunk_reader": None, "span": None,
            "piece_source": None, "resident": 0, "checks": None, "transposed": None, "runs": None}:
        raise AssertionError("TensorRef's fields changed: spanned_ref sets the old ones")


_check_spanned_ref()


def _as_bytes(piece: np.ndarray) -> memoryview:
    arr = np.ascontiguousarray(piece)
    return memoryview(arr.reshape(-1).view(np.uint8))


def rechunk(source: Iterator[np.ndarray], elements: int) -> Iterator[np.ndarray]:
    """Consecutive 1-D arrays of exactly ``elements`` (the last shorter) from arrays of any sizes;
    pieces that already have the size pass through without a copy."""
    taker = Elements(source)
    while True:
        piece = taker.take(elements)
        if not piece.size:
            return
        yield piece
        if piece.size < elements:
            return


class Elements:
    """Reads a stream of 1-D arrays element by element: ``take(n)`` returns the next ``n``."""

    def __init__(self, source: Iterator[np.ndarray]):
        self._source = iter(source)
        self._head: np.ndarray | None = None
        self._done = False

    def _next(self) -> np.ndarray | None:
        if self._head is not None and self._head.size:
            head, self._head = self._head, None
            return head
        while not self._done:
            try:
                piece = next(self._source)
            except StopIteration:
                self._done = True
                return None
            if piece.size:
                return piece.reshape(-1)
        return None

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` elements (fewer at the end; an empty array when none are left)."""
        first = self._next()
        if first is None:
            return np.empty(0)
        if first.size >= n:
            self._head = first[n:]
            return first[:n]
        parts, got = [first], first.size
        while got < n:
            piece = self._next()
            if piece is None:
                break
            if got + piece.size > n:
                self._head = piece[n - got :]
                piece = piece[: n - got]
            parts.append(piece)
            got += piece.size
        return np.concatenate(parts)
