"""The keys of an adapter's `rank_pattern` / `alpha_pattern`, matched as PEFT matches them, in linear time.

PEFT gives a module the value of the first key for which ``re.match(rf"(.*\\.)?({key})$", module_name)``
matches: a key is a regular expression for a dotted suffix of the module's full name (`q_proj`,
`layers.0.self_attn.q_proj`, `^model.layers.0.mlp.down_proj`, `layers\\.\\d+\\.mlp\\..*`). Running an
adapter's keys through `re` would let a key such as `(.|.)*Z` backtrack for hours in the engine core, so
they never reach `re`: a key is parsed here into a small automaton and run over the name once, every
possible position at the same time (Thompson's construction), in time proportional to name x key.

What PEFT's keys are made of is read: literal characters, `.`, escapes (`\\.`, `\\d`, `\\w`, `\\s` and their
negations), character sets, `^` and `$`, groups (`(...)`, `(?:...)`) with `|`, and `*`, `+`, `?` and
`{m,n}` (greedy or lazy) on a character, a set or `.`. Anything else (a repeated group, back-references,
look-arounds, inline flags, possessive quantifiers) refuses the adapter with `PatternError`, which says what
to write instead; so does a key whose automaton would be large (a long key, large repeat counts).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_KEY_CHARS = 512
MAX_REPEAT = 64  # the largest count of {m,n}
MAX_STATES = 1024  # per key
MAX_STEPS = 2_000_000  # states visited while matching one adapter's patterns (about a second)

CharTest = Callable[[str], bool]


class PatternError(ValueError):
    """A rank_pattern / alpha_pattern key this engine will not run; the message says why."""


def _show(key: str) -> str:
    return repr(key) if len(key) <= 60 else repr(key[:60]) + "..."


def _word(c: str) -> bool:
    return c.isalnum() or c == "_"


_CLASS_ESCAPES: dict[str, CharTest] = {
    "d": str.isdecimal,
    "D": lambda c: not c.isdecimal(),
    "w": _word,
    "W": lambda c: not _word(c),
    "s": str.isspace,
    "S": lambda c: not c.isspace(),
}
_LITERAL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}
_SPECIAL = set(".^$*+?{}[]\\|()")


@dataclass
class _State:
    test: CharTest | None = None  # consumes one character that passes
    edges: list[int] = field(default_factory=list)  # epsilon moves; with a test, the moves after consuming
    assertion: str | None = None  # "^" or "$": an epsilon move only at the start or the end
    final: bool = False


class _Builder:
    """Recursive descent over the key, building Thompson fragments: (start state, list of dangling states)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.i = 0
        self.states: list[_State] = []

    def fail(self, why: str) -> PatternError:
        return PatternError(f"pattern key {_show(self.key)}: {why}")

    def new(self, **kwargs) -> int:
        if len(self.states) >= MAX_STATES:
            raise self.fail("it is too large to match safely; write module names or suffixes instead")
        self.states.append(_State(**kwargs))
        return len(self.states) - 1

    def peek(self) -> str | None:
        return self.key[self.i] if self.i < len(self.key) else None

    # alternation := sequence ('|' sequence)*
    def alternation(self) -> tuple[int, list[int]]:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        if len(branches) == 1:
            return branches[0]
        start = self.new(edges=[b[0] for b in branches])
        return start, [end for b in branches for end in b[1]]

    # sequence := (atom quantifier?)*
    def sequence(self) -> tuple[int, list[int]]:
        start = self.new()
        ends = [start]
        while self.peek() not in (None, "|", ")"):
            atom_start = self.i
            piece = self.atom()
            quantifier = self.quantifier()
            if quantifier is not None:
                if piece[0] == "group":
                    raise self.fail(
                        f"a repeated group ({self.key[atom_start : self.i]!r}) is not supported: repeat a "
                        "character, a set or '.' instead (PEFT's keys are module names or suffixes such as "
                        "'q_proj' or 'layers.0.self_attn.q_proj')"
                    )
                if piece[0] == "assert":
                    raise self.fail(f"{self.key[atom_start : self.i]!r} repeats an anchor")
                fragment = self.repeat(piece[1], *quantifier)
            elif piece[0] == "char":
                s = self.new(test=piece[1])
                fragment = (s, [s])
            elif piece[0] == "assert":
                s = self.new(assertion=piece[1])
                fragment = (s, [s])
            else:
                fragment = piece[1]
            for end in ends:
                self.states[end].edges.append(fragment[0])
            ends = fragment[1]
        return start, ends

    def repeat(self, test: CharTest, low: int, high: int | None) -> tuple[int, list[int]]:
        """``test`` between ``low`` and ``high`` (None: no bound) times."""
        start = self.new()
        ends = [start]
        for _ in range(low):
            s = self.new(test=test)
            for end in ends:
                self.states[end].edges.append(s)
            ends = [s]
        if high is None:
            loop = self.new(test=test)
            for end in ends:
                self.states[end].edges.append(loop)
            self.states[loop].edges.append(loop)
            return start, [*ends, loop]
        optional: list[int] = list(ends)
        for _ in range(high - low):
            s = self.new(test=test)
            for end in ends:
                self.states[end].edges.append(s)
            ends = [s]
            optional.append(s)
        return start, optional

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            bounds: tuple[int, int | None] = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{":
            bounds_or_none = self.counted()
            if bounds_or_none is None:
                return None
            bounds = bounds_or_none
        else:
            return None
        if self.peek() == "?":
            self.i += 1  # lazy: the same names match
        elif self.peek() == "+":
            raise self.fail("possessive quantifiers are not supported")
        if self.peek() in ("*", "+", "{") and (self.peek() != "{" or self.counted(look=True) is not None):
            raise self.fail("a quantifier on a quantifier is not supported")
        return bounds

    def counted(self, look: bool = False) -> tuple[int, int | None] | None:
        """{m}, {m,}, {,n}, {m,n} at the cursor (consumed unless ``look``); None where `re` reads a literal
        brace."""
        close = self.key.find("}", self.i)
        if close < 0:
            return None
        body = self.key[self.i + 1 : close]
        low_text, comma, high_text = body.partition(",")
        if not (low_text.isdigit() or (comma and not low_text)) or not (high_text.isdigit() or not high_text):
            return None
        if not body.isascii():
            return None
        low = int(low_text) if low_text else 0
        high = int(high_text) if high_text else (None if comma else low)
        if high is not None and high < low:
            raise self.fail(f"{{{body}}} has its bounds the wrong way round")
        if max(low, high or 0) > MAX_REPEAT:
            raise self.fail(f"{{{body}}} repeats more than {MAX_REPEAT} times")
        if not look:
            self.i = close + 1
        return low, high

    def atom(self) -> tuple[str, object]:
        c = self.key[self.i]
        self.i += 1
        if c == "(":
            if self.key.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise self.fail("look-arounds, named groups and inline flags ('(?...') are not supported")
            inner = self.alternation()
            if self.peek() != ")":
                raise self.fail("a group is not closed")
            self.i += 1
            return "group", inner
        if c == ")":
            raise self.fail("')' closes no group")
        if c in ("*", "+", "?"):
            raise self.fail(f"{c!r} repeats nothing")
        if c == ".":
            return "char", lambda ch: ch != "\n"
        if c in ("^", "$"):
            return "assert", c
        if c == "[":
            return "char", self.char_set()
        if c == "\\":
            return "char", self.escape(in_set=False)
        return "char", c.__eq__

    def escape(self, in_set: bool) -> CharTest:
        if self.i >= len(self.key):
            raise self.fail("it ends with a lone backslash")
        c = self.key[self.i]
        self.i += 1
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _LITERAL_ESCAPES:
            return _LITERAL_ESCAPES[c].__eq__
        if c == "b" and in_set:
            return "\b".__eq__
        if c.isalnum():
            raise self.fail(f"the escape \\{c} (back-references, \\b, \\A, \\Z, ...) is not supported")
        return c.__eq__

    def char_set(self) -> CharTest:
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        tests: list[CharTest] = []
        first = True
        while True:
            if self.i >= len(self.key):
                raise self.fail("a character set '[' is not closed")
            c = self.key[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            if c == "[" and self.key.startswith(("[:", "[=", "[."), self.i):
                raise self.fail("POSIX classes ('[:alpha:]') are not supported")
            first = False
            self.i += 1
            if c == "\\":
                item = self.escape(in_set=True)
                low = None if item in _CLASS_ESCAPES.values() else _char_of(item)
            else:
                item, low = c.__eq__, c
            if (
                low is not None
                and self.peek() == "-"
                and self.i + 1 < len(self.key)
                and self.key[self.i + 1] != "]"
            ):
                self.i += 1
                hc = self.key[self.i]
                self.i += 1
                high = _char_of(self.escape(in_set=True)) if hc == "\\" else hc
                if high is None or high < low:
                    raise self.fail(f"the range {low}-{high} in a character set is not valid")
                item = _range(low, high)
            tests.append(item)
        return (
            (lambda ch: not any(t(ch) for t in tests)) if negate else (lambda ch: any(t(ch) for t in tests))
        )


def _char_of(test: CharTest) -> str | None:
    """The character an equality test is for (None for a class such as \\d)."""
    owner = getattr(test, "__self__", None)
    return owner if isinstance(owner, str) and len(owner) == 1 else None


def _range(low: str, high: str) -> CharTest:
    return lambda ch: low <= ch <= high


@dataclass
class KeyMatcher:
    """One compiled key; `matches(name)` is PEFT's ``re.match(rf"(.*\\.)?({key})$", name)`` as a bool."""

    key: str
    states: list[_State]
    start: int
    # A key that is a plain name (literal characters and '.', maybe '^' first and '$' last): (anchored,
    # per character the one it must be, None for '.'), compared directly; thousands of such keys are common
    # (PEFT's EVA writes one per module).
    chain: tuple[bool, list[str | None]] | None = None

    def _closure(self, states: set[int], pos: int, end: int, budget: list[int]) -> set[int]:
        stack, seen = list(states), set(states)
        budget[0] -= len(states)
        while stack:
            s = stack.pop()
            state = self.states[s]
            if state.test is not None:
                continue
            if state.assertion == "^" and pos != 0:
                continue
            if state.assertion == "$" and pos != end:
                continue
            for nxt in state.edges:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
                    budget[0] -= 1
        if budget[0] < 0:
            raise PatternError(
                f"pattern key {_show(self.key)}: matching the patterns against the model's modules takes too long; "
                "write module names or suffixes instead"
            )
        return seen

    def matches(self, name: str, budget: list[int] | None = None) -> bool:
        """``budget``: [states left to visit], shared by the calls it is given to; PatternError past it."""
        # The key starts at 0 or just after any '.', and must end where the name ends.
        if self.chain is not None:  # a plain name: it can only start len(chain) from the end
            anchored, chars = self.chain
            s = len(name) - len(chars)
            if s < 0 or (s > 0 and (anchored or name[s - 1] != ".")):
                return False
            return all(c == k if k is not None else c != "\n" for k, c in zip(chars, name[s:], strict=True))
        if budget is None:
            budget = [MAX_STEPS]
        current: set[int] = set()
        for pos in range(len(name) + 1):
            if pos == 0 or name[pos - 1] == ".":
                current.add(self.start)
            current = self._closure(current, pos, len(name), budget)
            if pos == len(name):
                return any(self.states[s].final for s in current)
            c = name[pos]
            moved: set[int] = set()
            for s in current:
                test = self.states[s].test
                if test is not None and test(c):
                    moved.update(self.states[s].edges)
            current = moved
        return False


def compile_key(key: object) -> KeyMatcher:
    """The matcher of one rank_pattern / alpha_pattern key; PatternError for one that is not supported."""
    if not isinstance(key, str):
        raise PatternError(f"pattern key {key!r} is not a string")
    if len(key) > MAX_KEY_CHARS:
        raise PatternError(f"pattern key {_show(key)} is longer than {MAX_KEY_CHARS} characters")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FutureWarning: "possible nested set"
            re.compile(key)  # the syntax `re` accepts (compiling runs nothing; it is never matched with `re`)
    except (re.error, OverflowError, RecursionError) as exc:
        raise PatternError(f"pattern key {_show(key)} is not a valid regular expression: {exc}") from None
    chain = _chain(key)
    if chain is not None:
        return KeyMatcher(key, [], 0, chain)
    builder = _Builder(key)
    start, ends = builder.alternation()
    if builder.i != len(key):
        raise builder.fail("')' closes no group")
    final = builder.new(final=True)
    for end in ends:
        builder.states[end].edges.append(final)
    return KeyMatcher(key, builder.states, start)


def _chain(key: str) -> tuple[bool, list[str | None]] | None:
    anchored = key.startswith("^")
    body = key[1:] if anchored else key
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    chars: list[str | None] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body) and not body[i + 1].isalnum():
            chars.append(body[i + 1])
            i += 2
            continue
        if c in _SPECIAL and c != ".":
            return None
        chars.append(None if c == "." else c)
        i += 1
    return anchored, chars


class PatternTable:
    """A whole rank_pattern or alpha_pattern: every key compiled up front (refusing the adapter at once if one
    is not supported), then `value(name, default)`: the value of the first key that matches, as PEFT does."""

    def __init__(self, patterns: object, what: str) -> None:
        if not isinstance(patterns, dict):
            raise PatternError(f"{what} must be a JSON object of module pattern -> number")
        self.entries: list[tuple[KeyMatcher, float]] = []
        self.budget = [MAX_STEPS]  # for all the names this table is asked about
        for key, value in patterns.items():
            try:
                matcher = compile_key(key)
            except PatternError as exc:
                raise PatternError(f"{what}: {exc}") from None
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise PatternError(f"{what}: the value of {key!r} must be a positive number, got {value!r}")
            self.entries.append((matcher, value))

    def value(self, name: str, default: float) -> float:
        for matcher, value in self.entries:
            if matcher.matches(name, self.budget):
                return value
        return default
