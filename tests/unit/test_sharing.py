"""The host's sharing probe: how many copies it runs, and what it returns."""

import threading

import pytest

from tidal_agent.sharing import measure_sharing, sharing_copies


def test_copies_put_two_ranks_on_every_core():
    assert sharing_copies(2, cores=2) == 2  # 4 ranks on 2 cores
    assert sharing_copies(1, cores=2) == 4
    assert sharing_copies(3, cores=8) == 6  # 18 ranks: at least two per core
    assert sharing_copies(2, threads=2, cores=8) == 4  # 4 two-thread ranks at once
    assert sharing_copies(3, cores=2) == 0  # the run alone shares the cores: no probe
    assert sharing_copies(1, threads=4, cores=2) == 2  # a rank wider than the host


def test_the_copies_run_at_once_and_their_median_step_is_the_result():
    started = threading.Barrier(3, timeout=10)  # fails unless all three run together
    steps = iter([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    lock = threading.Lock()

    def train():
        started.wait()
        with lock:
            return next(steps)

    probe = measure_sharing(train, 3)
    assert probe["copies"] == 3
    assert sorted(probe["steps"]) == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert probe["step_s"] == 3.5


def test_a_failing_copy_fails_the_probe_after_all_have_ended():
    ended = []

    def train():
        if threading.current_thread().name.endswith("-0"):
            raise OSError("no port")
        ended.append(True)
        return [1.0]

    with pytest.raises(RuntimeError, match="sharing probe failed: no port"):
        measure_sharing(train, 2)
    assert ended == [True]
