"""Message filters of a subscription, as RocketMQ has them, turned into Arrow expressions.

Two kinds, which may be combined:

* a **tag expression** (RocketMQ's ``subscribe(topic, "TagA || TagB")``): the message's tag is
  one of those listed; ``"*"`` (or none) takes every message;
* a **SQL92 property filter** (RocketMQ's ``MessageSelector.bySql``): a condition over the
  message's properties, ``TAGS`` standing for its tag, for example
  ``region = 'eu' AND amount > 100``. Comparisons with a number compare the property as a
  number (one that is not a number does not match); with a string, as a string. ``IS [NOT]
  NULL``, ``[NOT] IN (...)``, ``[NOT] BETWEEN ... AND ...``, ``AND``, ``OR``, ``NOT`` and
  parentheses work as in SQL: a missing property makes a comparison unknown, and a message is
  taken only when the whole condition is true.

The expression is pushed into the read of the topic table (Arrow's dataset filter), so rows
that do not match are not read. A bad expression raises :class:`ConsumerError` naming it.

Example:
    >>> str(tag_filter("TagA || TagB"))
    'is_in(tags, {value_set=string:[\\n  "TagA",\\n  "TagB"\\n], null_matching_behavior=MATCH})'
    >>> tag_filter("*") is None
    True
    >>> sql_filter("amount > 100") is not None
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from engine.core.errors import ConsumerError

_TAG = re.compile(r"^[^\s|]+$")
_NUMBER_TEXT = r"^\s*[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?\s*$"
_TOKEN = re.compile(
    r"\s*(?:(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
    r"|(?P<string>'(?:[^']|'')*')"
    r"|(?P<op><>|!=|<=|>=|=|<|>|\(|\)|,)"
    r"|(?P<word>[A-Za-z_][A-Za-z0-9_.]*))"
)
_KEYWORDS = {"AND", "OR", "NOT", "IS", "NULL", "IN", "BETWEEN", "TRUE", "FALSE"}
_COMPARE = {
    "=": pc.equal,
    "<>": pc.not_equal,
    "!=": pc.not_equal,
    "<": pc.less,
    "<=": pc.less_equal,
    ">": pc.greater,
    ">=": pc.greater_equal,
}


def tag_filter(expression: str | None) -> ds.Expression | None:
    """The rows whose tag is one of ``"TagA || TagB"``; ``None`` for ``"*"`` or no expression.

    Raises:
        ConsumerError: an empty tag or one with spaces, naming the expression.
    """
    if expression is None or expression.strip() in ("", "*"):
        return None
    tags = [t.strip() for t in expression.split("||")]
    bad = [t for t in tags if not _TAG.match(t)]
    if bad:
        raise ConsumerError(
            f"bad tag expression {expression!r}: tags are separated by ||, each without "
            f"spaces (got {bad[0]!r}); '*' takes every tag"
        )
    return ds.field("tags").isin(sorted(set(tags)))


def sql_filter(condition: str | None) -> ds.Expression | None:
    """The rows for which the SQL92 ``condition`` over their properties is true.

    Raises:
        ConsumerError: the condition cannot be parsed; names it and where.
    """
    if condition is None or not condition.strip():
        return None
    return _Parser(condition).parse()  # a filter takes rows where it is true, not unknown


def message_filter(tags: str | None, where: str | None) -> ds.Expression | None:
    """Both filters together (``None`` when neither filters anything)."""
    parts = [e for e in (tag_filter(tags), sql_filter(where)) if e is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else parts[0] & parts[1]


@dataclass(frozen=True)
class _Token:
    kind: str  # number, string, op, word, end
    text: str
    at: int


class _Parser:
    """Recursive descent over the SQL92 subset RocketMQ's selectors use."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = self._tokens(text)
        self.i = 0

    def _tokens(self, text: str) -> list[_Token]:
        tokens, at = [], 0
        while at < len(text):
            if text[at:].strip() == "":
                break
            match = _TOKEN.match(text, at)
            if match is None or match.end() == at:
                self._fail("unexpected character", at + len(text[at:]) - len(text[at:].lstrip()))
            assert match is not None
            kind = match.lastgroup or "op"
            start = match.start(kind)
            tokens.append(_Token(kind, match.group(kind), start))
            at = match.end()
        tokens.append(_Token("end", "", len(text)))
        return tokens

    def _fail(self, problem: str, at: int) -> None:
        raise ConsumerError(
            f"bad SQL filter {self.text!r}: {problem} at position {at + 1} "
            "(e.g. \"region = 'eu' AND amount > 100\")"
        )

    @property
    def _now(self) -> _Token:
        return self.tokens[self.i]

    def _is(self, *words: str) -> bool:
        token = self._now
        value = token.text.upper() if token.kind == "word" else token.text
        return token.kind in ("word", "op") and value in words

    def _take(self, *words: str) -> _Token:
        if not self._is(*words):
            found = self._now.text or "the end"
            self._fail(f"expected {' or '.join(words)}, found {found!r}", self._now.at)
        token = self._now
        self.i += 1
        return token

    def parse(self) -> ds.Expression:
        expression = self._or()
        if self._now.kind != "end":
            self._fail(f"unexpected {self._now.text!r}", self._now.at)
        return expression

    def _or(self) -> ds.Expression:
        left = self._and()
        while self._is("OR"):
            self.i += 1
            left = left | self._and()
        return left

    def _and(self) -> ds.Expression:
        left = self._not()
        while self._is("AND"):
            self.i += 1
            left = left & self._not()
        return left

    def _not(self) -> ds.Expression:
        if self._is("NOT"):
            self.i += 1
            return ~self._not()
        return self._predicate()

    def _predicate(self) -> ds.Expression:
        if self._is("("):
            self.i += 1
            inner = self._or()
            self._take(")")
            return inner
        if self._is("TRUE", "FALSE"):
            return ds.scalar(self._take("TRUE", "FALSE").text.upper() == "TRUE")
        token = self._now
        if token.kind != "word" or token.text.upper() in _KEYWORDS:
            self._fail(f"expected a property name, found {token.text or 'the end'!r}", token.at)
        self.i += 1
        name = token.text
        if self._is("IS"):
            self.i += 1
            negated = self._is("NOT")
            if negated:
                self.i += 1
            self._take("NULL")
            missing = pc.is_null(_property(name))
            return ~missing if negated else missing
        negated = self._is("NOT")
        if negated:
            self.i += 1
            if not self._is("IN", "BETWEEN"):
                self._fail("expected IN or BETWEEN after NOT", self._now.at)
        if self._is("IN"):
            self.i += 1
            self._take("(")
            values = [self._literal()]
            while self._is(","):
                self.i += 1
                values.append(self._literal())
            self._take(")")
            found = _in(name, values)
            return ~found if negated else found
        if self._is("BETWEEN"):
            self.i += 1
            low = self._literal()
            self._take("AND")
            high = self._literal()
            if not isinstance(low, float) or not isinstance(high, float):
                self._fail("BETWEEN takes two numbers", token.at)
            value = _number(name)
            inside = pc.greater_equal(value, low) & pc.less_equal(value, high)
            return ~inside if negated else inside
        if not self._is(*_COMPARE):
            self._fail(
                f"expected a comparison (=, <>, <, <=, >, >=, IS, IN, BETWEEN) after {name!r}",
                self._now.at,
            )
        op = self._take(*_COMPARE)
        value = self._literal()
        if isinstance(value, float):
            return _COMPARE[op.text](_number(name), value)
        if op.text not in ("=", "<>", "!="):
            self._fail(f"strings compare with = or <> only, not {op.text}", op.at)
        return _COMPARE[op.text](_property(name), value)

    def _literal(self) -> float | str:
        token = self._now
        if token.kind == "number":
            self.i += 1
            return float(token.text)
        if token.kind == "string":
            self.i += 1
            return token.text[1:-1].replace("''", "'")
        self._fail(f"expected a number or a 'string', found {token.text or 'the end'!r}", token.at)
        raise AssertionError  # unreachable: _fail raises


def _property(name: str) -> ds.Expression:
    """A property's value (``TAGS``: the message's tag), null when the message has none."""
    if name.upper() == "TAGS":
        return ds.field("tags")
    return pc.map_lookup(ds.field("properties"), pa.scalar(name), "first")


def _number(name: str) -> ds.Expression:
    """A property as a number; null when missing or not a number."""
    value = _property(name)
    numeric = pc.match_substring_regex(value, _NUMBER_TEXT)
    text = pc.if_else(numeric, pc.utf8_trim_whitespace(value), pa.scalar(None, pa.string()))
    return text.cast(pa.float64())


def _in(name: str, values: list[float | str]) -> ds.Expression:
    """``name IN (...)``: unknown (null) for a missing value, so ``NOT IN`` skips it too."""
    if all(isinstance(v, float) for v in values):
        value, listed = _number(name), pa.array([float(v) for v in values], pa.float64())
    elif any(isinstance(v, float) for v in values):
        raise ConsumerError(f"IN for {name!r} mixes numbers and strings: {values!r}")
    else:
        value, listed = _property(name), pa.array([str(v) for v in values], pa.string())
    return pc.if_else(pc.is_null(value), pa.scalar(None, pa.bool_()), value.isin(listed))
