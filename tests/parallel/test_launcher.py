import pytest
import torch
import torch.distributed as dist

from tests._launcher import WorkerError


def _allreduce_rank() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")


def test_launcher_runs_collectives(launcher):
    assert launcher(2, _allreduce_rank) == [1.0, 1.0]


def test_launcher_reports_rank_errors(launcher):
    with pytest.raises(WorkerError, match="boom on rank 1"):
        launcher(2, _fail_on_rank_one)
    assert launcher(2, _allreduce_rank) == [1.0, 1.0]
