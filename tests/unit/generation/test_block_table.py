"""The runner's persistent block tables: rows always hold each sequence's latest table."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from carpool.generation.block_table import BlockTables


def _row(tables: BlockTables, seq_id: int, blocks: tuple[int, ...]) -> list[int]:
    row = tables.update([seq_id], [blocks])
    return tables.table[row[0], : len(blocks)].tolist()


def test_a_growing_table_keeps_its_row_and_gains_its_new_blocks() -> None:
    tables = BlockTables(torch.device("cpu"), num_rows=2, num_columns=2)
    first = tables.update([7], [(4,)])
    assert _row(tables, 7, (4, 9, 2)) == [4, 9, 2]  # past the first 2 columns: grows
    assert tables.update([7], [(4, 9, 2)]).tolist() == first.tolist()


def test_a_table_that_does_not_extend_the_last_is_written_whole() -> None:
    tables = BlockTables(torch.device("cpu"))
    _row(tables, 1, (3, 4, 5))
    assert _row(tables, 1, (8, 4)) == [8, 4]  # preempted and admitted again


def test_finished_rows_are_reused_and_rows_grow_past_the_first() -> None:
    tables = BlockTables(torch.device("cpu"), num_rows=1, num_columns=4)
    a = tables.update([1, 2], [(1,), (2,)]).tolist()
    assert len(set(a)) == 2
    tables.forget([1, 99])
    assert tables.num_sequences == 1
    assert tables.update([3], [(5,)]).tolist() == [a[0]]
    assert _row(tables, 2, (2,)) == [2]


@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 50), max_size=9))))
def test_rows_always_equal_the_latest_tables(updates: list[tuple[int, list[int]]]) -> None:
    tables = BlockTables(torch.device("cpu"), num_rows=1, num_columns=1)
    latest: dict[int, tuple[int, ...]] = {}
    for seq_id, blocks in updates:
        latest[seq_id] = tuple(blocks)
        tables.update([seq_id], [tuple(blocks)])
        for other, table in latest.items():
            assert _row(tables, other, table) == list(table)
