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
Against an integer ground truth (one that itself denotes an integer by these rules) anything else is
wrong: two numbers ("42 or 43", "4 2"), a non-zero fraction ("42.5"), an expression
("2^5", "\\frac{84}{2}"), an empty answer. Nothing is ever evaluated.

Non-integer ground truths ("\\frac{1}{2}", "2^{5}", "3\\sqrt{2}") are compared with math-verify
(``math-verify==0.9.0``, optional, in the ``test`` extra) when it is installed. Both sides are parsed whole: a text
without math delimiters is wrapped in ``$...$`` first (bare, math-verify parses only a prefix: "2^{5}" as 2). Without
math-verify they fall back to an exact comparison of normalised strings (LaTeX wrappers and whitespace removed, case
folded; "32" does not equal "2^{5}" there, and nothing is evaluated) and a one-time warning says so.

Time is bounded on any input: everything works on the bounded tail with linear regular expressions (each
pattern is deterministic: no nested or overlapping quantifiers). math-verify runs in a worker process, never in
the caller (sympy can hold the GIL for minutes, so no thread or signal in this process can stop it): past
``reward.verify_timeout_s`` the worker is killed (SIGKILL) and the answer scores as wrong, on any thread; the next
call starts a new worker (about 1.5 s, not counted in the limit). Before that, answers with a tower of powers
("9^9^9") or a power of more than a million digits are wrong without calling math-verify. Workers die with the
trainer (process model: the comment above ``_Worker``).
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import logging
import math
import numbers
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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


# --- Symbolic comparison (non-integer ground truths) --------------------------------------------------------------
#
# math-verify runs in worker processes, never in the caller: sympy can hold the GIL for minutes (9^{9^{9^{9}}}
# against 1/2), so neither signal.alarm (main thread only) nor a helper thread bounds it; a process can be killed.
# Process model:
# - a worker is `python dapo_math.py <parent pid>` (a fresh interpreter: it imports the standard library and
#   math_verify only, never torch or megatron, and inherits no threads or process groups); it reads JSON lines
#   [answer, truth] on stdin and writes "1" or "0" per line;
# - workers are started lazily and reused; a caller takes an idle worker or starts a new one, so concurrent calls
#   never queue behind one another (one worker per concurrent call; at most _MAX_IDLE_WORKERS are kept idle);
# - past the time limit the caller SIGKILLs its worker and scores the answer as wrong; the next call starts another;
# - a worker dies with its parent: PR_SET_PDEATHSIG (Linux), plus a parent-pid poll and stdin EOF elsewhere. The
#   death signal follows the *thread* that started the child, so every worker is started by one long-lived
#   launcher thread, never by the (possibly short-lived) calling thread.

_WORKER_START_TIMEOUT_S = 60.0  # start-up (python + import math_verify, about 1.5 s) is not part of timeout_s
_MAX_IDLE_WORKERS = 4
_MAX_POWER_DIGITS = 1_000_000  # 9^{999999} (954k digits) 0.6 s against 1/2; 9^{9999999} took 36 s
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# A power's exponent: a {...} or (...) group (scanned separately), else a signed number, a command or one character.
_EXPONENT_ATOM_RE = re.compile(r"[-+]?(?:\d+|\\[A-Za-z]+|.)", re.ASCII | re.DOTALL)


@functools.cache
def _math_verify_installed() -> bool:
    """Whether math_verify can be imported (looked up, not imported: the trainer never loads sympy)."""
    if importlib.util.find_spec("math_verify") is not None:
        return True
    _warn_exact_fallback()
    return False


@functools.cache
def _warn_exact_fallback() -> None:
    warnings.warn(
        "math-verify is not installed: non-integer ground truths are compared as exact normalised strings "
        "(pip install math-verify==0.9.0 for symbolic equivalence)",
        stacklevel=4,
    )


def _group_end(text: str, start: int) -> int:
    """Index just past the bracket that closes ``text[start]`` ("{" or "("), or len(text) if unbalanced."""
    opener = text[start]
    closer = "}" if opener == "{" else ")"
    depth = 0
    for i in range(start, len(text)):
        if text[i] == opener:
            depth += 1
        elif text[i] == closer:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _costly_power(answer: str) -> bool:
    """Whether the answer holds a power that sympy could spend minutes on, refused before any parsing.

    A tower ("9^9^9", "2^{3^{4}}", "x^2^3", "9**9**9") or a power whose value has more than ``_MAX_POWER_DIGITS``
    digits by the estimate exponent x digits of a literal base ("9^{9999999}", "10^{1000001}"). One pass over the
    answer (the tail, 300 characters by default). The worker's time limit bounds what this misses (factorials,
    nested functions).
    """
    s = _SPACE_RE.sub("", answer).replace("**", "^")
    i = s.find("^")
    while i >= 0:
        base_start = i
        while base_start > 0 and s[base_start - 1].isdigit():
            base_start -= 1
        j = i + 1
        if j < len(s) and s[j] in "{(":
            end = _group_end(s, j)
            exponent = s[j + 1 : end - 1]
        else:
            atom = _EXPONENT_ATOM_RE.match(s, j)
            end = atom.end() if atom else j
            exponent = s[j:end]
        if "^" in exponent or s.startswith("^", end):
            return True  # a tower
        digits = exponent.lstrip("+-")
        if digits.isascii() and digits.isdigit():
            if len(digits) > 12 or int(digits) * max(1, i - base_start) > _MAX_POWER_DIGITS:
                return True
        i = s.find("^", end)
    return False


