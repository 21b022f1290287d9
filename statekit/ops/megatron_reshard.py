"""``statekit convert MEGATRON_DIR OUT_DIR --to megatron-legacy --tp N --pp N --ep N --dp N [--cp N]``:
a Megatron legacy checkpoint rewritten at other parallel sizes (:mod:`statekit.frameworks.megatron.
write_legacy`), with a plan the CLI shows and a result it renders (never prints)."""

from __future__ import annotations

from dataclasses import dataclass, field

from statekit.errors import UsageError

FORMAT = "megatron-legacy"


@dataclass
class Reshard:
    """What was (or, on a dry run, would be) written."""

    src: str
    dst: str
    sizes: dict[str, int]
    folders: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    written: int | None = None
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"source": self.src, "output": self.dst, "format": FORMAT, "sizes": self.sizes,
                "rank_folders": self.folders, "notes": self.notes, "bytes_written": self.written}

    @property
    def messages(self) -> list[str]:
        sizes = " · ".join(f"{k.upper()} {v}" for k, v in self.sizes.items())
        head = (f"wrote {self.dst}: Megatron legacy checkpoint at {sizes}, {len(self.folders)} rank folders, "
                f"{self.written} bytes") if self.written is not None else f"dry run: nothing written ({sizes})"
        return [head, *(f"note: {n}" for n in self.notes)]


def reshard(src: str, dst: str, *, tp: int | None, pp: int | None, ep: int | None, dp: int | None,
            vocab_divisible_by: int | None = None, distributed: bool | None = None,
            dry_run: bool = False, cp: int | None = None) -> Reshard:
    """Rewrite the legacy checkpoint ``src`` into the new save root ``dst`` at the given sizes
    (None: the source's)."""
    from statekit.frameworks.megatron import write_legacy

    if vocab_divisible_by is not None and vocab_divisible_by < 1:
        raise UsageError(f"--vocab-divisible-by {vocab_divisible_by}: must be at least 1")
    source = write_legacy.source_sizes(src)
    target = write_legacy.Target(tp or source["tp"], pp or source["pp"], ep or source["ep"], dp or source["dp"],
                                 vocab_divisible_by, distributed, cp or source["cp"])
    sizes = {"tp": target.tp, "pp": target.pp, "ep": target.ep, "dp": target.dp}
    if target.cp != 1 or source["cp"] != 1:
        sizes["cp"] = target.cp
    if dry_run:
        writer = write_legacy.check(src, dst, target)
        return Reshard(src, dst, sizes, folders=writer.folders(), notes=writer.notes)
    result = write_legacy.write(src, dst, target)
    return Reshard(src, dst, sizes, folders=result.folders, notes=result.notes, written=result.nbytes)
