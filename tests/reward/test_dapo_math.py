"""Tests for megatron_dapo.reward.dapo_math: extraction, normalisation, scoring, formats, bad input."""

import importlib.util
import subprocess
import sys
import threading
import warnings
from types import SimpleNamespace

import pytest

from megatron_dapo.reward import ANSWER_FORMATS
from megatron_dapo.reward import TAIL_CHARS
from megatron_dapo.reward import Verifier
from megatron_dapo.reward import compute_score
from megatron_dapo.reward import dapo_math
from megatron_dapo.reward import extract_answer
from megatron_dapo.reward import make_verifier
from megatron_dapo.reward import parse_integer

PROSE = "Let me think step by step. 6 times 7 is 42, and 3 more is 45.\n"

# (solution, ground_truth, answer_format, expected acc, expected pred)
CASES = [
    # answer_line: DAPO's format and its tolerated variations
    ("Answer: 42", 42, "answer_line", True, "42"),
    (PROSE + "Answer: 42", "42", "answer_line", True, "42"),
    ("Answer: $42$", 42, "answer_line", True, "42"),
    ("Answer: \\boxed{42}", 42, "answer_line", True, "42"),
    ("Answer: $\\boxed{42}$", 42, "answer_line", True, "42"),
    ("Answer: \\text{42}", 42, "answer_line", True, "42"),
    ("Answer: \\textbf{42}", 42, "answer_line", True, "42"),
    ("Answer: 1,000", 1000, "answer_line", True, "1000"),
    ("Answer: 1,000", "1,000", "answer_line", True, "1000"),
    ("Answer: 1{,}000", 1000, "answer_line", True, "1000"),
    ("Answer: 1,234,567", 1234567, "answer_line", True, "1234567"),
    ("Answer: 042", 42, "answer_line", True, "42"),
    ("Answer: 42.", 42, "answer_line", True, "42"),
    ("Answer: 42.0", 42, "answer_line", True, "42"),
    ("Answer: 42.00", "42", "answer_line", True, "42"),
    ("Answer: 42 degrees", 42, "answer_line", True, "42"),
    ("Answer: 42^\\circ", 42, "answer_line", True, "42"),
    ("Answer: 42\\%", 42, "answer_line", True, "42"),
    ("Answer: -5", -5, "answer_line", True, "-5"),
    ("Answer: \\(-5\\)", -5, "answer_line", True, "-5"),
    ("Answer: \u22125", -5, "answer_line", True, "-5"),
    ("Answer: $\u22125$", "-5", "answer_line", True, "-5"),
    ("Answer: -7", "-7", "answer_line", True, "-7"),
    ("Answer: 5", -5, "answer_line", False, "5"),
    ("answer : 42", 42, "answer_line", True, "42"),
    ("ANSWER:42", 42, "answer_line", True, "42"),
    ("answer:\t 42  ", 42, "answer_line", True, "42"),
    ("**Answer:** 42", 42, "answer_line", True, "42"),
    ("**Answer**: 42", 42, "answer_line", True, "42"),
    ("Final Answer: The answer is 42.", 42, "answer_line", True, "42"),
    ("Answer: x = 42", 42, "answer_line", True, "42"),
    ("Answer: 41\nsorry\nAnswer: 42", 42, "answer_line", True, "42"),
    ("Answer: 42\nAnswer: 41", 42, "answer_line", False, "41"),
    ("Answer: 0", 0, "answer_line", True, "0"),
    ("Answer: -0", 0, "answer_line", True, "0"),
    # answer_line: ambiguous or wrong -> score -1
    ("Answer: 42 or 43", 42, "answer_line", False, "42 or 43"),
    ("Answer: 4 2", 42, "answer_line", False, "4 2"),
    ("Answer: 42, 43", 42, "answer_line", False, "42, 43"),
    ("Answer: 42.5", 42, "answer_line", False, "42.5"),
    ("Answer:", 42, "answer_line", False, None),
    ("Answer:   \nthe result is 42", 42, "answer_line", False, None),
    ("Answer: 1,00", 100, "answer_line", False, "1,00"),
    ("Answer: 1,00", 1, "answer_line", False, "1,00"),
    ("Answer: 1.000.000", 1000000, "answer_line", False, "1.000.000"),
    ("Answer: 6*7", 42, "answer_line", False, "6*7"),
    ("Answer: 2^5", 32, "answer_line", False, "2^5"),
    ("Answer: x^2", 2, "answer_line", False, "x^2"),
    ("Answer: x-3", -3, "answer_line", False, "x-3"),
    ("Answer: \\frac{84}{2}", 42, "answer_line", False, "\\frac{84}{2}"),
    ("Answer: \\sqrt{4}", 4, "answer_line", False, "\\sqrt{4}"),
    ("Answer: 5!", 5, "answer_line", False, "5!"),
    ("Answer: 42cm", 42, "answer_line", False, "42cm"),
    ("Answer: forty-two", 42, "answer_line", False, "forty-two"),
    ("Answer: 42\u00b2", 42, "answer_line", False, "42\u00b2"),
    ("Answer: \u0664\u0662", 42, "answer_line", False, "\u0664\u0662"),
    ("Answer: __import__('os').system('echo 42')", 42, "answer_line", False, "__import__('os').system('echo 42')"),
    ("The answer is 42.", 42, "answer_line", False, None),
    ("\\boxed{42}", 42, "answer_line", False, None),
    # boxed
    ("so \\boxed{42}", 42, "boxed", True, "42"),
    ("$\\boxed{1,000}$.", 1000, "boxed", True, "1000"),
    ("\\boxed{41} no wait \\boxed{42}", 42, "boxed", True, "42"),
    ("\\boxed{\\text{42}}", 42, "boxed", True, "42"),
    ("\\boxed 42 done", 42, "boxed", True, "42"),
    ("\\fbox{-5}", -5, "boxed", True, "-5"),
    ("\\boxed{\\frac{84}{2}}", 42, "boxed", False, "\\frac{84}{2}"),
    ("\\boxed{42", 42, "boxed", False, None),
    ("\\boxed{}", 42, "boxed", False, None),
    ("Answer: 42", 42, "boxed", False, None),
    # last_number
    (PROSE + "So the total is 45.", 45, "last_number", True, "45"),
    ("it is 1,000 apples", 1000, "last_number", True, "1000"),
    ("x = \u22125", -5, "last_number", True, "-5"),
    ("12-5", 5, "last_number", True, "5"),
    ("the value is 3.5", 3, "last_number", False, "3.5"),
    ("the value is 42.0.", 42, "last_number", True, "42"),
    ("no digits at all", 0, "last_number", False, None),
    ("Answer: 42 then step 3", 42, "last_number", False, "3"),
]


