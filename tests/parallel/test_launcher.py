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


_CALLS = []


def _count_calls(tag: str) -> dict:
    _CALLS.append(tag)
    return {"calls": len(_CALLS), "last": _CALLS[-1], "rank": [dist.get_rank()]}


def test_shared_runs_once_and_every_caller_gets_its_own_copy(launcher):
    remembered = len(launcher.results)
    first = launcher.shared(2, _count_calls, "shared-once")
    want = [{"calls": first[r]["calls"], "last": "shared-once", "rank": [r]} for r in range(2)]
    assert first == want and len(launcher.results) == remembered + 1
    first[0]["rank"].append("changed by a test")
    assert launcher.shared(2, _count_calls, tag="shared-once") == want  # the same arguments, spelt differently
    assert len(launcher.results) == remembered + 1
    assert launcher.shared(2, _count_calls, "other")[0]["last"] == "other"  # other arguments: another run
    assert len(launcher.results) == remembered + 2


def test_trainer_run_key_reads_spellings_of_one_run_as_one():
    from tests.strategies._lm import GLOBAL_BATCH, tiny_config, trainer_run

    key, config = trainer_run.run_key, tiny_config()
    zero3 = key(2, dict(zero_stage=3), config, 3, clip=1.0)
    assert zero3 == key(2, dict(zero3_impl="flat", zero_stage=3), config, 3, clip=1.0, accumulate=1, batch_size=2)
    assert zero3 != key(2, dict(zero_stage=3, zero3_impl="fsdp2"), config, 3, clip=1.0)
    assert zero3 != key(2, dict(zero_stage=3), config, 3, clip=1.0, batch_size=GLOBAL_BATCH)
    tied = tiny_config(tie_word_embeddings=True)  # where flat may refuse, "auto" is not read as flat
    assert key(2, dict(zero_stage=3), tied, 3) != key(2, dict(zero_stage=3, zero3_impl="flat"), tied, 3)
    cp = key(2, dict(context_parallel_size=2), config, 3, clip=1.0)
    assert cp == key(2, dict(context_parallel_size=2, context_parallel_mode="ring"), config, 3, clip=1.0, ragged=True)
    assert cp != key(2, dict(context_parallel_size=2, context_parallel_mode="ulysses"), config, 3, clip=1.0)
    pp = dict(pipeline_parallel_size=2, micro_batch_size=1)
    assert key(2, pp, config, 3) == key(
        2, dict(pp, virtual_pipeline_parallel_size=1, pipeline_schedule="1f1b"), config, 3
    )
    assert key(2, pp, config, 3) != key(4, pp, config, 3)


def _make_groups(n: int) -> int:
    for _ in range(n):
        dist.new_group(backend="gloo")
    return n


def test_pool_counts_the_process_groups_its_workers_hold(launcher):
    launcher(2, _allreduce_rank)
    before = launcher.pools[2].groups
    launcher(2, _make_groups, 2)
    assert launcher.pools[2].groups == before + 2
