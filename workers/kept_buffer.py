"""A step's large scratch tensor, kept from one step to the next instead of allocated afresh.

On a CPU, glibc serves an allocation of 32 MB or more (a batch's rows of a 152k-token
vocabulary) with a fresh mmap and unmaps it on release, so a tensor made every step pays page
faults on every page it writes, often more than the work written into it: 64 rows of a
151,936-token vocabulary took 11 ms to convert into a fresh tensor, 1.2 ms into a kept one.
"""

from __future__ import annotations

import torch


class KeptBuffer:
    """Rows of one width, dtype and device, grown when a step needs more rows and never shrunk
    (at most the batch's sequences). What `rows` returns is valid until its next call.

    Kept on a CPU only: an accelerator's caching allocator already reuses what a step freed,
    so a fresh tensor costs nothing there, and one held for good would take memory the KV
    pool was sized without."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None  # [capacity_rows, width]

    def rows(
        self, num_rows: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised, contiguous [num_rows, width] view of the kept tensor (on a CPU;
        elsewhere a fresh tensor)."""
        if device.type != "cpu":
            return torch.empty((num_rows, width), dtype=dtype, device=device)
        buffer = self._buffer
        if (
            buffer is None
            or buffer.shape[0] < num_rows
            or buffer.shape[1] != width
            or buffer.dtype != dtype
            or buffer.device != device
        ):
            buffer = self._buffer = torch.empty((num_rows, width), dtype=dtype, device=device)
        return buffer[:num_rows]
