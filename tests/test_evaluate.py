import math

import pytest

from megatron_dapo.evaluate import majority_vote
from megatron_dapo.evaluate import pass_at_k
from megatron_dapo.evaluate import score_groups


def test_pass_at_k_against_combinatorics():
    for n, c, k in [(10, 3, 1), (10, 3, 5), (32, 1, 32), (32, 0, 8), (5, 5, 2)]:
        expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_majority_vote_and_groups():
    assert majority_vote(["3", None, "4", "4", "3", "4"]) == "4"
    assert majority_vote(["3", "4"]) == "3" and majority_vote([None, None]) is None
    r = lambda acc, pred: {"acc": acc, "pred": pred}
    groups = [
        [r(True, "7"), r(False, "8"), r(False, "8"), r(True, "7")],  # tie 7/8 -> first seen "7" -> correct
        [r(False, "1"), r(False, "1"), r(True, "2"), r(False, None)],  # majority wrong
        [r(False, None)] * 4,
    ]
    m = score_groups(groups, 4)
    assert m["eval/avg@4"] == pytest.approx((0.5 + 0.25 + 0) / 3)
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/cons@4"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="expected 4 samples"):
        score_groups([[r(True, "1")]], 4)
