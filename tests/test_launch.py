"""Tests of runtime.launch.run_on_ranks: forked gloo ranks, results, failures, timeouts."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from runtime.launch import RankFailure, RankTimeout, run_on_ranks, world_info


def _all_reduce_rank(rank, world_size, n):
    t = torch.full((n,), float(rank + 1))
    dist.all_reduce(t)
    return t


def test_all_reduce_on_4_ranks():
    out = run_on_ranks(_all_reduce_rank, 4, 5)
    assert len(out) == 4
    expected = torch.full((5,), 1.0 + 2 + 3 + 4)
    for t in out:
        assert isinstance(t, torch.Tensor)
        torch.testing.assert_close(t, expected)


def _mixed_values(rank, world_size, scale, *, offset):
    assert world_info() == (rank, world_size)
    assert os.environ["RANK"] == str(rank)
    assert os.environ["WORLD_SIZE"] == str(world_size)
    assert os.environ["LOCAL_RANK"] == str(rank)
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert torch.get_num_threads() == 1
    big = torch.arange(1000, dtype=torch.float64) * rank
    return {
        "rank": rank,
        "tensor": torch.arange(3) * scale + offset + rank,
        "slice": big[10:12],  # a view: must come back with the right values
        "grad": torch.ones(2, requires_grad=True) * rank,
        "text": f"r{rank}",
    }


def test_results_are_ordered_by_rank_and_tensors_survive():
    out = run_on_ranks(_mixed_values, 3, 10, offset=100)
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert [o["text"] for o in out] == ["r0", "r1", "r2"]
    for rank, o in enumerate(out):
        torch.testing.assert_close(o["tensor"], torch.tensor([0, 10, 20]) + 100 + rank)
        torch.testing.assert_close(o["slice"], torch.tensor([10.0, 11.0], dtype=torch.float64) * rank)
        torch.testing.assert_close(o["grad"].detach(), torch.full((2,), float(rank)))
    # the parent process itself stays free of any process group
    assert not dist.is_initialized()
    assert world_info() == (0, 1)


def _raise_on_rank_2(rank, world_size):
    if rank == 2:
        raise ValueError("bad shard on purpose")
    t = torch.ones(4)
    dist.all_reduce(t)  # blocks: rank 2 never joins
    dist.barrier()
    return t


def test_exception_on_one_rank_is_reported_quickly():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        # long collective timeout: only failure propagation can make this quick
        run_on_ranks(_raise_on_rank_2, 4, timeout_s=60, collective_timeout_s=60)
    elapsed = time.monotonic() - t0
    assert elapsed < 15, elapsed
    msg = str(info.value)
    assert "rank 2" in msg
    assert "ValueError" in msg
    assert "bad shard on purpose" in msg
    assert "_raise_on_rank_2" in msg  # the worker's traceback is included
    assert info.value.rank == 2
    assert info.value.exc_type == "ValueError"
    assert not isinstance(info.value, RankTimeout)


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        while True:
            time.sleep(1000)
    return rank


def test_hanging_rank_times_out_quickly():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(_hang_on_rank_1, 2, timeout_s=3)
    elapsed = time.monotonic() - t0
    assert 3 <= elapsed < 10, elapsed
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, RankFailure)
    assert info.value.unfinished == [1]
    msg = str(info.value)
    assert "[1]" in msg and "had not finished" in msg
    assert "_hang_on_rank_1" in msg  # the stack of the hanging rank at the timeout


def _exit_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


def test_silent_exit_is_reported_with_exit_code():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_exit_on_rank_1, 3, timeout_s=30)
    assert time.monotonic() - t0 < 15
    msg = str(info.value)
    assert "rank 1" in msg
    assert "exit code 3" in msg
    assert info.value.exitcode == 3


def _rank_sum(rank, world_size):
    t = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(t)
    dist.barrier()
    return int(t.item()), world_size


def test_eight_ranks():
    out = run_on_ranks(_rank_sum, 8, timeout_s=60)
    assert out == [(sum(range(8)), 8)] * 8


def test_unpicklable_result_is_a_clear_failure():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(lambda rank, ws: (lambda: None), 2, timeout_s=30)
    msg = str(info.value)
    assert "serialising its return value" in msg


def test_refuses_parent_with_initialised_process_group(fake_process_group):
    fake_process_group(2)                       # refused before anything is forked: one process is enough
    with pytest.raises(RuntimeError, match="already has an initialised default process group"):
        run_on_ranks(_rank_sum, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_on_ranks(_rank_sum, 0)
    with pytest.raises(ValueError, match="timeout_s"):
        run_on_ranks(_rank_sum, 2, timeout_s=0)


def test_port_taken_between_probe_and_bind_is_retried(monkeypatch):
    import socket

    import runtime.launch as launch

    real = launch.find_free_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(launch, "find_free_port", lambda *a: next(ports, None) or real())
        out = run_on_ranks(_rank_sum, 2, timeout_s=30)
    assert out == [(1, 2)] * 2


def _killed_on_rank_0(rank, world_size):
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
    dist.barrier()
    return rank


def test_rank_killed_by_signal_is_named():
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_killed_on_rank_0, 2, timeout_s=30)
    assert "rank 0 was killed by signal SIGKILL" in str(info.value)
    assert info.value.exitcode == -signal.SIGKILL


def _late_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(60)
    dist.barrier()
    return rank


def test_short_collective_timeout_reaches_the_ranks():
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_late_on_rank_1, 2, timeout_s=60, collective_timeout_s=1)
    assert time.monotonic() - t0 < 10
    assert not isinstance(info.value, RankTimeout)  # the collective timed out, not the run
    msg = str(info.value)
    assert "rank 0 raised" in msg and "Timed out" in msg
    assert "Ranks terminated while still running: [1]" in msg
