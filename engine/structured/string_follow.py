"""What may follow each JSON string, as the lookahead of a string rule of its own.

A token that closes a string and goes on past it (`",`, `"]}` ...) is one xgrammar
cannot judge when it compiles the string's rule, unless the rule's lookahead (a hint:
what follows the rule must begin so) rules it out: every such token left is checked
against the grammar at every step, for every row inside a string. One string rule
serves every string of a schema, so its lookahead must allow whatever follows any of
them (`[,}\\]:]`). Here each place a string is used gets the characters that can
follow it there (a property's value, then `,` or the object's `}`; a key, then `:`),
worked out as the FOLLOW sets of the grammar's rules, and places with the same
characters share a copy of the string's rules with that lookahead. A length-bounded
string's chain of rules (spec.py) takes the characters that may follow its rule.

The grammar is read from xgrammar's printed EBNF; anything this does not know, or a
string that may end the document, keeps the shared rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# A printed rule's parts: a literal, a character class, a rule name, a repetition
# range, a lookahead's opening, punctuation.
_TOKEN = re.compile(
    r'\s*(?:(?P<lit>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<ref>[A-Za-z_]\w*)'
    r"|(?P<range>\{\s*\d+\s*(?:,\s*-?\d+\s*)?\})|(?P<look>\(=)|(?P<op>[()|*+?]))"
)
_RULE = re.compile(r"^(\w+) ::= (.*)$")
_WRAPPER = re.compile(r'^(\w+) ::= \(\("\\"" basic_string_sub\)\)$', re.MULTILINE)
_SUB = "basic_string_sub"
ANY = "any"  # a first character this does not track (a class, or unknown)
END = "end"  # the end of the document
_SIMPLE_ESCAPES = {'\\"': '"', "\\\\": "\\", "\\n": "\n", "\\t": "\t", "\\r": "\r"}


class _Unknown(ValueError):
    """Grammar text this reader does not parse: the caller keeps the text."""


@dataclass(eq=False)
class _Node:
    kind: str  # lit, cls, ref, seq, alt, rep
    first: str | None = None  # lit: its first character (None: the empty literal)
    name: str = ""  # ref
    span: tuple[int, int] = (0, 0)  # ref: where its name is, in the rule's line
    items: list[_Node] = field(default_factory=list)  # seq, alt; rep: [the repeated]
    repeats: bool = False  # rep: more than once
    optional: bool = False  # rep: zero times


def _literal_first(literal: str) -> str | None:
    body = literal[1:-1]
    if not body:
        return None
    if body[0] != "\\":
        return body[0]
    if body[:2] in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[body[:2]]
    return ANY


class _Parser:
    def __init__(self, line: str, start: int) -> None:
        self.tokens = []  # (kind, text, start, end)
        pos = start
        while pos < len(line):
            match = _TOKEN.match(line, pos)
            if match is None or match.end() == pos:
                if line[pos:].strip():
                    raise _Unknown(line[pos:])
                break
            kind = match.lastgroup
            self.tokens.append((kind, match[kind], match.start(kind), match.end(kind)))
            pos = match.end()
        self.at = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.at][:2] if self.at < len(self.tokens) else None

    def take(self) -> tuple[str, str, int, int]:
        if self.at >= len(self.tokens):
            raise _Unknown("unexpected end")
        self.at += 1
        return self.tokens[self.at - 1]

    def rule(self) -> _Node:
        body = self.alternatives()
        if self.peek() == ("look", "(="):  # a hint only: not part of the language
            self.take()
            self.alternatives()
            if self.take()[1] != ")":
                raise _Unknown("lookahead")
        if self.peek() is not None:
            raise _Unknown(str(self.peek()))
        return body

    def alternatives(self) -> _Node:
        options = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.take()
            options.append(self.sequence())
        return options[0] if len(options) == 1 else _Node("alt", items=options)

    def sequence(self) -> _Node:
        items = []
        while (token := self.peek()) is not None and token[1] not in ("|", ")", "(="):
            items.append(self.postfix(self.atom()))
        return _Node("seq", items=items)

    def atom(self) -> _Node:
        kind, text, start, end = self.take()
        if kind == "lit":
            return _Node("lit", first=_literal_first(text))
        if kind == "cls":
            return _Node("cls")
        if kind == "ref":
            return _Node("ref", name=text, span=(start, end))
        if text == "(":
            inner = self.alternatives()
            if self.take()[1] != ")":
                raise _Unknown("group")
            return inner
        raise _Unknown(text)

    def postfix(self, node: _Node) -> _Node:
        while (token := self.peek()) is not None and (token[0] == "range" or token[1] in "*+?"):
            text = self.take()[1]
            if text in "*+?":
                lo, hi = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}[text]
            else:
                bounds = [int(b) for b in text[1:-1].split(",")]
                lo, hi = bounds[0], bounds[-1]
            node = _Node("rep", items=[node], repeats=hi != 1, optional=lo == 0)
        return node


class _Grammar:
    """The rules, their FIRST sets and the FOLLOW set of every rule reference."""

    def __init__(self, lines: list[str]) -> None:
        self.rules: dict[str, _Node] = {}
        self.line_of: dict[str, int] = {}
        for i, line in enumerate(lines):
            match = _RULE.match(line)
            if match is None:
                raise _Unknown(line)
            self.rules[match[1]] = _Parser(line, match.start(2)).rule()
            self.line_of[match[1]] = i
        self.firsts: dict[str, tuple[frozenset, bool] | None] = {}
        self.follow: dict[int, set[str]] = {}  # by id() of a ref node
        self.refs: dict[int, tuple[str, _Node]] = {}  # id -> (the rule it is in, node)
        self.rule_follow: dict[str, set[str]] = {name: set() for name in self.rules}
        self.rule_follow["root"] = {END}
        changed = True
        while changed:
            changed = False
            for name, body in self.rules.items():
                changed |= self._walk(name, body, set(self.rule_follow[name]), self.rule_follow)

    def first(self, node: _Node) -> tuple[frozenset, bool]:
        """The characters node's strings may begin with, and whether it may be empty."""
        if node.kind == "lit":
            return (frozenset() if node.first is None else frozenset([node.first])), (
                node.first is None
            )
        if node.kind == "cls":
            return frozenset([ANY]), False
        if node.kind == "ref":
            if node.name not in self.rules:
                return frozenset([ANY]), True
            if node.name not in self.firsts:
                self.firsts[node.name] = None  # recursion before a character: unknown
                self.firsts[node.name] = self.first(self.rules[node.name])
            return self.firsts[node.name] or (frozenset([ANY]), True)
        if node.kind == "rep":
            chars, empty = self.first(node.items[0])
            return chars, empty or node.optional
        if node.kind == "alt":
            parts = [self.first(item) for item in node.items]
            return frozenset().union(*(p[0] for p in parts)), any(p[1] for p in parts)
        chars: frozenset = frozenset()  # seq
        for item in node.items:
            item_chars, empty = self.first(item)
            chars |= item_chars
            if not empty:
                return chars, False
        return chars, True

    def _walk(self, rule: str, node: _Node, after: set[str], rule_follow: dict) -> bool:
        """Give each reference under node what may follow it (after: what follows node);
        whether a rule's FOLLOW set grew."""
        if node.kind == "ref":
            self.follow.setdefault(id(node), set()).update(after)
            self.refs[id(node)] = (rule, node)
            grown = node.name in rule_follow and not after <= rule_follow[node.name]
            if grown:
                rule_follow[node.name] |= after
            return grown
        if node.kind == "alt":
            return any([self._walk(rule, item, after, rule_follow) for item in node.items])
        if node.kind == "rep":
            inner = after | self.first(node.items[0])[0] if node.repeats else after
            return self._walk(rule, node.items[0], set(inner), rule_follow)
        grown = False
        if node.kind == "seq":
            for item in reversed(node.items):
                grown |= self._walk(rule, item, set(after), rule_follow)
                chars, empty = self.first(item)
                after = set(chars) | (after if empty else set())
        return grown


