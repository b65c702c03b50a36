"""Lark grammars as EBNF (GBNF), so structured outputs take a ``grammar`` in either syntax, as vLLM's xgrammar
backend does (it converts Lark the same way).

The subset converted: rules and terminals (``name: ...``, ``?name``, ``!name``, ``NAME.2``), alternatives over
several lines (``| ...``), ``"..."`` / ``'...'`` literals, ``/regex/`` terminals (literal characters, character
classes, groups, alternation, quantifiers, ``\\d \\w \\s``), ``[optional]``, ``x ~ n`` / ``x ~ m..n``, aliases
(``-> name``, dropped) and ``%import common.NAME`` of Lark's common terminals. The start rule is ``start``.
``%ignore``, templates and lookarounds are refused with a message saying so (``LarkConversionError``).
"""

from __future__ import annotations

import json
import re

COMMON = {  # Lark's common.lark terminals this converter knows, as EBNF
    "DIGIT": "[0-9]", "HEXDIGIT": "[a-fA-F0-9]", "INT": "[0-9]+", "SIGNED_INT": "[+-]? [0-9]+",
    "DECIMAL": "[0-9]+ \".\" [0-9]* | \".\" [0-9]+", "NUMBER": "[0-9]+ (\".\" [0-9]*)? ([eE] [+-]? [0-9]+)?",
    "SIGNED_NUMBER": "[+-]? ([0-9]+ (\".\" [0-9]*)? | \".\" [0-9]+) ([eE] [+-]? [0-9]+)?",
    "FLOAT": "[0-9]+ \".\" [0-9]* ([eE] [+-]? [0-9]+)?", "SIGNED_FLOAT": "[+-]? [0-9]+ \".\" [0-9]* ([eE] [+-]? [0-9]+)?",
    "LETTER": "[a-zA-Z]", "LCASE_LETTER": "[a-z]", "UCASE_LETTER": "[A-Z]", "WORD": "[a-zA-Z]+",
    "CNAME": "[a-zA-Z_] [a-zA-Z0-9_]*", "WS_INLINE": "[ \\t]+", "WS": "[ \\t\\f\\r\\n]+", "NEWLINE": "(\"\\r\"? \"\\n\")+",
    "CR": "\"\\r\"", "LF": "\"\\n\"", "ESCAPED_STRING": "\"\\\"\" ([^\"\\\\] | \"\\\\\" [^\\n])* \"\\\"\"",
}
_DEF = re.compile(r"^([?!]?)([A-Za-z_][A-Za-z0-9_]*)(\.-?[0-9]+)?\s*:(.*)$")
_ESCAPES = {"d": "[0-9]", "w": "[a-zA-Z0-9_]", "s": "[ \\t\\n\\r\\f]", "D": "[^0-9]", "W": "[^a-zA-Z0-9_]",
            "S": "[^ \\t\\n\\r\\f]"}


class LarkConversionError(ValueError):
    pass


def is_likely_lark(grammar: str) -> bool:
    """No ``::=`` anywhere and some line that defines ``name: ...``."""
    if "::=" in grammar:
        return False
    return any(_DEF.match(_strip_comment(line).strip()) for line in grammar.splitlines())