def test_case_table_is_large_and_covers_every_format():
    assert len(CASES) >= 40
    assert {c[2] for c in CASES} == set(ANSWER_FORMATS)


@pytest.mark.parametrize("solution,truth,answer_format,acc,pred", CASES)
def test_case_table(solution, truth, answer_format, acc, pred):
    out = compute_score(solution, truth, answer_format=answer_format)
    assert out == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}
    assert Verifier(answer_format=answer_format)(solution, truth) == out


def test_default_format_is_answer_line():
    assert ANSWER_FORMATS == ("answer_line", "boxed", "last_number")
    assert compute_score("Answer: 7", 7)["acc"]
    assert not compute_score("\\boxed{7}", 7)["acc"]
    assert Verifier().answer_format == "answer_line"


def test_only_the_tail_is_inspected():
    assert TAIL_CHARS == 300
    answer = "Answer: 42\n"
    assert compute_score(answer + "x" * (TAIL_CHARS - len(answer)), 42)["acc"]
    assert not compute_score(answer + "x" * (TAIL_CHARS - len(answer) + 5), 42)["acc"]
    assert compute_score(answer + "x" * 400, 42, tail_chars=1000)["acc"]
    # a marker cut by the tail boundary is not seen either
    assert extract_answer("Answer: 42" + "y" * 295) is None


def test_extract_answer_returns_raw_text():
    assert extract_answer("bla\nAnswer: $\\boxed{7}$ apples\nmore") == "$\\boxed{7}$ apples"
    assert extract_answer("\\boxed{a{b}c} end", "boxed") == "a{b}c"
    assert extract_answer("1 then -2.5 and", "last_number") == "-2.5"
    assert extract_answer("nothing here") is None


@pytest.mark.parametrize(
    "text,value",
    [("42", 42), ("$-1,000$", -1000), ("+7", 7), ("(-5)", -5), ("\\left(-5\\right)", -5), ("0042.000", 42)],
)
def test_parse_integer(text, value):
    assert parse_integer(text) == value


@pytest.mark.parametrize("text", ["", "4.2e1", "1e3", "0x2A", "42/1", "--5", "1, 000", "12,3456"])
def test_parse_integer_rejects(text):
    assert parse_integer(text) is None


