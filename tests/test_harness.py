"""The worker-pool harness itself: a job past its deadline comes back with
every rank's stack, and a raising rank with its traceback and exception."""

from __future__ import annotations

import time

import pytest
from _dist import RankFailed, run_ranks


def _sleepy(rank_to_sleep: int) -> int:
    import torch.distributed as dist

    if dist.get_rank() == rank_to_sleep:
        time.sleep(60)
    return dist.get_rank()


def _raises() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("rank one")


@pytest.mark.world_size(2)
def test_a_job_past_its_deadline_reports_stacks():
    assert run_ranks(_sleepy, -1, world_size=2) == [0, 1]  # workers up, this module imported
    with pytest.raises(TimeoutError) as err:
        run_ranks(_sleepy, 1, world_size=2, timeout=3)
    text = str(err.value)
    assert "ranks [1] did not finish within 3 s" in text
    assert "File" in text and "_sleepy" in text  # faulthandler's dump of rank 1


@pytest.mark.world_size(2)
def test_a_raising_rank_comes_back_with_its_traceback():
    with pytest.raises(RankFailed) as err:
        run_ranks(_raises, world_size=2)
    assert isinstance(err.value.errors[1], KeyError) and list(err.value.errors) == [1]
    assert "rank one" in err.value.tracebacks[1] and "--- rank 1 ---" in str(err.value)
    assert run_ranks(_sleepy, -1, world_size=2) == [0, 1]  # a fresh pool afterwards
