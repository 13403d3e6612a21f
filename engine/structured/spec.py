"""GrammarSpec: what a request's output must match, and its xgrammar Grammar.

A spec is a plain frozen value (kind, spec text) so that it pickles into the
engine process and keys the compiled-grammar cache. Building the Grammar needs
no tokenizer: it is the validation the server runs before a request is queued,
and the first half of the compilation the engine runs off its thread.

JSON grammars allow no free whitespace: separators are exactly ", " and ": " (as
json.dumps writes them), so a model cannot spin in newlines until max_tokens. Their
strings are rewritten into rules whose token masks xgrammar can cache
(`cached_strings`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.structured.string_follow import string_follows

if TYPE_CHECKING:
    import xgrammar as xgr

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
# Each kind, by the name an invalid spec's error gives it.
KINDS = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "EBNF grammar",
}

# xgrammar's characters of a JSON string admit UTF-16 surrogates (invalid UTF-8,
# decoded as U+FFFD), and in a length-bounded string raw control characters too,
# which JSON forbids: strict parsers such as pydantic's would reject the document.
_LOOSE_CHARACTERS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_CHARACTER = r"[^\0-\x1f\"\\\ud800-\udfff]"
# What follows a string without free whitespace: a separator, the end of its object or
# array, or its key's colon. xgrammar's lookahead (a hint: a token going past the string
# must go on with one of these) also allows whitespace first, leaving more tokens that
# close a string to be checked against the grammar at every step.
_LOOSE_LOOKAHEAD = r" (=([ \n\r\t]* [,}\]:]))"
_LOOKAHEAD = r" (=([,}\]:]))"
# The rest of an unbounded string (xgrammar's, characters and lookahead as above) as one
# character or escape a step, and the same as runs of characters between escapes: a
# star over a character class, which xgrammar matches and masks in one pass.
_RECURSIVE_STRING = (
    rf'basic_string_sub ::= (("\"") | ({_JSON_CHARACTER} basic_string_sub)'
    rf' | ("\\" basic_escape basic_string_sub)){_LOOKAHEAD}'
)
_STAR_STRING = (
    rf'basic_string_sub ::= (({_JSON_CHARACTER}* "\"")'
    rf' | ({_JSON_CHARACTER}* "\\" basic_escape basic_string_sub)){_LOOKAHEAD}'
)
# xgrammar's rule for a length-bounded JSON string: '"' characters{lo, hi} '"', and the
# body of its characters rule.
_BOUNDED_STRING = re.compile(r'^(\w+) ::= \(\("\\"" (\w+)\{(\d+), (\d+)\} "\\""\)\)$', re.MULTILINE)
_RULE_BODY = r"^{} ::= (.*)$"
# Rules a grammar's chains may add (each costs the compiler a pass over the vocabulary);
# strings past them keep xgrammar's repetition.
MAX_CHAIN_RULES = 512


@dataclass(frozen=True)
class GrammarSpec:
    """kind json: spec is the schema as JSON text; regex, grammar (EBNF): the pattern;
    choice: the alternatives; json_object: any JSON object (spec None)."""

    kind: Kind
    spec: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"structured output kind must be one of {tuple(KINDS)}, got {self.kind!r}"
            )

    @classmethod
    def json_schema(cls, schema: dict | str) -> GrammarSpec:
        """A schema given as a dict or as JSON text (keys keep their order: the output's)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError("the JSON schema must be an object")
        return cls("json", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty list of strings")
        return cls("choice", tuple(choices))


def build_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The spec's Grammar; ValueError saying what is wrong with an invalid one (any
    thread, no tokenizer: the check the server runs before queueing)."""
    import xgrammar as xgr  # here: SamplingParams imports this module, and most never need it

    try:
        if spec.kind in ("json", "json_object"):
            schema = spec.spec if spec.kind == "json" else '{"type": "object"}'
            return _json_strings(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            # JSON string literals are EBNF string literals (escapes included).
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.spec))
        return xgr.Grammar.from_ebnf(spec.spec)
    except RuntimeError as exc:  # xgrammar reports parse errors as RuntimeError
        raise ValueError(f"invalid {KINDS[spec.kind]}: {_reason(exc)}") from None


def _json_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """xgrammar's JSON grammar with JSON's own string characters, and strings whose
    token masks the compiler works out ahead."""
    import xgrammar as xgr

    text = str(grammar)
    strict = cached_strings(strict_characters(text))
    return grammar if strict == text else xgr.Grammar.from_ebnf(strict)


def strict_characters(text: str) -> str:
    """JSON's string characters where xgrammar's admit more."""
    for loose in _LOOSE_CHARACTERS:
        text = text.replace(loose, _JSON_CHARACTER)
    return text


def cached_strings(text: str) -> str:
    """The same language, with masks the compiler works out ahead: the lookahead after a
    string allows no whitespace and only what may follow the string where it is
    (string_follow.py), an unbounded string takes runs of characters, and
    length-bounded strings are chains of rules. Inside xgrammar's repetition
    `characters{lo, hi}` a mask is worked out token by token at every step
    (milliseconds a row for a 50k vocabulary); a chain's rule k is the string with at
    most k characters left, which ends there or takes one more, so each rule ends the
    string itself. Strings of the same characters and lookahead share one chain, and a
    minimum length adds rules that must take a character."""
    text = text.replace(_LOOSE_LOOKAHEAD, _LOOKAHEAD).replace(_RECURSIVE_STRING, _STAR_STRING)
    text, lookaheads = string_follows(text, _STAR_STRING, _LOOKAHEAD)  # by rule, where narrower
    chains: dict[tuple[str, str], _Chain] = {}  # by the characters rule's body, lookahead
    spent = 0

    def chain(bounded: re.Match) -> str:
        nonlocal spent
        name, characters, lo, hi = bounded[1], bounded[2], int(bounded[3]), int(bounded[4])
        body = re.search(_RULE_BODY.format(characters), text, re.MULTILINE)
        if body is None:
            return bounded[0]
        key = (body[1], lookaheads.get(name, _LOOKAHEAD))
        shared = chains.get(key) or _Chain(characters, key[1])
        if re.search(rf"^{shared.characters}_(left|must)", text, re.MULTILINE):
            return bounded[0]  # the names are taken
        chains[key] = shared
        cost = shared.cost(lo, hi)
        if spent + cost > MAX_CHAIN_RULES:
            return bounded[0]
        spent += cost
        return f'{name} ::= "\\"" {shared.start(lo, hi)}'

    text = _BOUNDED_STRING.sub(chain, text)
    return "\n".join([text.rstrip("\n"), *(c.rules() for c in chains.values() if c.left >= 0)])


@dataclass
class _Chain:
    """Rules for strings of one kind of character (the rule `characters`, the first such
    string's) followed by what `lookahead` allows: `{characters}_left{k}`, at most k more
    characters, and `{characters}_must{m}_{k}`, m characters before those."""

    characters: str
    lookahead: str
    left: int = -1  # the longest `left` rule made
    must: set[tuple[int, int]] = field(default_factory=set)

    def cost(self, lo: int, hi: int) -> int:
        new_must = sum((m, hi - lo) not in self.must for m in range(1, lo + 1))
        return max(0, hi - lo - self.left) + new_must

    def start(self, lo: int, hi: int) -> str:
        self.left = max(self.left, hi - lo)
        for m in range(1, lo + 1):
            self.must.add((m, hi - lo))
        c = self.characters
        return f"{c}_must{lo}_{hi - lo}" if lo else f"{c}_left{hi}"

    def rules(self) -> str:
        p = self.characters
        look = self.lookahead
        out = [f'{p}_left0 ::= "\\""{look}']
        for k in range(1, self.left + 1):
            out.append(f'{p}_left{k} ::= (({p} {p}_left{k - 1}) | ("\\"")){look}')
        for m, k in sorted(self.must):
            after = f"{p}_must{m - 1}_{k}" if m > 1 else f"{p}_left{k}"
            out.append(f"{p}_must{m}_{k} ::= {p} {after}{look}")
        return "\n".join(out)


def _reason(exc: RuntimeError) -> str:
    """xgrammar's message without its `[time] file.cc:line:` prefix."""
    message = str(exc).strip()
    head, sep, rest = message.partition(": ")
    return rest if sep and ".cc:" in head else message
