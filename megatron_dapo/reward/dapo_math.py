"""DAPO-style math verifier: answer extraction, integer normalisation, compute_score.

Format (DAPO, arXiv 2503.14476): the response ends with a line "Answer: <integer>". Only the last
``TAIL_CHARS`` characters of the response are inspected, as in DAPO's own verifier; an answer that sits
further from the end is not seen. Three answer formats are supported (config field ``reward.answer_format``):

- ``"answer_line"`` (default, DAPO's): the rest of the line after the last "Answer:" in the tail
  (case-insensitive, spaces and markdown stars before the colon allowed: "answer :", "**Answer**:").
- ``"boxed"``: the content of the last brace-balanced ``\\boxed{...}`` (or ``\\fbox{...}``) in the tail.
- ``"last_number"``: the last number in the tail (for small models that do not follow a format yet).

Integer answers are compared as integers after a conservative normalisation. The extracted answer denotes
an integer only if, once LaTeX wrappers (``$``, ``\\(..\\)``, ``\\boxed``, ``\\text``, ...), degree and
percent signs and markdown emphasis are removed, it holds exactly one number, optionally preceded by words
ending in a space, "=" or ":" ("x = 42", "The answer is 42") and optionally followed by a space and words
("42 degrees") or a final period. The number may carry a sign (ASCII or unicode minus), leading zeros,
comma thousands separators in groups of three ("1,000"; "1,00" is malformed) and a zero fraction ("42.0").
Anything else is wrong: two numbers ("42 or 43", "4 2"), a non-zero fraction ("42.5"), an expression
("2^5", "\\frac{84}{2}"), an empty answer. Nothing is ever evaluated.

Non-integer ground truths are compared with math-verify (``math-verify==0.9.0``, optional, imported lazily)
when it is installed; otherwise they fall back to an exact comparison of normalised strings (LaTeX
wrappers and whitespace removed, case folded) and a one-time warning says so.

Time is bounded on any input: everything works on the bounded tail with linear regular expressions (each
pattern is deterministic: no nested or overlapping quantifiers), and the symbolic comparison has a time limit
(``reward.verify_timeout_s``) on the main thread and off it.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
import signal
import threading
import warnings
from dataclasses import dataclass

__all__ = [
    "ANSWER_FORMATS",
    "TAIL_CHARS",
    "Verifier",
    "compute_score",
    "extract_answer",
    "make_verifier",
    "parse_integer",
]

ANSWER_FORMATS: tuple[str, ...] = ("answer_line", "boxed", "last_number")
"""Values accepted by ``reward.answer_format``."""

TAIL_CHARS: int = 300
"""Characters at the end of a response that the verifier inspects (DAPO's verifier uses the last 300)."""

MATH_VERIFY_TIMEOUT_S: float = 5.0
"""Default time limit of one math-verify comparison (config: reward.verify_timeout_s), on any thread."""

_MAX_DIGITS = 1000  # int() of longer digit strings is refused by Python (4300) and never a valid answer anyway

# "Answer:" marker: case-insensitive, spaces/tabs/markdown stars allowed between the word and the colon.
_ANSWER_RE = re.compile(r"answer[ \t*]*:", re.IGNORECASE)
# \boxed or \fbox, the opening brace (optional) located by the brace scanner.
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# A signed run of digit groups joined by "," or "."; each repetition starts with a non-digit, so matching is
# deterministic (linear).
_NUMBER_RE = re.compile(r"[-+]?\d+(?:[.,]\d+)*", re.ASCII)
# Valid bodies: plain digits or comma thousands groups, then an optional fraction.
_BODY_RE = re.compile(r"(\d+|\d{1,3}(?:,\d{3})+)(?:\.(\d+))?", re.ASCII)
_PREFIX_RE = re.compile(r"[A-Za-z ]*")
_SUFFIX_RE = re.compile(r"\.?|\s[A-Za-z .]*")
# LaTeX commands that only wrap or decorate their argument.
_WRAPPER_RE = re.compile(
    r"\\(?:boxed|fbox|text|textbf|textrm|textit|textup|texttt|mathrm|mathbf|mathit|mathsf|mathtt|mbox"
    r"|displaystyle|textstyle|left|right|bigl|bigr|Bigl|Bigr)(?![A-Za-z])"
)
_DEGREE_RE = re.compile(r"\^\s*\\circ(?![A-Za-z])|\\circ(?![A-Za-z])|\\degrees?(?![A-Za-z])|\u00b0")
_LATEX_SPACE_RE = re.compile(r"\\[,;:! ]|\\q?quad(?![A-Za-z])")
_DELIM_RE = re.compile(r"\\[()\[\]]|\\?\$|\\?%|\*|`")
_SPACE_RE = re.compile(r"\s+")
# Unicode minus sign, hyphen/figure/en dashes, small and fullwidth hyphen-minus.
_MINUS_TABLE = str.maketrans({"\u2212": "-", "\u2010": "-", "\u2012": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})


def _check_format(answer_format: str) -> None:
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"reward.answer_format: unknown value {answer_format!r}; expected one of {ANSWER_FORMATS}")


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    """The last non-overlapping match of ``pattern`` in ``text`` (one linear scan)."""
    last = None
    for match in pattern.finditer(text):
        last = match
    return last


