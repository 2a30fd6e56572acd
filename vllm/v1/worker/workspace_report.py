"""What a workspace manager holds, per slot: its accounting, read by the
memory report and tests instead of estimates."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from vllm.utils import named_tensors


def tensor_storage_bytes(obj: object) -> int:
    """Bytes of the distinct tensor storages reachable from ``obj``.

    Counts each storage once, so an object holding views of one buffer is
    not counted twice.
    """
    storages = {
        (str(t.device), t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
        for _, t in named_tensors(obj)
    }
    return sum(storages.values())


@dataclass
class ResourceReport:
    """One persistent resource of a slot."""

    kind: str  # "tensor" or "object"
    key: Hashable
    type_name: str
    nbytes: int


@dataclass
class SlotReport:
    """Memory held by one execution slot."""

    ubatch: int
    lane: int
    arena_bytes: int
    resources: list[ResourceReport]

    @property
    def persistent_bytes(self) -> int:
        return sum(r.nbytes for r in self.resources)


@dataclass
class WorkspaceReport:
    """Memory held by the manager, per slot, with totals."""

    device: str
    locked: bool
    slots: list[SlotReport]

    @property
    def arena_bytes(self) -> int:
        return sum(s.arena_bytes for s in self.slots)

    @property
    def persistent_bytes(self) -> int:
        return sum(s.persistent_bytes for s in self.slots)

    @property
    def total_bytes(self) -> int:
        return self.arena_bytes + self.persistent_bytes

    def resources_of_type(self, type_name: str) -> list[ResourceReport]:
        return [r for s in self.slots for r in s.resources if r.type_name == type_name]

    def format(self) -> str:
        lines = [f"workspace on {self.device} ({'locked' if self.locked else 'open'})"]
        for s in self.slots:
            lines.append(
                f"  slot (ubatch={s.ubatch}, lane={s.lane}): arena {s.arena_bytes} B, "
                f"{len(s.resources)} persistent resources, {s.persistent_bytes} B"
            )
            for r in s.resources:
                lines.append(f"    {r.kind} {r.type_name} {r.key!r}: {r.nbytes} B")
        lines.append(
            f"  total: arena {self.arena_bytes} B + persistent "
            f"{self.persistent_bytes} B = {self.total_bytes} B"
        )
        return "\n".join(lines)
