"""The streaming data path: tensors move in bounded pieces, transformed on the way.

Every writer (burnpack, torch zip, safetensors, candle, and writers built on these) takes its
tensors as :class:`~statekit.tensor.TensorRef` objects and writes what :func:`ordered` hands it:

    for ref, piece_stream in ordered(refs, crc=True, out=out):
        piece_stream.write_to(out)        # or: for buf in piece_stream: out.write(buf)
        piece_stream.crc, piece_stream.nbytes   # CRC-32 and size, computed on the way

File spans and transposes of file spans are produced by the writing thread straight into the
output's staging blocks (:class:`statekit.atomic.OutputFile`); other tensors by worker threads.

A writer never asks for a whole tensor. The lazy transforms here compose on top of any source
and work piece by piece as well: :func:`cast` (per piece), :func:`transpose` (cache-blocked
tiles; holds its source, the one exception to one-piece memory), :func:`resize` (zero-pad or
truncate each axis), :func:`checked` (NaN/Inf refused in the same pass that moves the bytes),
:func:`combine` (elementwise functions of several tensors).

``jobs`` (default: :func:`current_jobs`, the machine's cores; :func:`using_jobs` sets it for a
block of code, as the CLI's ``--jobs`` does) is how many tensors are read and transformed at once
by worker threads (``pread``, numpy and zlib release the GIL). The output order and bytes never
depend on it: pieces are written in tensor order by the calling thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import mmap
import os
import queue
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence

from statekit import dtypes, tensor
from statekit.errors import MappingError
from statekit.lazy import numpy as np
from statekit.tensor import Elements, TensorRef

QUEUE_PIECES = 2  # pieces a worker may have ready ahead of the writer (plus one in hand)
_JOBS: contextvars.ContextVar[int | None] = contextvars.ContextVar("statekit_jobs", default=None)


def default_jobs() -> int:
    """``STATEKIT_JOBS`` if set, else the cores this process may run on."""
    env = os.environ.get("STATEKIT_JOBS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def current_jobs() -> int:
    """The number of concurrent tensors in effect (:func:`using_jobs`, else the default)."""
    value = _JOBS.get()
    return value if value is not None else default_jobs()


def set_jobs(n: int | None) -> None:
    """Set the number of concurrent tensors for the rest of this context (the CLI's ``--jobs``)."""
    if n is not None and n < 1:
        from statekit.errors import UsageError

        raise UsageError(f"--jobs must be at least 1 (got {n})")
    _JOBS.set(n)


@contextlib.contextmanager
def using_jobs(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` concurrent tensors (None: the default)."""
    if n is not None and n < 1:
        from statekit.errors import UsageError

        raise UsageError(f"--jobs must be at least 1 (got {n})")
    token = _JOBS.set(n)
    try:
        yield
    finally:
        _JOBS.reset(token)


# ----------------------------------------------------------------------------- transforms


def _itemsize(ref: TensorRef) -> int:
    return dtypes.itemsize(ref.dtype)


def derived(dtype: str, shape: tuple, source: Callable[[int], Iterator[np.ndarray]], *, resident: int = 0,
            info: dict | None = None) -> TensorRef:
    """A lazy tensor whose values ``source(elements)`` yields as 1-D arrays of ≤ ``elements``."""
    return TensorRef(dtype=dtype, shape=tuple(shape), piece_source=source, resident=resident, info=info or {})


def cast(ref: TensorRef, dtype: str) -> TensorRef:
    """``ref``'s values converted to ``dtype`` piece by piece (numpy's ``astype``)."""
    return ref.cast(dtype)


def _blocks(cols: int, itemsize: int) -> tuple[int, int]:
    """Source rows × columns per block of :func:`transpose_into`. Each output row of a block gets
    a whole cache line (16 rows of 4-byte values, 8 of 8-byte ones) in one write, from up to 1024
    columns (measured 3-4 GB/s for f32 on this machine's numpy, against 0.6 GB/s for 256×256
    tiles, 0.3 GB/s for one strided copy, and less for more rows per block)."""
    return max(8, 64 // itemsize), max(1, min(cols, 1024))


def transpose_into(out: np.ndarray, src: np.ndarray) -> None:
    """``out[...] = src.T`` for 2-D arrays, copied in blocks that stay in cache."""
    rows, cols = src.shape
    tr, tc = _blocks(cols, src.itemsize)
    for j in range(0, cols, tc):
        dst, part = out[j : j + tc], src[:, j : j + tc]
        for i in range(0, rows, tr):
            dst[:, i : i + tr] = part[i : i + tr].T


def transpose(ref: TensorRef) -> TensorRef:
    """``ref`` with its axes reversed. A transpose needs the whole source: it is read once with
    ``pread`` (held while the output is produced), then written out in bands of tiles."""
    shape = tuple(ref.shape)[::-1]

    def source(elements: int) -> Iterator[np.ndarray]:
        src = ref.numpy()
        if src.ndim != 2:
            flat = np.ascontiguousarray(src.T).reshape(-1)
            for lo in range(0, flat.size, elements):
                yield flat[lo : lo + elements]
            return
        m, n = src.shape  # output is [n, m]: output row j is source column j
        if m == 0 or n == 0:
            return
        if m <= elements:
            band = max(1, elements // m)
            for j in range(0, n, band):
                width = min(band, n - j)
                out = np.empty((width, m), dtype=src.dtype)
                transpose_into(out, src[:, j : j + width])
                yield out.reshape(-1)
        else:  # one output row is longer than a piece: gather it in segments
            for j in range(n):
                for i in range(0, m, elements):
                    yield np.ascontiguousarray(src[i : i + elements, j])

    out = derived(ref.dtype, shape, source, resident=ref.resident + ref.nbytes)
    out.transposed = ref
    return out


def resize(ref: TensorRef, shape: tuple, fill: float = 0.0) -> TensorRef:
    """``ref`` padded with ``fill`` (zero unless said) or truncated on each axis to ``shape`` (same
    rank), row band by row band."""
    shape = tuple(shape)
    old = tuple(ref.shape)
    if len(old) != len(shape):
        raise MappingError(f"cannot resize a rank-{len(old)} tensor to shape {list(shape)}")
    if not shape:
        return ref
    want = dtypes.numpy_dtype(ref.dtype)

    def source(elements: int) -> Iterator[np.ndarray]:
        row_in, row_out = int(np.prod(old[1:])), int(np.prod(shape[1:]))
        band = max(1, elements // max(row_in, row_out, 1))
        values = Elements(ref.pieces(max(elements, row_in)))
        keep = tuple(slice(0, min(a, b)) for a, b in zip(old[1:], shape[1:], strict=True))
        for r in range(0, shape[0], band):
            rows = min(band, shape[0] - r)
            out = np.full((rows, *shape[1:]), fill, dtype=want) if fill else np.zeros((rows, *shape[1:]), dtype=want)
            have = max(0, min(rows, old[0] - r))
            if have:
                block = values.take(have * row_in).reshape(have, *old[1:])
                out[(slice(0, have), *keep)] = block[(slice(0, have), *keep)]
            yield out.reshape(-1)

    return derived(ref.dtype, shape, source, resident=ref.resident)


def nonfinite(piece: np.ndarray) -> tuple[int, int]:
    """NaN and Inf counts of a block of float values (half precision widened to float32 first):
    the one scanner behind ``checked``, ``inspect --stats`` and ``doctor``."""
    # one pass, nothing allocated: a finite sum means every element is finite (NaN and ±Inf
    # propagate); only a non-finite sum (or an overflow) needs the exact count
    # (inf + -inf and sums past the type's range are expected here: no RuntimeWarning for them)
    with np.errstate(invalid="ignore", over="ignore"):
        if piece.size and np.isfinite(np.add.reduce(piece)):
            return 0, 0
    wide = piece.astype(np.float32) if piece.dtype.itemsize < 4 else piece
    finite = np.isfinite(wide)
    if finite.all():
        return 0, 0
    nan = int(np.isnan(wide).sum())
    return nan, int(wide.size - np.count_nonzero(finite)) - nan


def checked(ref: TensorRef, label: str, path: str | None = None) -> TensorRef:
    """``ref``, refusing NaN or Inf in a float tensor — counted in the same pass that moves the
    bytes; raised after the tensor's last piece (an atomic writer then leaves no file)."""
    if not dtypes.is_float(ref.dtype):
        return ref

    out = derived(ref.dtype, ref.shape, lambda elements: _scan(ref.pieces(elements), label, path),
                  resident=ref.resident)
    out.info = dict(ref.info)
    out.checks = (ref, label, path)
    return out


def _scan(pieces: Iterator[np.ndarray], label: str, path: str | None) -> Iterator[np.ndarray]:
    nan = inf = 0
    for piece in pieces:
        n, i = nonfinite(piece)
        nan, inf = nan + n, inf + i
        yield piece
    if nan or inf:
        raise _nonfinite_error(label, path, nan, inf)


def _nonfinite_error(label: str, path: str | None, nan: int, inf: int) -> MappingError:
    return MappingError(f"{label}: {nan} NaN and {inf} Inf values; resuming from them "
                        "would turn the parameter into NaN (--allow-nonfinite writes them anyway)", path)


def combine(refs: Sequence[TensorRef], fn: Callable[..., np.ndarray], dtype: str, *,
            info: dict | None = None) -> TensorRef:
    """``fn(piece_a, piece_b, ...)`` over aligned pieces of same-shaped tensors."""
    shape = tuple(refs[0].shape)

    def source(elements: int) -> Iterator[np.ndarray]:
        streams = [r.pieces(elements) for r in refs]
        for parts in zip(*streams, strict=True):
            yield fn(*parts)

    return derived(dtype, shape, source, resident=sum(r.resident for r in refs), info=info)


# ----------------------------------------------------------------------------- ordered, concurrent


class PieceStream:
    """The bytes of one tensor, in pieces; ``nbytes`` and ``crc`` (when asked) once exhausted.

    Iterate it (``for buf in stream``), or hand it an output with :meth:`write_to`: a tensor that
    is a span of an input file (checked for NaN/Inf or not) is then read straight into the
    output's staging blocks (:class:`statekit.atomic.OutputFile`), checked and CRC'd there — one
    copy, no buffer of its own.
    """

    def __init__(self, pieces: Iterator, want_crc: bool, direct: tuple | None = None):
        self._pieces = pieces
        self._want_crc = want_crc
        self._direct = direct  # (span or spans, check, source) of bytes the consumer reads itself
        self.nbytes = 0
        self.crc = 0 if want_crc else None

    def __iter__(self) -> Iterator[bytes | memoryview]:
        for piece, crc in self._pieces:
            self.nbytes += len(piece)
            if self._want_crc:
                self.crc = crc
            yield piece

    def write_to(self, out) -> None:
        """Write every byte to ``out`` (a file object; zero-copy into an ``OutputFile``)."""
        if self._direct is None or not hasattr(out, "staging"):
            for buf in self:
                out.write(buf)
            return
        span, check, source = self._direct
        crc32 = crc32_function() if self._want_crc else None
        typed = source if source is not None else check[0] if check is not None else None
        want = dtypes.numpy_dtype(typed.dtype) if typed is not None else None
        item = want.itemsize if want is not None else 1
        views = _transposed_views(span, source, want) if source is not None else \
            _runs_views(out, span, item) if isinstance(span, list) else _span_views(out, span, item)
        crc = nan = inf = 0
        for view, staged in views:
            if check is not None:
                a, b = nonfinite(np.frombuffer(view, dtype=want))
                nan, inf = nan + a, inf + b
            if crc32 is not None:
                crc = crc32(view, crc)
            if staged:
                out.commit(len(view))
            else:
                out.write(view)
        self.nbytes = sum(tensor.run_length(r) for r in span) if isinstance(span, list) else span.length
        if self._want_crc:
            self.crc = crc
        if nan or inf:
            _, label, path = check
            raise _nonfinite_error(label, path, nan, inf)


def _span_views(out, span, item: int) -> Iterator[tuple[memoryview, bool]]:
    """The span read straight into ``out``'s staging blocks: ``(view, True)`` to commit; an element
    that would straddle two blocks comes as ``(bytes, False)``, to write."""
    pos = 0
    while pos < span.length:
        view = out.staging(span.length - pos)
        n = len(view) - len(view) % item
        if n:
            view = view[:n]
            span.file.pread_into(view, span.offset + pos)
            yield view, True
        else:
            n = item
            yield memoryview(span.read(pos, item)), False
        pos += n


_ZEROS = bytes(1 << 20)


def _runs_views(out, runs: list, item: int) -> Iterator[tuple[memoryview, bool]]:
    """:func:`_span_views` of each file span in turn, zeros for an int (a tensor whose bytes are
    runs back to back: :func:`statekit.tensor.file_runs`)."""
    zeros = memoryview(_ZEROS)
    for run in runs:
        if isinstance(run, int):
            for lo in range(0, run, len(zeros)):
                yield zeros[: min(len(zeros), run - lo)], False
        else:
            yield from _span_views(out, run, item)


BAND = 64 << 20  # the most bytes of output rows a transpose produces at once


def _transposed_views(span, source: TensorRef, want) -> Iterator[tuple[memoryview, bool]]:
    """The transpose of the 2-D span: the source mapped (or, where it cannot be, read once into a
    reused buffer), the output produced in bands of as many whole rows as fit in :data:`BAND` (a
    band of few rows reads the source a few columns at a time, across all its pages: 128 rows of
    a 65536-row source measured 1.9 GB/s, 256 rows 2.5) into a reused buffer."""
    rows, cols = source.shape  # the output is [cols, rows]
    if rows == 0 or cols == 0:  # an empty matrix: no bytes either way
        return
    row_bytes = rows * want.itemsize
    band = max(1, min(cols, BAND // row_bytes))
    out = np.frombuffer(_scratch(band * row_bytes, "band"), dtype=want)
    with span.file.mapped(span.offset, span.length) as mapped:
        buf = mapped
        if buf is None:
            buf = _scratch(span.length)
            span.file.pread_into(buf, span.offset)
        matrix = np.frombuffer(buf, dtype=want).reshape(rows, cols)
        for j in range(0, cols, band):
            width = min(band, cols - j)
            dst = out[: width * rows].reshape(width, rows)
            _transpose_shared(dst, matrix[:, j : j + width])
            yield memoryview(dst.reshape(-1).view(np.uint8)), False
        del matrix, buf


def _transpose_shared(dst: np.ndarray, src: np.ndarray) -> None:
    """:func:`transpose_into`, its output rows shared with up to ``jobs - 1`` helper threads
    (numpy copies without the GIL) when the band is large enough to be worth it."""
    parts = min(current_jobs(), 4, max(1, dst.nbytes // (4 << 20)))
    if parts <= 1:
        transpose_into(dst, src)
        return
    pool = _helpers(parts - 1)
    step = -(-dst.shape[0] // parts)
    futures = [pool.submit(transpose_into, dst[k : k + step], src[:, k : k + step])
               for k in range(step, dst.shape[0], step)]
    transpose_into(dst[:step], src[:, :step])
    for f in futures:
        f.result()


_HELPERS: list = []  # [(threads, executor)]


def _helpers(n: int):
    """A process-wide pool of at least ``n`` threads for :func:`_transpose_shared`."""
    with _HELPERS_LOCK:
        if not _HELPERS or _HELPERS[0][0] < n:
            from concurrent.futures import ThreadPoolExecutor

            if _HELPERS:
                _HELPERS.pop()[1].shutdown(wait=False)
            _HELPERS.append((n, ThreadPoolExecutor(max_workers=n, thread_name_prefix="statekit-transpose")))
        return _HELPERS[0][1]


_HELPERS_LOCK = threading.Lock()
_LOCAL = threading.local()


def _scratch(nbytes: int, which: str = "source") -> memoryview:
    """A writable buffer of ``nbytes`` for this thread, reused from tensor to tensor (its pages
    touched once): a transpose's source and output band. Released by :func:`release_scratch`."""
    bufs = _LOCAL.__dict__.setdefault("scratch", {})
    buf = bufs.get(which)
    if buf is None or len(buf) < nbytes:
        bufs.pop(which, None)
        buf = bufs[which] = mmap.mmap(-1, max(nbytes, 1))
    return memoryview(buf)[:nbytes]


def release_scratch() -> None:
    """Give this thread's transpose buffers back to the system (:func:`ordered` does, at its end)."""
    _LOCAL.__dict__.pop("scratch", None)


def crc32_function() -> Callable:
    """CRC-32 as zip writes it: ISA-L's (``isal``, a default dependency: about five times zlib's
    speed with carry-less multiplication), else (a platform without its wheel) zlib's, spread over the cores for
    large buffers (:func:`crc32_threads`: zlib releases the GIL). Same values."""
    global _CRC32
    if _CRC32 is None:
        try:
            from isal.isal_zlib import crc32
        except ImportError:
            crc32 = crc32_threads if default_jobs() > 1 else zlib.crc32
        _CRC32 = crc32
    return _CRC32


_CRC32: Callable | None = None

MAP_WINDOW = 16 << 20  # bytes of each file mapped at once by :func:`same_spans`


def _memcmp() -> Callable | None:
    """The C library's ``memcmp`` (through ctypes, which releases the GIL for the call), or None
    where none can be found (then callers read and compare as before)."""
    global _MEMCMP
    if _MEMCMP is None:
        import ctypes

        fn = None
        for load in (lambda: ctypes.CDLL(None), lambda: ctypes.cdll.msvcrt):
            try:
                fn = load().memcmp
                break
            except (OSError, AttributeError):
                continue
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            fn.restype = ctypes.c_int
        _MEMCMP = fn or False
    return _MEMCMP or None


_MEMCMP = None


def same_bytes(a: TensorRef, b: TensorRef, piece: int = 4 << 20) -> bool:
    """Whether two tensors hold the same dtype, shape and bytes, read ``piece`` bytes at a time
    from each (never a whole tensor: their pieces may be cut at different places)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    ia, ib = a.iter_bytes(piece), b.iter_bytes(piece)
    va = vb = memoryview(b"")
    while True:
        if not va:
            va = memoryview(next(ia, b"")).cast("B")
        if not vb:
            vb = memoryview(next(ib, b"")).cast("B")
        if not va or not vb:
            return not va and not vb
        n = min(len(va), len(vb))
        if not _equal(va[:n], vb[:n]):
            return False
        va, vb = va[n:], vb[n:]


def _equal(a: memoryview, b: memoryview) -> bool:
    """Two byte views of one length compared with ``memcmp`` (a memoryview's ``==`` goes element
    by element), or as bytes where there is none."""
    memcmp = _memcmp()
    if memcmp is None:
        return bytes(a) == bytes(b)
    xa, xb = np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)
    return memcmp(xa.ctypes.data, xb.ctypes.data, len(a)) == 0


def same_spans(a, b) -> bool:
    """Whether two file spans (:class:`statekit.tensor.FileSpan`) hold the same bytes, compared
    where they lie: both mapped read-only :data:`MAP_WINDOW` bytes at a time and ``memcmp``'d, so
    nothing is copied (two page-cached files compare at memory speed, faster than reading them).
    False when they differ, and also when it cannot tell (lengths differ, no ``memcmp``, a span
    that cannot be mapped, e.g. past the end of a truncated file): then the caller reads them."""
    if a.length != b.length:
        return False
    memcmp = _memcmp()
    if memcmp is None:
        return False
    for lo in range(0, a.length, MAP_WINDOW):
        n = min(MAP_WINDOW, a.length - lo)
        with a.file.mapped(a.offset + lo, n) as va, b.file.mapped(b.offset + lo, n) as vb:
            if va is None or vb is None:
                return False
            xa, xb = np.frombuffer(va, np.uint8), np.frombuffer(vb, np.uint8)
            differ = memcmp(xa.ctypes.data, xb.ctypes.data, n)
            del xa, xb  # (no view of a map outlives its block)
        if differ:
            return False
    return True
CRC_SPLIT_MIN = 2 << 20  # below this a buffer is one zlib call (a thread's hand-off costs more)
CRC_SPLIT_MAX = 4  # parts one buffer is cut into at most


def crc32_threads(data, value: int = 0) -> int:
    """``zlib.crc32(data, value)`` computed in parts on threads (zlib releases the GIL) and
    combined (:func:`crc32_combine`): the default install's CRC-32 at the speed of the cores."""
    n = len(data)
    parts = min(CRC_SPLIT_MAX, default_jobs(), n // (CRC_SPLIT_MIN // 2))
    if n < CRC_SPLIT_MIN or parts < 2:
        return zlib.crc32(data, value)
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    step = n // parts
    bounds = [(i * step, n if i == parts - 1 else (i + 1) * step) for i in range(parts)]
    futures = [_crc_pool().submit(zlib.crc32, view[a:b]) for a, b in bounds[1:]]
    crc = zlib.crc32(view[: bounds[0][1]], value)
    for (a, b), future in zip(bounds[1:], futures, strict=True):
        crc = crc32_combine(crc, future.result(), b - a)
    return crc


_POOL = None
_POOL_LOCK = threading.Lock()


def _crc_pool():
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _POOL = ThreadPoolExecutor(CRC_SPLIT_MAX - 1, thread_name_prefix="statekit-crc")
        return _POOL


def _gf2_apply(matrix: list[int], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _zero_shifts() -> list[list[int]]:
    """``[M_0, M_1, ...]``: M_k maps the CRC of ``A`` to the linear part of the CRC of ``A``
    followed by 2^k zero bytes (zlib's crc32 of a buffer is affine in its start value)."""
    base = zlib.crc32(b"\0", 0)
    matrices = [[zlib.crc32(b"\0", 1 << i) ^ base for i in range(32)]]
    for _ in range(63):
        last = matrices[-1]
        matrices.append([_gf2_apply(last, column) for column in last])
    return matrices


_SHIFTS: list[list[int]] = []


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` of ``A``, ``crc2`` of ``B`` and ``len(B)`` (zlib's
    ``crc32_combine``, which Python's zlib does not offer)."""
    if not _SHIFTS:
        _SHIFTS.extend(_zero_shifts())
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _gf2_apply(_SHIFTS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


RING = QUEUE_PIECES + 2  # reused read buffers per tensor: queued pieces, one written, one read


def _raw(ref: TensorRef, piece: int) -> Iterator:
    """The bytes a writer writes. A file span (checked for NaN/Inf or not) is read into
    :data:`RING` reused buffers: no fresh memory per piece (a fresh 16 MiB buffer costs page faults
    and unmapping, which dominated the copy); everything else as ``iter_bytes`` gives it."""
    if ref.span is not None and ref.array_loader is None:
        return ref.span.chunks(piece, RING)
    if ref.checks is not None:
        inner, label, path = ref.checks
        if inner.span is not None and inner.array_loader is None:
            want = dtypes.numpy_dtype(inner.dtype)
            views = inner.span.chunks(max(1, piece // want.itemsize) * want.itemsize, RING)
            return (_as_view(a) for a in _scan((np.frombuffer(v, dtype=want) for v in views), label, path))
    return ref.iter_bytes(piece)


def _direct_source(ref: TensorRef) -> tuple | None:
    """How a consumer writing to an ``OutputFile`` produces ``ref`` itself, or None (then a worker
    does): ``(span, check, None)`` for a file span as it is, ``(spans, check, None)`` for a
    tensor whose bytes are a list of file spans back to back (:func:`statekit.tensor.file_runs`),
    ``(span, check, source)`` for the transpose of a 2-D file span ``source``; ``check`` is the
    ``(ref, label, path)`` of :func:`checked` or None."""
    check = ref.checks
    inner = check[0] if check is not None else ref
    if inner.span is not None and inner.array_loader is None:
        return inner.span, check, None
    if inner.runs is not None and inner.span is None:
        spans = tensor.file_runs(inner)  # (a box of several files' chunks, rows cut, parts stacked)
        if spans is not None and tensor.worth_runs(spans):  # (else many tiny runs: the pieces, in workers)
            return spans, check, None
    src = inner.transposed
    if src is not None and src.span is not None and src.array_loader is None and len(src.shape) == 2 \
            and src.dtype != "QFloat":
        return src.span, check, src
    return None


def _as_view(arr: np.ndarray) -> memoryview:
    return memoryview(arr.view(np.uint8)) if arr.size else memoryview(b"")


def _produce(ref: TensorRef, piece: int, want_crc: bool) -> Iterator[tuple]:
    crc = 0
    crc32 = crc32_function() if want_crc else None
    for buf in _raw(ref, piece):
        if want_crc:
            crc = crc32(buf, crc)
        yield buf, crc


_DONE = object()


class _Gate:
    """Tensors that hold their whole source (transposes) start in order, as many at once as fit
    in a budget of the largest one's bytes: memory stays one large source, small ones overlap."""

    def __init__(self, refs: list[TensorRef], direct: list):
        self._order = [i for i, r in enumerate(refs) if r.resident and direct[i] is None]  # (workers' only)
        self._size = {i: refs[i].resident for i in self._order}
        self._budget = max(self._size.values(), default=0)
        self._used = 0
        self._next = 0
        self._cond = threading.Condition()

    def enter(self, index: int, cancelled: threading.Event) -> None:
        with self._cond:
            while not (self._order[self._next] == index and self._used + self._size[index] <= self._budget):
                if cancelled.is_set():
                    raise _Cancelled
                self._cond.wait(0.1)
            self._used += self._size[index]
            self._next += 1
            self._cond.notify_all()

    def leave(self, index: int) -> None:
        with self._cond:
            self._used -= self._size[index]
            self._cond.notify_all()


class _Cancelled(Exception):
    pass


def ordered(refs: Sequence[TensorRef], *, jobs: int | None = None, piece: int | None = None,
            crc: bool = False, out=None) -> Iterator[tuple[TensorRef, PieceStream]]:
    """``(ref, stream)`` for each ref, in order; iterate each stream (or ``stream.write_to(out)``)
    fully before the next.

    With ``jobs`` > 1, up to ``jobs`` tensors are read and transformed ahead by as many worker
    threads, each holding at most a few pieces; the consumer sees exactly what ``jobs=1`` gives.
    Small totals (under :data:`CONCURRENT_MIN` bytes) are not worth the threads. ``out``: the
    output the streams will be written to; when it can stage (an ``OutputFile``), tensors that
    are plain file spans are left to the consumer, which reads them straight into the output
    (:meth:`PieceStream.write_to`): the workers take only the tensors that need computing.
    """
    n_jobs = jobs if jobs is not None else current_jobs()
    piece = piece or tensor.PIECE
    refs = list(refs)
    direct = [_direct_source(r) if out is not None and hasattr(out, "staging") else None for r in refs]
    busy = [r for r, d in zip(refs, direct, strict=True) if d is None]
    try:
        if n_jobs <= 1 or len(busy) <= 1 or sum(_size(r) for r in busy) < CONCURRENT_MIN:
            for ref, d in zip(refs, direct, strict=True):
                yield ref, PieceStream(_produce(ref, piece, crc), crc, d)
            return
        yield from _concurrent(refs, n_jobs, piece, crc, direct)
    finally:
        release_scratch()


CONCURRENT_MIN = 32 << 20


def _size(ref: TensorRef) -> int:
    try:
        return ref.nbytes
    except ValueError:
        return 0


def _concurrent(refs: list[TensorRef], n_jobs: int, piece: int, crc: bool, direct: list) -> Iterator[tuple]:
    cancelled = threading.Event()
    gate = _Gate(refs, direct)
    queues = [queue.Queue(maxsize=QUEUE_PIECES) if d is None else None for d in direct]
    slots = threading.Semaphore(n_jobs)  # tensors in flight: taken by a worker, released by the consumer
    counter = iter([i for i, d in enumerate(direct) if d is None])  # the workers' share, in order
    counter_lock = threading.Lock()
    context = contextvars.copy_context()  # worker threads do not inherit context variables

    def put(q: queue.Queue, item) -> None:
        while True:
            if cancelled.is_set():
                raise _Cancelled
            try:
                q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def run_one(index: int) -> None:
        q, ref = queues[index], refs[index]
        holder = bool(ref.resident)
        try:
            if holder:
                gate.enter(index, cancelled)
            try:
                for item in _produce(ref, piece, crc):
                    put(q, item)
            finally:
                if holder:
                    gate.leave(index)
            put(q, _DONE)
        except _Cancelled:
            raise
        except BaseException as exc:  # handed to the consumer, raised there in order
            put(q, exc)

    def worker() -> None:
        while not cancelled.is_set():
            if not slots.acquire(timeout=0.1):
                continue
            with counter_lock:
                index = next(counter, None)
            if index is None:
                return
            try:
                run_one(index)
            except _Cancelled:
                return

    def drain(q: queue.Queue) -> Iterator[tuple]:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    threads = [threading.Thread(target=context.copy().run, args=(worker,), daemon=True,
                                name=f"statekit-stream-{k}") for k in range(min(n_jobs, len(refs)))]
    for t in threads:
        t.start()
    try:
        for i, ref in enumerate(refs):
            if direct[i] is not None:  # read by the consumer, in its turn
                yield ref, PieceStream(_produce(ref, piece, crc), crc, direct[i])
                continue
            yield ref, PieceStream(drain(queues[i]), crc)
            queues[i] = None
            slots.release()
    finally:
        cancelled.set()
        for q in queues:  # unblock workers waiting to put
            if q is not None:
                with contextlib.suppress(queue.Empty):
                    while True:
                        q.get_nowait()
        for t in threads:
            t.join()


def write_all(out, refs: Sequence[TensorRef], *, crc: bool = False,
              before: Callable[[int, TensorRef], None] | None = None,
              after: Callable[[int, TensorRef, PieceStream], None] | None = None) -> None:
    """Write each tensor's bytes to ``out`` in order (``before``/``after`` hooks per tensor)."""
    for i, (ref, stream) in enumerate(ordered(refs, crc=crc, out=out)):
        if before is not None:
            before(i, ref)
        stream.write_to(out)
        if after is not None:
            after(i, ref, stream)


def parallel_map(fn: Callable, items: Sequence, *, jobs: int | None = None) -> Iterator:
    """``fn(item)`` for each item, results in order; up to ``jobs`` run at once in threads (each
    holding its own bounded pieces). With one job, or one item, nothing runs ahead."""
    n_jobs = jobs if jobs is not None else current_jobs()
    items = list(items)
    if n_jobs <= 1 or len(items) <= 1:
        for item in items:
            yield fn(item)
        return
    from concurrent.futures import ThreadPoolExecutor

    context = contextvars.copy_context()
    with ThreadPoolExecutor(max_workers=n_jobs, thread_name_prefix="statekit-map") as pool:
        futures = []
        ahead = iter(items)
        for item in ahead:  # keep at most 2 × jobs submitted: results are held until consumed
            futures.append(pool.submit(context.copy().run, fn, item))
            if len(futures) >= 2 * n_jobs:
                break
        try:
            while futures:
                result = futures.pop(0).result()
                for item in ahead:
                    futures.append(pool.submit(context.copy().run, fn, item))
                    break
                yield result
        finally:
            for f in futures:
                f.cancel()