def _last_answer_line(tail: str) -> str | None:
    last = _last_match(_ANSWER_RE, tail)
    if last is None:
        return None
    line = tail[last.end() :].split("\n", 1)[0].strip()
    return line or None


def _last_boxed(tail: str) -> str | None:
    last = _last_match(_BOXED_RE, tail)
    if last is None:
        return None
    rest = tail[last.end() :].lstrip()
    if not rest.startswith("{"):
        # "\boxed 42": the argument is the next whitespace/dollar-delimited token.
        token = re.match(r"[^\s$]*", rest).group(0)
        return token or None
    end = _closing_brace(rest)
    if end < 0:
        return None  # unbalanced: the box was cut off
    return rest[1:end].strip() or None


def _last_number(tail: str) -> str | None:
    last = _last_match(_NUMBER_RE, tail.translate(_MINUS_TABLE))
    if last is None:
        return None
    text = last.group(0)
    start = last.start()
    # A sign glued to a preceding word or digit is a binary operator ("5-3" -> "3"), not part of the number.
    if text[0] in "+-" and start > 0 and tail[start - 1].isalnum():
        text = text[1:]
    # A trailing sentence period was not captured ("[.,]\d+" needs a digit after it).
    return text


def extract_answer(text: str, answer_format: str = "answer_line", *, tail_chars: int = TAIL_CHARS) -> str | None:
    """Extract the raw answer text from a response, or None when the response has no answer.

    Args:
        text: the decoded response (str, any length; only the last ``tail_chars`` characters are read).
        answer_format: one of ``ANSWER_FORMATS`` (config field ``reward.answer_format``).
        tail_chars: how many trailing characters to inspect (default ``TAIL_CHARS``, DAPO's 300).

    Returns:
        The answer as written (stripped, not yet normalised), or None if there is none or it is empty.
    """
    _check_format(answer_format)
    if not isinstance(text, str):
        raise TypeError(f"solution must be a str, got {type(text).__name__}")
    tail = text[-tail_chars:] if tail_chars > 0 else ""
    if answer_format == "answer_line":
        return _last_answer_line(tail)
    if answer_format == "boxed":
        return _last_boxed(tail)
    return _last_number(tail)


def _normalise(answer: str) -> str:
    """Remove LaTeX wrappers, delimiters, degree/percent signs and markdown; collapse whitespace."""
    s = answer.translate(_MINUS_TABLE)
    s = _WRAPPER_RE.sub("", s)
    s = s.replace("{", "").replace("}", "")
    s = _DEGREE_RE.sub("", s)
    s = _LATEX_SPACE_RE.sub("", s)
    s = _DELIM_RE.sub(" ", s)  # a space, so that "6*7" stays two numbers
    s = s.replace("~", " ")
    s = _SPACE_RE.sub(" ", s).strip()
    if s.startswith("(") and s.endswith(")") and s.count("(") == 1 and s.count(")") == 1:
        s = s[1:-1].strip()
    return s


