"""Read the per-kernel resource report of `ptxas -v` (nvcc -Xptxas -v) into records."""

from __future__ import annotations

import re
from dataclasses import dataclass

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")
_CMEM = re.compile(r"(\d+) bytes cmem\[0\]")


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one entry function on one architecture.

    Attributes:
        name: the (mangled) entry function name.
        arch: the target, e.g. "sm_80".
        registers: registers per thread.
        barriers: named barriers used, None when ptxas did not say.
        smem_bytes: static shared memory per block (0 when ptxas omits it).
        cmem_bytes: constant bank 0 bytes; None when omitted (sm_90 does not print it).
        stack_frame_bytes: per-thread stack frame.
        spill_store_bytes: bytes spilled to local memory.
        spill_load_bytes: bytes reloaded from spills.
    """

    name: str
    arch: str
    registers: int
    barriers: int | None
    smem_bytes: int
    cmem_bytes: int | None
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


def _optional(pattern: re.Pattern[str], line: str) -> int | None:
    m = pattern.search(line)
    return int(m.group(1)) if m else None


def parse_ptxas(stderr: str) -> list[KernelResources]:
    """Every entry function in a ptxas -v report, in the order printed (one block per entry and arch).

    "Function properties" blocks of non-entry device functions are skipped; an entry without a "Used N registers"
    line (ptxas always prints one) is skipped too.
    """
    out: list[KernelResources] = []
    entry: tuple[str, str] | None = None
    frame: tuple[int, int, int] = (0, 0, 0)
    props_for: str | None = None
    for line in stderr.splitlines():
        if m := _ENTRY.search(line):
            entry, frame, props_for = (m.group(1), m.group(2)), (0, 0, 0), None
        elif m := _PROPS.search(line):
            props_for = m.group(1)
        elif (m := _FRAME.search(line)) and entry is not None and props_for == entry[0]:
            frame = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _USED.search(line)) and entry is not None:
            out.append(KernelResources(
                name=entry[0], arch=entry[1], registers=int(m.group(1)), barriers=_optional(_BARRIERS, line),
                smem_bytes=_optional(_SMEM, line) or 0, cmem_bytes=_optional(_CMEM, line),
                stack_frame_bytes=frame[0], spill_store_bytes=frame[1], spill_load_bytes=frame[2]))
            entry = None
    return out
