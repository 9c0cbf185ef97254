"""The static inputs a captured decode, verify or MTP step reads (`engine.decode_graphs.StaticRows`) and the choice of
the graph that runs a step: a step's rows are copied in, the graph's padding rows point at the scratch slot and
page (whatever an earlier, larger step left there), and a step runs in the smallest shape of its tokens a
request that holds it."""

from __future__ import annotations

import torch

from engine.decode_graphs import StaticRows, graph_shapes, smallest_holding

SCRATCH_SLOT, SCRATCH_PAGE = 9, 99


def test_padding_rows_point_at_the_scratch_slot_and_page():
    rows = StaticRows(16, 3, SCRATCH_SLOT, SCRATCH_PAGE, torch.device("cpu"))
    # An earlier step of 4 requests x 2 tokens fills every row of its shape.
    rows.fill((4, 2), torch.arange(8), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), torch.arange(8) + 5,
              torch.arange(24).view(8, 3))
    # Then 3 requests x 2 tokens in the same shape: the fourth request's rows are padding.
    slots = torch.tensor([4, 4, 6, 6, 7, 7])
    rows.fill((4, 2), torch.tensor([11, 12, 13, 14, 15, 16]), slots, torch.tensor([3, 4, 8, 9, 0, 1]),
              torch.full((6, 3), 2))
    assert rows.tokens[:6].tolist() == [11, 12, 13, 14, 15, 16]
    assert rows.slot_ids[:8].tolist() == [4, 4, 6, 6, 7, 7, SCRATCH_SLOT, SCRATCH_SLOT]
    assert rows.positions[:8].tolist() == [3, 4, 8, 9, 0, 1, 0, 0]
    assert (rows.page_table[6:8] == SCRATCH_PAGE).all() and (rows.page_table[:6] == 2).all()
    assert rows.request_slots[:4].tolist() == [4, 6, 7, SCRATCH_SLOT]
    meta = rows.meta(3, 2)
    assert meta.per_request == 2 and meta.slots.tolist() == slots.tolist()
    assert meta.request_slots.tolist() == [4, 6, 7]
    assert rows.meta(3, 1).request_slots.tolist() == [4, 4, 6]  # one token a request: its rows' slots


def test_a_step_runs_in_the_smallest_shape_that_holds_it():
    shapes = graph_shapes((1, 2, 4, 8), (1, 2, 4))
    assert (8, 1) in shapes and (8, 2) in shapes and (4, 4) in shapes and (8, 4) not in shapes  # 16 rows at most
    assert smallest_holding(shapes, 3, 1) == (4, 1)
    assert smallest_holding(shapes, 3, 2) == (4, 2)
    assert smallest_holding(shapes, 5, 4) is None  # runs eagerly
    assert smallest_holding(shapes, 2, 3) is None  # no graph of 3 tokens a request