def test_ground_truth_types():
    assert compute_score("Answer: 42", 42.0)["acc"]
    assert compute_score("Answer: 1000", "$1,000$")["acc"]
    with pytest.raises(TypeError, match="ground_truth"):
        compute_score("Answer: 1", True)
    with pytest.raises(TypeError, match="ground_truth"):
        compute_score("Answer: 1", [1])
    with pytest.raises(ValueError, match="ground_truth"):
        compute_score("Answer: 1", "  ")
    with pytest.raises(ValueError, match="ground_truth"):
        compute_score("Answer: 1", 1.5)
    with pytest.raises(TypeError, match="solution"):
        compute_score(b"Answer: 1", 1)


@pytest.mark.parametrize("call", [
    lambda: compute_score("Answer: 1", 1, answer_format="json"),
    lambda: extract_answer("Answer: 1", "Boxed"),
    lambda: Verifier(answer_format="last-number"),
    lambda: make_verifier("x"),
    lambda: Verifier.from_config(SimpleNamespace(answer_format="nope")),
])  # fmt: skip
def test_unknown_answer_format_names_the_config_field(call):
    with pytest.raises(ValueError, match=r"reward\.answer_format"):
        call()


def test_verifier_factory():
    v = Verifier.from_config(SimpleNamespace(answer_format="boxed"))
    assert v == make_verifier("boxed")
    assert v("\\boxed{3}", 3) == {"score": 1.0, "acc": True, "pred": "3"}
    with pytest.raises(ValueError, match="tail_chars"):
        Verifier(tail_chars=0)


def test_non_integer_truth_fallback_without_math_verify(monkeypatch):
    monkeypatch.setattr(dapo_math, "_math_verify_installed", lambda: False)
    assert compute_score("Answer: $\\frac{1}{2}$", "\\frac{1}{2}")["acc"]
    assert compute_score("Answer: \\frac{1}{2}.", "$\\frac{1}{2}$")["acc"]
    assert not compute_score("Answer: 0.5", "\\frac{1}{2}")["acc"]  # exact compare: not symbolic
    assert not compute_score("Answer:", "\\frac{1}{2}")["acc"]


def test_non_integer_truth_with_math_verify():
    pytest.importorskip("math_verify")
    assert compute_score("Answer: 0.5", "\\frac{1}{2}")["acc"]
    assert compute_score("Answer: \\frac{2}{4}", "\\frac{1}{2}")["acc"]
    assert compute_score("Answer: $\\sqrt{2}/2$", "\\frac{\\sqrt{2}}{2}")["acc"]
    assert not compute_score("Answer: 0.6", "\\frac{1}{2}")["acc"]
    assert not compute_score("Answer: hello", "\\frac{1}{2}")["acc"]


def test_math_verify_off_the_main_thread():
    pytest.importorskip("math_verify")
    results = []
    thread = threading.Thread(target=lambda: results.append(compute_score("Answer: 0.25", "\\frac{1}{4}")))
    thread.start()
    thread.join(timeout=30)
    assert results and results[0]["acc"]


