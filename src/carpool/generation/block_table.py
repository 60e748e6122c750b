"""The runner's persistent block tables: one tensor row per sequence it is running, kept
from step to step and updated with each step's new blocks only (as vLLM v1's
``BlockTable`` is), so a step does not rebuild every sequence's table::

    rows      seq 7 -> row 0     seq 9 -> row 1     (a finished sequence's row is reused)
    table     row 0  [ 12  3  7  .  . ]   num_blocks 3
              row 1  [  4  .  .  .  . ]   num_blocks 1   (int64 [rows, columns], grows)

A step's chunk carries its sequence's whole block table (a tuple); :meth:`BlockTables.update`
compares it with the one it saw last for that sequence and writes only the blocks after
it. A table that does not extend the last one (a sequence preempted and admitted again, an
id reused) is written whole, so ``table[row, :len(t)]`` always equals the tuple ``t``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


class BlockTables:
    """Block ids of the running sequences as rows of one int64 tensor (``table``)."""

    def __init__(self, device: torch.device, num_rows: int = 64, num_columns: int = 64) -> None:
        self.device = device
        self.table = torch.zeros((num_rows, num_columns), dtype=torch.long, device=device)
        self._rows: dict[int, int] = {}  # seq id -> row
        self._seen: dict[int, tuple[int, ...]] = {}  # seq id -> the table its row holds
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def update(self, seq_ids: Sequence[int], tables: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """Bring each sequence's row up to its table; returns their row indices [n]."""
        rows: list[int] = []
        for seq_id, blocks in zip(seq_ids, tables, strict=True):
            row = self._rows.get(seq_id)
            if row is None:
                row = self._rows[seq_id] = self._take_row()
                start = 0
            else:
                seen = self._seen[seq_id]
                start = len(seen) if blocks[: len(seen)] == seen else 0
            if start < len(blocks):
                if len(blocks) > self.table.shape[1]:
                    self._grow(columns=max(len(blocks), 2 * self.table.shape[1]))
                new = torch.tensor(blocks[start:], dtype=torch.long)
                self.table[row, start : len(blocks)] = new.to(self.device)
            self._seen[seq_id] = blocks
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Release the rows of sequences that finished (unknown ids are ignored)."""
        for seq_id in seq_ids:
            row = self._rows.pop(seq_id, None)
            if row is not None:
                del self._seen[seq_id]
                self._free_rows.append(row)

    @property
    def num_sequences(self) -> int:
        return len(self._rows)

    def _take_row(self) -> int:
        if not self._free_rows:
            num_rows = self.table.shape[0]
            self._grow(rows=2 * num_rows)
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int = 0, columns: int = 0) -> None:
        old = self.table
        shape = (max(rows, old.shape[0]), max(columns, old.shape[1]))
        self.table = torch.zeros(shape, dtype=torch.long, device=self.device)
        self.table[: old.shape[0], : old.shape[1]] = old