def _lookahead(chars: frozenset) -> str:
    escaped = "".join("\\" + c if c in "]\\^-" else c for c in sorted(chars))
    return f" (=([{escaped}]))"


def _narrow(follow: set[str] | frozenset) -> bool:
    """Only characters a class can hold (not the document's end, nor unknown ones)."""
    return bool(follow) and not follow & {ANY, END}


def _read(text: str) -> _Grammar | None:
    try:
        return _Grammar(text.rstrip("\n").splitlines())
    except (_Unknown, RecursionError):
        return None


def follow_lookaheads(text: str) -> dict[str, str]:
    """By rule of text (printed EBNF): a lookahead of the characters that may follow the
    rule wherever it is used, for the rules it can narrow; {} if text is not read."""
    grammar = _read(text)
    if grammar is None:
        return {}
    follows = grammar.rule_follow.items()
    return {name: _lookahead(frozenset(f)) for name, f in follows if _narrow(f)}


def narrow_string_lookaheads(text: str, star_string: str, lookahead: str) -> str:
    """text (printed EBNF) with each use of the unbounded string rule `star_string`
    (whose lookahead is `lookahead`) given the characters that may follow it there."""
    wrappers = set(_WRAPPER.findall(text))
    if not wrappers or star_string not in text.splitlines():
        return text
    grammar = _read(text)
    if grammar is None:
        return text
    lines = text.rstrip("\n").splitlines()
    # Places by what may follow them: those with only characters a class can hold.
    groups: dict[frozenset, list[_Node]] = {}
    rule_of: dict[int, str] = {}
    for key, (rule, node) in grammar.refs.items():
        follow = frozenset(grammar.follow[key])
        if node.name in wrappers and _narrow(follow):
            groups.setdefault(follow, []).append(node)
            rule_of[id(node)] = rule
    if not groups:
        return text
    taken = set(grammar.rules)
    new_rules, edits = [], []  # edits: (line, start, end, new name)
    for i, (follow, nodes) in enumerate(sorted(groups.items(), key=lambda g: sorted(g[0]))):
        wrapper, sub = f"basic_string_n{i}", f"{_SUB}_n{i}"
        if wrapper in taken or sub in taken:
            return text
        body = star_string.replace(lookahead, _lookahead(follow))
        new_rules += [f'{wrapper} ::= (("\\"" {sub}))', body.replace(_SUB, sub)]
        edits += [(grammar.line_of[rule_of[id(n)]], *n.span, wrapper) for n in nodes]
    for line, start, end, name in sorted(edits, reverse=True):
        lines[line] = lines[line][:start] + name + lines[line][end:]
    return "\n".join(lines + new_rules)
