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

# A printed rule's parts: a literal, a character class, a macro (such as a string's
# `Regex("...", json_string=true)`), a rule name, a repetition range, a lookahead's
# opening, punctuation.
_TOKEN = re.compile(
    r'\s*(?:(?P<lit>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])'
    r'|(?P<macro>[A-Za-z_]\w*\("(?:[^"\\]|\\.)*"(?:\s*,\s*\w+=\w+)*\))|(?P<ref>[A-Za-z_]\w*)'
    r"|(?P<range>\{\s*\d+\s*(?:,\s*-?\d+\s*)?\})|(?P<look>\(=)|(?P<op>[()|*+?]))"
)
_RULE = re.compile(r"^(\w+) ::= (.*)$")
_WRAPPER = re.compile(r'^(\w+) ::= \(\("\\"" basic_string_sub\)\)$', re.MULTILINE)
_SUB = "basic_string_sub"
ANY = "any"  # a first character this does not track (a class, or unknown)
END = "end"  # the end of the document
_SIMPLE_ESCAPES = {'\\"': '"', "\\\\": "\\", "\\n": "\n", "\\t": "\t", "\\r": "\r"}
_CLASS_ESCAPES = {c: "\\" + c for c in ']\\-"'} | {v: k for k, v in _SIMPLE_ESCAPES.items()}


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
        if kind == "macro":  # may begin with anything, or be empty
            return _Node("rep", items=[_Node("cls")], repeats=False, optional=True)
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


@dataclass
class _Use:
    """A reference to a rule: the characters that may follow it inside its rule, and
    whether what follows the rule itself may follow it too (the rest may be empty)."""

    rule: str  # the rule it is in
    node: _Node
    inside: set[str]
    inherits: bool


class _Grammar:
    """The rules, their FIRST and FOLLOW sets, and every rule reference."""

    def __init__(self, lines: list[str]) -> None:
        self.rules: dict[str, _Node] = {}
        self.line_of: dict[str, int] = {}
        for i, line in enumerate(lines):
            match = _RULE.match(line)
            if match is None:
                raise _Unknown(line)
            self.rules[match[1]] = _Parser(line, match.start(2)).rule()
            self.line_of[match[1]] = i
        self.firsts: dict[str, tuple[frozenset, bool] | None] = {}  # by rule
        self.node_firsts: dict[int, tuple[frozenset, bool]] = {}  # by id() of a node
        self.uses: list[_Use] = []
        for name, body in self.rules.items():
            self._walk(name, body, set(), True)
        # A rule's FOLLOW: what follows each use inside its rule, and the FOLLOW of the
        # rules it ends; grown along those edges until nothing changes.
        self.rule_follow: dict[str, set[str]] = {name: set() for name in self.rules}
        if "root" in self.rule_follow:
            self.rule_follow["root"].add(END)
        ended_by: dict[str, set[str]] = {name: set() for name in self.rules}
        for use in self.uses:
            if use.node.name in self.rules:
                self.rule_follow[use.node.name] |= use.inside
                if use.inherits:
                    ended_by[use.rule].add(use.node.name)
        work = list(self.rules)
        while work:
            rule = work.pop()
            for inner in ended_by[rule]:
                if not self.rule_follow[rule] <= self.rule_follow[inner]:
                    self.rule_follow[inner] |= self.rule_follow[rule]
                    work.append(inner)

    def reachable(self, start: str) -> set[str]:
        """The rules start's strings may go through (start included, if a rule)."""
        refs: dict[str, list[str]] = {name: [] for name in self.rules}
        for use in self.uses:
            refs[use.rule].append(use.node.name)
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name in self.rules and name not in seen:
                seen.add(name)
                todo += refs[name]
        return seen

    def follow(self, use: _Use) -> set[str]:
        return use.inside | (self.rule_follow[use.rule] if use.inherits else set())

    def first(self, node: _Node) -> tuple[frozenset, bool]:
        """The characters node's strings may begin with, and whether it may be empty."""
        if node.kind in ("seq", "alt", "rep"):
            known = self.node_firsts.get(id(node))
            if known is None:
                known = self.node_firsts[id(node)] = self._first(node)
            return known
        return self._first(node)

    def _first(self, node: _Node) -> tuple[frozenset, bool]:
        if node.kind == "lit":
            empty = node.first is None
            return frozenset() if empty else frozenset([node.first]), empty
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

    def _walk(self, rule: str, node: _Node, after: set[str], inherits: bool) -> None:
        """Note each reference under node with what follows it (after, inside the rule;
        inherits: and what follows the rule)."""
        if node.kind == "ref":
            self.uses.append(_Use(rule, node, set(after), inherits))
        elif node.kind == "alt":
            for item in node.items:
                self._walk(rule, item, after, inherits)
        elif node.kind == "rep":
            inner = after | self.first(node.items[0])[0] if node.repeats else after
            self._walk(rule, node.items[0], set(inner), inherits)
        elif node.kind == "seq":
            for item in reversed(node.items):
                self._walk(rule, item, after, inherits)
                chars, empty = self.first(item)
                after = set(chars) | (after if empty else set())
                inherits = inherits and empty