def _strip_comment(line: str) -> str:
    out, quote, i = [], None, 0
    while i < len(line):
        ch = line[i]
        if quote:
            out.append(ch)
            if ch == "\\" and i + 1 < len(line):
                out.append(line[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "\"'/" and not (ch == "/" and line[i:i + 2] == "//"):
            quote = ch
            out.append(ch)
        elif ch == "#" or line[i:i + 2] == "//":
            break
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def lark_to_ebnf(grammar: str) -> str:
    rules: list[tuple[str, str]] = []
    imports: list[str] = []
    for raw in grammar.splitlines():
        line = _strip_comment(raw).strip()
        if not line:
            continue
        if line.startswith("%import"):
            m = re.match(r"%import\s+common\.([A-Z_]+)(?:\s*->\s*([A-Za-z_][A-Za-z0-9_]*))?$", line)
            if not m or m.group(1) not in COMMON:
                raise LarkConversionError(f"unsupported import {line!r}: only %import common.NAME of "
                                          f"{', '.join(sorted(COMMON))}")
            imports.append(m.group(1) if not m.group(2) else f"{m.group(2)}\u0000{m.group(1)}")
            continue
        if line.startswith("%"):
            raise LarkConversionError(f"{line.split()[0]} is not supported (the output is generated token by token: "
                                      "ignored text cannot be expressed); write the whitespace into the rules")
        if line.startswith("|"):
            if not rules:
                raise LarkConversionError(f"an alternative before any rule: {line!r}")
            rules[-1] = (rules[-1][0], rules[-1][1] + " " + line)
            continue
        m = _DEF.match(line)
        if not m:
            raise LarkConversionError(f"cannot read this line as a Lark rule: {line!r}")
        rules.append((m.group(2), m.group(4).strip()))
    names = {name for name, _ in rules}
    if "start" not in names:
        raise LarkConversionError("a Lark grammar needs a 'start' rule")
    out = ["root ::= start"]
    for name, body in rules:
        out.append(f"{name} ::= {_body(body)}")
    for item in imports:
        alias, _, common = item.partition("\u0000")
        name, common = (alias, common) if common else (alias, alias)
        if name not in names:
            out.append(f"{name} ::= {COMMON[common]}")
    return "\n".join(out)


def _body(body: str) -> str:
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch.isspace():
            i += 1
        elif ch in "\"'":
            j = i + 1
            while j < len(body) and body[j] != ch:
                j += 2 if body[j] == "\\" else 1
            if j >= len(body):
                raise LarkConversionError(f"unterminated string in {body!r}")
            text = body[i + 1:j].encode().decode("unicode_escape") if "\\" in body[i + 1:j] else body[i + 1:j]
            out.append(json.dumps(text, ensure_ascii=False))
            i = j + 1
            if body[i:i + 1] == "i":  # case-insensitive literal flag
                raise LarkConversionError("case-insensitive literals (\"...\"i) are not supported")
        elif ch == "/":
            j = i + 1
            while j < len(body) and body[j] != "/":
                j += 2 if body[j] == "\\" else 1
            if j >= len(body):
                raise LarkConversionError(f"unterminated regular expression in {body!r}")
            out.append("(" + _regex(body[i + 1:j]) + ")")
            i = j + 1
            while i < len(body) and body[i].isalpha():  # flags
                raise LarkConversionError(f"regular expression flags are not supported: {body!r}")
        elif ch == "[":
            out.append("(")
            i += 1
        elif ch == "]":
            out.append(")?")
            i += 1
        elif body.startswith("->", i):
            i = len(body) if "|" not in body[i:] else body.index("|", i)  # an alias: dropped up to the next |
        elif ch == "~":
            m = re.match(r"~\s*([0-9]+)(?:\s*\.\.\s*([0-9]+))?", body[i:])
            if not m:
                raise LarkConversionError(f"cannot read the repetition in {body!r}")
            out.append(f"{{{m.group(1)}}}" if m.group(2) is None else f"{{{m.group(1)},{m.group(2)}}}")
            i += m.end()
        elif ch in "()|*+?":
            out.append(ch)
            i += 1
        else:
            m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", body[i:])
            if not m:
                raise LarkConversionError(f"unexpected {ch!r} in {body!r}")
            out.append(m.group(0))
            i += m.end()
    return " ".join(out)


def _regex(rx: str) -> str:
    out, i = [], 0
    while i < len(rx):
        ch = rx[i]
        if ch == "\\":
            nxt = rx[i + 1:i + 2]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
            elif nxt in "nrtf":
                out.append(json.dumps("\\" + nxt).replace("\\\\", "\\"))
            else:
                out.append(json.dumps(nxt))
            i += 2
        elif ch == "[":
            j = i + 1 + (rx[i + 1:i + 2] == "^")
            j += rx[j:j + 1] == "]"
            while j < len(rx) and rx[j] != "]":
                j += 2 if rx[j] == "\\" else 1
            out.append(rx[i:j + 1])
            i = j + 1
        elif ch == "(":
            if rx.startswith("(?", i):
                if not rx.startswith("(?:", i):
                    raise LarkConversionError(f"lookarounds and inline flags are not supported: /{rx}/")
                i += 2
            out.append("(")
            i += 1
        elif ch in ")|*+?":
            out.append(ch)
            i += 1
        elif ch == "{":
            j = rx.index("}", i)
            out.append(rx[i:j + 1])
            i = j + 1
        elif ch == ".":
            out.append("[^\\n]")
            i += 1
        else:
            out.append(json.dumps(ch, ensure_ascii=False))
            i += 1
    return " ".join(out)
