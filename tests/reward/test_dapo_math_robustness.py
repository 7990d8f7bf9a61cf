"""Robustness of compute_score: never raises, bounded time on random and adversarial (1 MB) inputs."""

import time

import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from megatron_dapo.reward import ANSWER_FORMATS
from megatron_dapo.reward import compute_score

PER_CALL_BOUND_S = 0.05

# Fragments that exercise every branch of the extractors and the normaliser.
FRAGMENTS = [
    "Answer:", "answer :", "ANSWER:", "**Answer:**", "\\boxed{", "\\boxed", "\\fbox{", "{", "}", "$", "\\(", "\\)",
    "\\text{", "\\frac{", "\\left(", "\\right)", "^\\circ", "\\%", "\\,", "{,}", "1", "42", "-", "\u2212", "+",
    ",", ",000", ".", ".0", "0", " ", "\n", "\t", "x", "=", "or", "degrees", "*", "^", "(", ")", "e", "\\",
]  # fmt: skip

solutions = st.one_of(
    st.text(max_size=320),
    st.lists(st.sampled_from(FRAGMENTS), max_size=80).map("".join),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=5)), max_size=60).map("".join),
)
truths = st.one_of(st.integers(min_value=-(10**12), max_value=10**12), st.sampled_from(["42", "-7", "1,000", "0"]))


@settings(max_examples=2000, deadline=200, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(solution=solutions, truth=truths, answer_format=st.sampled_from(ANSWER_FORMATS))
def test_never_raises_and_is_fast(solution, truth, answer_format):
    start = time.perf_counter()
    out = compute_score(solution, truth, answer_format=answer_format)
    elapsed = time.perf_counter() - start
    assert elapsed < PER_CALL_BOUND_S
    assert set(out) == {"score", "acc", "pred"}
    assert out["score"] == (1.0 if out["acc"] else -1.0)
    assert isinstance(out["acc"], bool)
    assert out["pred"] is None or isinstance(out["pred"], str)
    if out["acc"]:
        assert out["pred"] == str(int(str(truth).replace(",", "")))


@settings(max_examples=300, deadline=200, database=None)
@given(value=st.integers(min_value=-(10**15), max_value=10**15), noise=st.text(max_size=200))
def test_round_trip_integer(value, noise):
    """Any integer written as the answer after arbitrary prose scores correct in all of its spellings."""
    prose = noise.replace("\n", " ") + "\n"
    grouped = f"{value:,}"
    for spelling in (str(value), f"${value}$", f"\\boxed{{{grouped}}}", f"{value}.0", grouped.replace("-", "\u2212")):
        assert compute_score(prose + "Answer: " + spelling, value)["acc"], spelling
        assert not compute_score(prose + "Answer: " + spelling, value + 1)["acc"], spelling


ADVERSARIAL = {
    "answer_markers": "Answer:" * 150_000,
    "answer_spaces": "Answer" + " " * 1_000_000,
    "thousands": "1," * 500_000,
    "boxed_open": "\\boxed{" * 150_000,
    "nested_braces": "{" * 500_000 + "}" * 500_000,
    "digits": "9" * 1_000_000,
    "dots": "1." * 500_000,
    "wrappers": "\\text{" * 170_000,
    "answer_then_digits": "Answer: " + "1" * 1_000_000,
    "answer_then_mixed": "Answer: " + "1,1.-" * 200_000,
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
@pytest.mark.parametrize("answer_format", ANSWER_FORMATS)
def test_one_megabyte_adversarial_input(name, answer_format):
    solution = ADVERSARIAL[name]
    assert len(solution) >= 1_000_000
    start = time.perf_counter()
    out = compute_score(solution, 42, answer_format=answer_format)
    assert time.perf_counter() - start < 1.0
    assert out["acc"] is False