def test_default_path_imports_no_symbolic_engine():
    code = (
        "import sys\n"
        "from megatron_dapo.reward import compute_score\n"
        "for fmt in ('answer_line', 'boxed', 'last_number'):\n"
        "    compute_score('Answer: \\\\boxed{42} or \\\\frac{1}{2}', 42, answer_format=fmt)\n"
        "    compute_score('Answer: 42', '42', answer_format=fmt)\n"
        "bad = [m for m in ('sympy', 'math_verify', 'latex2sympy2_extended') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_exact_fallback_keeps_structure(monkeypatch):
    monkeypatch.setattr(dapo_math, "_math_verify_installed", lambda: False)
    assert compute_score("Answer: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}")["acc"]
    assert not compute_score("Answer: \\frac{12}{3}", "\\frac{1}{23}")["acc"]


def test_missing_math_verify_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # find_spec says "not installed"
    dapo_math._math_verify_installed.cache_clear()
    dapo_math._warn_exact_fallback.cache_clear()
    try:
        with pytest.warns(UserWarning, match="math-verify is not installed"):
            assert compute_score("Answer: $x + 1$", "x+1")["acc"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not compute_score("Answer: 1 + x", "x+1")["acc"]
    finally:
        dapo_math._math_verify_installed.cache_clear()
        dapo_math._warn_exact_fallback.cache_clear()


# LaTeX ground truths written without "$", each with answers against it, oracles derived by hand:
# (truth, answer after "Answer: ", acc with math-verify, acc with the exact-string fallback). Bare, math-verify used
# to parse only a prefix of a text ("2^{5}" as 2, "3\sqrt{2}" as 3), on either side.
LATEX_TRUTHS = [
    ("2^{5}", "32", True, False),
    ("2^{5}", "2", False, False),
    ("2^{5}", "2^5", True, False),
    ("2^{5}", "2^{5}", True, True),
    ("2^{5}", "$2^{5}$", True, True),
    ("2^{5}", "25", False, False),
    ("2^{5}", "5", False, False),
    ("3\\sqrt{2}", "3", False, False),
    ("3\\sqrt{2}", "3\\sqrt{2}", True, True),
    ("3\\sqrt{2}", "\\sqrt{18}", True, False),
    ("3\\sqrt{2}", "\\sqrt{2}", False, False),
    ("3\\sqrt{2}", "3\\sqrt{3}", False, False),
    ("10^{10}", "10000000000", True, False),
    ("10^{10}", "10", False, False),
    ("10^{10}", "1", False, False),
    ("10^{10}", "10^{10}", True, True),
    ("10^{10}", "10^{10} + 1", False, False),
    ("2\\pi", "2", False, False),
    ("2\\pi", "2\\pi", True, True),
    ("\\frac{1}{2}", "1", False, False),
    ("\\frac{1}{2}", "\\frac{1}{2}.", True, True),
    ("\\frac{4}{2}", "2^{5}", False, False),  # the answer side: "2^{5}" parsed as 2 used to equal 4/2
    ("\\frac{4}{2}", "2", True, False),
]
needs_math_verify = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="math-verify not installed (pip install -e '.[test]')"
)


def test_latex_truths_are_not_integers():
    for truth in {row[0] for row in LATEX_TRUTHS}:
        assert parse_integer(truth) is None, truth


@needs_math_verify
@pytest.mark.parametrize("truth,answer,acc,_", LATEX_TRUTHS)
def test_latex_truth_is_parsed_whole_by_math_verify(truth, answer, acc, _):
    assert compute_score("so\nAnswer: " + answer, truth)["acc"] is acc


@pytest.mark.parametrize("truth,answer,_,acc", LATEX_TRUTHS)
def test_latex_truth_fallback_never_scores_a_prefix(monkeypatch, truth, answer, _, acc):
    monkeypatch.setattr(dapo_math, "_math_verify_installed", lambda: False)
    assert compute_score("so\nAnswer: " + answer, truth)["acc"] is acc


COSTLY = ["9^9^9^9", "9^{9^{9}}", "2^{3^{4}}", "x^2^3", "9**9**9", "9^(9^9)", "{2}^{2}^{2}", "9^{9999999}",
          "10^{1000001}", "99^{600000}", "2^{-99999999}", "9^{1234567890123456}", "1 + 2^{ 9 ^ 9 }"]  # fmt: skip
CHEAP = ["2^{10}", "x^2 + y^2", "(2^3)^4", "{9^9}^9", "10^{100}", "2^{999999}", "9^{999999}", "e^{i\\pi}", "9^{-3}",
         "a^{b}c^{d}", "\\frac{1}{2}", "0.5", "2^", "^", "x^{", "3^\\circ"]  # fmt: skip


@pytest.mark.parametrize("answer", COSTLY)
def test_costly_power_is_wrong_without_math_verify_being_asked(monkeypatch, answer):
    def unexpected(*args):
        raise AssertionError("math-verify was asked")

    monkeypatch.setattr(dapo_math, "_math_verify_installed", lambda: True)
    monkeypatch.setattr(dapo_math._POOL, "compare", unexpected)
    assert dapo_math._costly_power(answer)
    assert compute_score("Answer: " + answer, "\\frac{1}{2}")["acc"] is False


@pytest.mark.parametrize("answer", CHEAP)
def test_ordinary_powers_are_not_refused(answer):
    assert not dapo_math._costly_power(answer)


def test_worker_without_math_verify_falls_back_once(monkeypatch, tmp_path):
    """This interpreter finds math_verify but the worker's cannot import it: one warning, exact comparison, and no
    new worker per call."""
    (tmp_path / "math_verify.py").write_text("raise ImportError('shadowed by the test')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # read by the worker only
    monkeypatch.setattr(dapo_math, "_math_verify_installed", lambda: True)
    monkeypatch.setattr(dapo_math, "_POOL", dapo_math._WorkerPool())
    dapo_math._warn_exact_fallback.cache_clear()
    try:
        with pytest.warns(UserWarning, match="math-verify is not installed"):
            assert compute_score("Answer: $x + 1$", "x+1")["acc"]
        assert dapo_math._POOL._missing
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not compute_score("Answer: 0.5", "\\frac{1}{2}")["acc"]
        assert dapo_math._POOL._launcher is not None and not dapo_math._POOL._idle
    finally:
        dapo_math._warn_exact_fallback.cache_clear()