def parse_integer(answer: str) -> int | None:
    """The integer an answer denotes, or None if it does not denote exactly one integer.

    Args:
        answer: extracted answer text (str), e.g. ``"$1,000$"``, ``"\\boxed{-5}"``, ``"42 degrees"``.

    Returns:
        The integer (int), or None for anything ambiguous, malformed or non-integer.
    """
    s = _normalise(answer)
    matches = list(_NUMBER_RE.finditer(s))
    if len(matches) != 1:
        return None
    m = matches[0]
    prefix, token, suffix = s[: m.start()], m.group(0), s[m.end() :]
    if prefix and prefix[-1] not in " =:":
        return None  # "x3", "x-3", "2^5" style: the number is glued to something else
    words = prefix.rstrip(" ")
    if words.endswith(("=", ":")):
        words = words[:-1]
    if not _PREFIX_RE.fullmatch(words) or not _SUFFIX_RE.fullmatch(suffix):
        return None
    sign = -1 if token[0] == "-" else 1
    body = _BODY_RE.fullmatch(token.lstrip("+-"))
    if body is None or len(token) > _MAX_DIGITS:
        return None
    frac = body.group(2)
    if frac is not None and frac.strip("0"):
        return None
    return sign * int(body.group(1).replace(",", ""))


def _integer_truth(ground_truth: str | int) -> int | None:
    if isinstance(ground_truth, bool):
        raise TypeError("ground_truth must be an int or a str, got bool")
    if isinstance(ground_truth, numbers.Integral):
        return int(ground_truth)
    if isinstance(ground_truth, float):
        if not math.isfinite(ground_truth) or not ground_truth.is_integer():
            raise ValueError(f"ground_truth: float {ground_truth!r} is not an integer; pass it as a str")
        return int(ground_truth)
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth must be an int or a str, got {type(ground_truth).__name__}")
    if not ground_truth.strip():
        raise ValueError("ground_truth: empty string")
    return parse_integer(ground_truth)


@functools.cache
def _math_verify():
    """The math_verify module, or None (with a one-time warning) when it is not installed."""
    try:
        import math_verify
    except ImportError:
        warnings.warn(
            "math-verify is not installed: non-integer ground truths are compared as exact normalised strings "
            "(pip install math-verify==0.9.0 for symbolic equivalence)",
            stacklevel=3,
        )
        return None
    return math_verify


def _exact_key(text: str) -> str:
    """Normalised form for exact comparison: like ``_normalise`` but braces kept (they carry structure)."""
    s = _WRAPPER_RE.sub("", text.translate(_MINUS_TABLE))
    s = _DEGREE_RE.sub("", s)
    s = _LATEX_SPACE_RE.sub("", s)
    s = _SPACE_RE.sub("", _DELIM_RE.sub(" ", s)).rstrip(".").casefold()
    while s.startswith("{") and s.endswith("}") and _closing_brace(s) == len(s) - 1:
        s = s[1:-1]
    return s


