"""The activity table counts only a padded forward's real tokens (experts/activity.py: counted_rows)."""
import torch

from pagedmoe.experts.activity import ALL_ROWS, ActivityTable, padding_excluded


def test_record_counts_the_rows_below_counted_rows_and_padding_excluded_restores_all():
    table = ActivityTable(2, 5, torch.device("cpu"))
    ids = torch.tensor([[0, 1], [1, 2], [3, 4], [4, 4]])
    table.record(0, ids)   # eager: every row
    assert table.step_counts[0].tolist() == [1, 2, 1, 1, 3]
    with padding_excluded(table, 2):   # a replay of 2 real tokens padded to 4
        table.record(1, ids)
    assert table.step_counts[1].tolist() == [1, 2, 1, 0, 0]
    assert table.counted_rows.item() == ALL_ROWS
    big = torch.randint(0, 5, (3000, 2))   # more slots than the table's arange
    table.reset()
    with padding_excluded(table, 2500):
        table.record(0, big)
    assert table.step_counts[0].sum().item() == 5000
    with padding_excluded(None, 3):   # no table: nothing to do
        pass
