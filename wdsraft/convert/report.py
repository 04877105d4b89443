"""What a conversion did: per input (``InputReport``) and as a whole (``ConvertReport`` and its summary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class InputReport:
    url: str
    lines: int = 0
    blank_lines: int = 0
    records: int = 0
    samples: int = 0
    rejected: int = 0

    @property
    def balanced(self) -> bool:
        return self.records == self.samples + self.rejected

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "lines": self.lines,
            "blank_lines": self.blank_lines,
            "records": self.records,
            "samples": self.samples,
            "rejected": self.rejected,
        }

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> InputReport:
        return cls(
            record["url"],
            record.get("lines", 0),
            record.get("blank_lines", 0),
            record.get("records", 0),
            record.get("samples", 0),
            record.get("rejected", 0),
        )


@dataclass
class ConvertReport:
    """What a run of ``convert`` did (one task's share, or the whole conversion once finalized)."""

    output: str
    workdir: str
    task_index: int = 0
    task_count: int = 1
    units_done: int = 0  # units this run scattered
    buckets_done: int = 0  # buckets this run wrote
    bytes_in: int = 0  # uncompressed input bytes this run scattered
    finalized: bool = False
    already_done: bool = False
    inputs: list[InputReport] = field(default_factory=list)
    num_shards: int = 0
    num_samples: int = 0
    size: int = 0
    manifest_url: str | None = None
    rejects_url: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def rejected(self) -> int:
        return sum(item.rejected for item in self.inputs)

    def summary(self) -> str:
        """A plain-text table: per input, lines / blank / records / samples / rejected, then totals."""
        out = []
        if self.already_done:
            out.append(f"already converted: {self.manifest_url} matches these inputs and settings")
        if self.inputs:
            width = max(len("input"), *(len(_short(item.url)) for item in self.inputs))
            header = f"{'input':<{width}}  {'lines':>10}  {'blank':>7}  {'records':>10}  {'samples':>10}  "
            out.append(header + f"{'rejected':>8}  check")
            totals = InputReport("total")
            for item in self.inputs:
                for name in ("lines", "blank_lines", "records", "samples", "rejected"):
                    setattr(totals, name, getattr(totals, name) + getattr(item, name))
            for item in [*self.inputs, totals]:
                out.append(
                    f"{_short(item.url):<{width}}  {item.lines:>10,}  {item.blank_lines:>7,}  {item.records:>10,}  "
                    f"{item.samples:>10,}  {item.rejected:>8,}  {'ok' if item.balanced else 'MISMATCH'}"
                )
        if self.finalized or self.already_done:
            out.append(
                f"{self.num_shards} shards, {self.num_samples:,} samples, {self.size / 1e6:,.1f} MB; "
                f"manifest {self.manifest_url}"
            )
            if self.rejects_url:
                out.append(f"{self.rejected:,} rejected records: {self.rejects_url}")
        else:
            out.append(
                f"task {self.task_index}/{self.task_count}: scattered {self.units_done} inputs, "
                f"wrote {self.buckets_done} buckets; workdir {self.workdir}"
            )
        if self.seconds:
            phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds.items())
            total = sum(self.seconds.values())
            rate = (
                f"; {self.bytes_in / 1e6:,.1f} MB of JSONL at {self.bytes_in / 1e6 / total:,.1f} MB/s"
                if (self.bytes_in and total > 0)
                else ""
            )
            out.append(f"time: {phases}{rate}")
        return "\n".join(out)


def _short(url: str, width: int = 60) -> str:
    return url if len(url) <= width else "..." + url[-(width - 3) :]