def _closing_brace(text: str) -> int:
    """Index of the brace that closes ``text[0] == "{"``, or -1 if unbalanced."""
    depth = 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _verify_non_integer(answer: str, ground_truth: str, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Symbolic check with math-verify when available, else exact normalised string equality.

    Bounded by `timeout_s` on any thread. On the main thread math-verify's own signal.alarm limit interrupts the
    work (whole seconds, rounded up). signal.alarm works only there, so on any other thread the check runs in a
    helper daemon thread that is waited for `timeout_s`: past it the answer scores as wrong and the caller goes on,
    while the helper (which cannot be interrupted) finishes in the background.
    """
    mv = _math_verify()
    if mv is None:
        return _exact_key(answer) == _exact_key(ground_truth)
    on_main = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")
    if on_main:
        return _math_verify_equal(mv, answer, ground_truth, max(1, math.ceil(timeout_s)))
    result: list[bool] = []
    helper = threading.Thread(
        target=lambda: result.append(_math_verify_equal(mv, answer, ground_truth, None)),
        name="dapo-math-verify",
        daemon=True,
    )
    helper.start()
    helper.join(timeout_s)
    return bool(result and result[0])


def _math_verify_equal(mv, answer: str, ground_truth: str, timeout: int | None) -> bool:  # noqa: ANN001
    def parse(text: str):
        parsed = mv.parse(text, parsing_timeout=timeout)
        if not parsed and "$" not in text:
            parsed = mv.parse(f"${text}$", parsing_timeout=timeout)
        return parsed

    try:
        gold, pred = parse(ground_truth), parse(answer)
        return bool(gold and pred and mv.verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # any parser/grader failure on untrusted text scores as wrong
        return False


def compute_score(
    solution: str,
    ground_truth: str | int,
    *,
    answer_format: str = "answer_line",
    tail_chars: int = TAIL_CHARS,
    timeout_s: float = MATH_VERIFY_TIMEOUT_S,
) -> dict:
    """Score one response against its ground truth, DAPO style.

    Args:
        solution: decoded response text (str, any length; only the last ``tail_chars`` characters are read).
        ground_truth: the reference answer, an int or a str ("42", "-7", "1,000"; a non-integer str such as
            "\\frac{1}{2}" uses math-verify if installed, else exact normalised string comparison).
        answer_format: one of ``ANSWER_FORMATS``: "answer_line" (default), "boxed", "last_number".
        tail_chars: trailing characters inspected (default ``TAIL_CHARS``).
        timeout_s: time limit of the symbolic comparison (non-integer truths only), on any thread; past it the
            answer scores as wrong.

    Returns:
        ``{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}``: ``pred`` is the canonical integer
        ("42", "-5") when the answer denotes one, else the extracted answer text (whitespace collapsed),
        or None when the response holds no answer at all.
    """
    raw = extract_answer(solution, answer_format, tail_chars=tail_chars)
    truth = _integer_truth(ground_truth)
    pred: str | None = None
    acc = False
    if raw is not None:
        value = parse_integer(raw)
        pred = str(value) if value is not None else _SPACE_RE.sub(" ", raw)
        if truth is not None:
            acc = value is not None and value == truth
        elif pred is not None:
            acc = _verify_non_integer(raw, str(ground_truth), timeout_s)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


@dataclass(frozen=True, slots=True)
class Verifier:
    """A configured ``compute_score``: ``Verifier(answer_format="boxed")(solution, truth)``.

    Build it from the trainer's reward config with ``Verifier.from_config(cfg.reward)`` (reads the field
    ``answer_format``) or ``make_verifier(answer_format)``.
    """

    answer_format: str = "answer_line"
    """One of ``ANSWER_FORMATS``; the config field is ``reward.answer_format``."""
    tail_chars: int = TAIL_CHARS
    """Trailing characters of a response that are inspected."""
    timeout_s: float = MATH_VERIFY_TIMEOUT_S
    """Time limit of one symbolic comparison; the config field is ``reward.verify_timeout_s``."""

    def __post_init__(self) -> None:
        _check_format(self.answer_format)
        if not isinstance(self.tail_chars, int) or self.tail_chars <= 0:
            raise ValueError(f"reward.tail_chars: must be a positive int, got {self.tail_chars!r}")
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < math.inf):
            raise ValueError(f"reward.verify_timeout_s: must be a positive finite number, got {self.timeout_s!r}")

    @classmethod
    def from_config(cls, reward_config) -> Verifier:
        """A verifier for the ``reward`` config section (``answer_format``, ``verify_timeout_s``)."""
        return cls(
            answer_format=reward_config.answer_format,
            timeout_s=getattr(reward_config, "verify_timeout_s", MATH_VERIFY_TIMEOUT_S),
        )

    def __call__(self, solution: str, ground_truth: str | int) -> dict:
        """Same contract as ``compute_score``."""
        return compute_score(
            solution,
            ground_truth,
            answer_format=self.answer_format,
            tail_chars=self.tail_chars,
            timeout_s=self.timeout_s,
        )


def make_verifier(answer_format: str = "answer_line", *, tail_chars: int = TAIL_CHARS) -> Verifier:
    """A ``Verifier`` for ``answer_format``; ValueError naming ``reward.answer_format`` if unknown."""
    return Verifier(answer_format=answer_format, tail_chars=tail_chars)