def _lookahead(chars: frozenset) -> str:
    ordered = sorted(chars, key=lambda c: (c == "^", c))  # "^" first would negate it
    escaped = "".join(_CLASS_ESCAPES.get(c, c) for c in ordered)
    return f" (=([{escaped}]))" if escaped != "^" else " (=([\\^]))"


def _narrow(follow: set[str] | frozenset) -> bool:
    """Only characters a class can hold (not the document's end, nor unknown ones)."""
    return bool(follow) and not follow & {ANY, END}


def string_follows(text: str, star_string: str, lookahead: str) -> tuple[str, dict[str, str]]:
    """text (printed EBNF) with each use of the unbounded string rule `star_string`
    (whose lookahead is `lookahead`) given the characters that may follow it there (its
    own copy of the rules), and the lookahead of what may follow each rule, by rule,
    where it is narrower than any character; text unchanged and none if this does not
    read it."""
    lines = text.rstrip("\n").splitlines()
    try:
        grammar = _Grammar(lines)
    except (_Unknown, RecursionError):
        return text, {}
    follows = grammar.rule_follow.items()
    lookaheads = {name: _lookahead(frozenset(f)) for name, f in follows if _narrow(f)}
    wrappers = set(_WRAPPER.findall(text))
    if not wrappers or star_string not in lines:
        return text, lookaheads
    # Places by what may follow them: those with only characters a class can hold, in
    # rules the document can reach (each copy costs the compiler a pass over the
    # vocabulary; xgrammar's JSON grammars hold rules no schema uses).
    reachable = grammar.reachable("root")
    groups: dict[frozenset, list[_Use]] = {}
    for use in grammar.uses:
        follow = frozenset(grammar.follow(use))
        if use.node.name in wrappers and use.rule in reachable and _narrow(follow):
            groups.setdefault(follow, []).append(use)
    new_rules, edits = [], []  # edits: (line, start, end, new name)
    for i, (follow, uses) in enumerate(sorted(groups.items(), key=lambda g: sorted(g[0]))):
        wrapper, sub = f"basic_string_n{i}", f"{_SUB}_n{i}"
        if wrapper in grammar.rules or sub in grammar.rules:
            return text, lookaheads
        body = star_string.replace(lookahead, _lookahead(follow))
        new_rules += [f'{wrapper} ::= (("\\"" {sub}))', body.replace(_SUB, sub)]
        edits += [(grammar.line_of[u.rule], *u.node.span, wrapper) for u in uses]
    if not edits:
        return text, lookaheads
    for line, start, end, name in sorted(edits, reverse=True):
        lines[line] = lines[line][:start] + name + lines[line][end:]
    return "\n".join(lines + new_rules), lookaheads
