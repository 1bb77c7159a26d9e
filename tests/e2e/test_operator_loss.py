"""The operator killed while it scales, a few times in one run (bench/operator_loss.py kills it
twenty times and more): tests/e2e/operator_loss.py says what must hold."""

from __future__ import annotations

import pytest

from tests.e2e.operator_loss import check, lose_the_operator

pytestmark = pytest.mark.slow

KILLS = 2


@pytest.mark.timeout(400)
def test_an_operator_killed_while_scaling_decides_nothing_twice_and_loses_no_step(tmp_path):
    summary = check(lose_the_operator(tmp_path, kills=KILLS, seed=1), KILLS)
    assert summary["ok"], summary