class _Worker:
    """One math-verify process (see the process model above): a JSON line [answer, truth] in, "1" or "0" out."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self._buffer = b""
        self._poller = select.poll()  # not select.select: a trainer may hold more than FD_SETSIZE (1024) descriptors
        self._poller.register(proc.stdout.fileno(), select.POLLIN)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, answer: str, truth: str, timeout_s: float) -> str | None:
        """The worker's reply to one comparison, or None past ``timeout_s`` or if the worker died."""
        try:
            self.proc.stdin.write(json.dumps([answer, truth]).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:  # broken pipe: the worker died since its last call
            return None
        return self.read_line(timeout_s)

    def read_line(self, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poller.poll(math.ceil(left * 1000)):
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None  # end of file: the worker died
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode("ascii", "replace")

    def kill(self) -> None:
        """SIGKILL (a worker stuck in sympy never reads another line) and reap."""
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class _MathVerifyMissing(Exception):
    """The worker's interpreter cannot import math_verify (while this one found it)."""


class _WorkerPool:
    """Idle workers, handed to one caller at a time; thread-safe; reset in a forked child (the workers and the
    launcher thread belong to the parent)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._launcher: ThreadPoolExecutor | None = None
        self._missing = False  # a worker said it cannot import math_verify: do not start another one per call

    def compare(self, answer: str, truth: str, timeout_s: float) -> bool:
        """math-verify's verdict on ``answer`` against ``truth``; False past ``timeout_s`` (the worker is killed).

        Raises:
            _MathVerifyMissing: the worker cannot import math_verify.
        """
        worker = self._take()
        if worker is None:
            return False
        reply = worker.ask(answer, truth, timeout_s)
        if reply is None:
            worker.kill()
            return False
        with self._lock:
            if len(self._idle) < _MAX_IDLE_WORKERS:
                self._idle.append(worker)
                worker = None
        if worker is not None:
            worker.kill()
        return reply == "1"

    def close(self) -> None:
        """Kill the idle workers (at exit; the next call starts a new one)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()

    def _take(self) -> _Worker | None:
        with self._lock:
            if self._missing:
                raise _MathVerifyMissing
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                worker.kill()
            if self._launcher is None:
                self._launcher = ThreadPoolExecutor(1, thread_name_prefix="dapo-math-verify-launcher")
                atexit.register(self.close)
            launcher = self._launcher
        cmd = [sys.executable, os.path.abspath(__file__), str(os.getpid())]
        try:
            proc = launcher.submit(subprocess.Popen, cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE).result()
        except (OSError, RuntimeError) as err:  # no process to be had (EAGAIN, ENOMEM), or the interpreter is exiting
            warnings.warn(f"math-verify worker could not be started: {err}", stacklevel=4)
            return None
        worker = _Worker(proc)
        status = worker.read_line(_WORKER_START_TIMEOUT_S)
        if status == "ready":
            return worker
        worker.kill()
        if status == "missing":
            self._missing = True
            raise _MathVerifyMissing
        warnings.warn(f"math-verify worker did not start within {_WORKER_START_TIMEOUT_S:.0f} s", stacklevel=4)
        return None


_POOL = _WorkerPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_POOL._reset)


def _verify_non_integer(answer: str, ground_truth: str, timeout_s: float = MATH_VERIFY_TIMEOUT_S) -> bool:
    """Symbolic check with math-verify in a worker process when installed, else exact normalised string equality.

    Bounded by ``timeout_s`` on any thread (plus, when a worker must be started, its start-up, bounded by
    ``_WORKER_START_TIMEOUT_S``): past it the worker is killed and the answer scores as wrong.
    """
    if _math_verify_installed():
        if _costly_power(answer):
            return False
        try:
            return _POOL.compare(answer, ground_truth, timeout_s)
        except _MathVerifyMissing:
            _warn_exact_fallback()
    return _exact_key(answer) == _exact_key(ground_truth)


def _whole(text: str) -> str:
    """``text`` for math_verify.parse, delimited so that it is parsed whole.

    Without "$" math-verify's expression extractor takes a prefix: "2^{5}" parsed as 2, "3\\sqrt{2}" as 3. A text
    without math delimiters is wrapped in "$...$" (one trailing period dropped first: "$\\frac{1}{2}.$" does not
    parse).
    """
    text = text.strip()
    if "$" in text or "\\(" in text or "\\[" in text:
        return text
    return f"${text.removesuffix('.')}$"


def _math_verify_equal(mv, answer: str, ground_truth: str) -> bool:
    """math-verify's verdict, without its own time limits (the worker is killed instead); runs in the worker."""
    try:
        gold = mv.parse(_whole(ground_truth), parsing_timeout=None)
        pred = mv.parse(_whole(answer), parsing_timeout=None)
        return bool(gold and pred and mv.verify(gold, pred, timeout_seconds=None))
    except Exception:  # any parser/grader failure on untrusted text scores as wrong
        return False


def _serve(parent_pid: int) -> None:
    """Worker main (``python dapo_math.py <parent pid>``): compare JSON lines [answer, truth] from stdin until EOF."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever math-verify or sympy prints goes to stderr, never into the replies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the poll below
        pass
    if os.getppid() != parent_pid:
        return  # the parent died before the death signal was armed
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # per-call warnings: "Timeout is disabled", parse errors
    try:
        import math_verify
    except ImportError:
        print("missing", file=replies)
        return
    print("ready", file=replies)
    for line in sys.stdin:
        answer, truth = json.loads(line)
        print("1" if _math_verify_equal(math_verify, answer, truth) else "0", file=replies)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Where PR_SET_PDEATHSIG is missing (macOS): exit once re-parented (needs the GIL, unlike the signal)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


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


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
