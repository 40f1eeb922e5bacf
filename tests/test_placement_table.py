"""PlacementTable: validation and routing (replicas included)."""

from __future__ import annotations

import pytest
import torch

from hf_hybrid_ep import HybridEPConfigError, PlacementTable


def test_contiguous_table():
    table = PlacementTable.contiguous(8, 4)
    assert table.rows == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert table.is_contiguous()
    rank, slot = table.route(torch.tensor([0, 3, 7, 4]), src_ep_rank=0)
    assert rank.tolist() == [0, 1, 3, 2] and slot.tolist() == [0, 1, 1, 0]


def test_permuted_table_routes_through_the_table():
    table = PlacementTable.from_rows(4, [[3, 0], [1, 2]])
    assert not table.is_contiguous()
    rank, slot = table.route(torch.tensor([0, 1, 2, 3]), src_ep_rank=1)
    assert rank.tolist() == [0, 1, 1, 0] and slot.tolist() == [1, 0, 1, 0]


def test_replicas_prefer_the_local_copy_then_spread():
    table = PlacementTable.from_rows(4, [[0, 1, 2], [2, 3, 0]])
    assert table.holders(0) == [0, 1] and table.holders(1) == [0]
    rank, _ = table.route(torch.tensor([2, 2, 0]), src_ep_rank=1)
    assert rank.tolist() == [1, 1, 1]  # rank 1 holds 2 and 0 itself
    table3 = PlacementTable.from_rows(3, [[0, 1], [0, 2], [1, 2]])
    rank, slot = table3.route(torch.tensor([0, 0, 0, 0]), src_ep_rank=2)  # rank 2 has no copy of 0
    assert rank.tolist() == [0, 1, 0, 1] and slot.tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize(
    ("rows", "needle"),
    [
        ([[0, 1], [1, 2]], r"places no replica of expert\(s\) \[3\]"),
        ([[0, 0], [1, 2, 3]], "lists an expert twice"),
        ([[0, 1], [2, 4]], "names expert 4, outside"),
        ([[0, 1, 2, 3], []], "row 1 is empty"),
    ],
)
def test_bad_tables_are_refused(rows, needle):
    with pytest.raises(HybridEPConfigError, match=needle):
        PlacementTable.from_rows(4, rows)


def test_contiguous_needs_divisibility():
    with pytest.raises(HybridEPConfigError, match="num_experts=6 is not divisible by ep_degree=4"):
        PlacementTable.contiguous(6, 4)
