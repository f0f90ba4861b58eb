"""Limits on a GBNF grammar, checked before llama.cpp parses it.

llama.cpp's GBNF parser recurses once per level of parentheses; a 200 KB
grammar of nested parentheses overflows the worker thread's stack (SIGSEGV at
about 20,000 levels in a service thread here) and takes the inference process,
with every session's KV, down with it. ``check_grammar`` refuses such a
grammar with a typed ``bad_request`` first: it bounds the size and the nesting
depth, measured by a scanner that skips what llama.cpp skips (string
literals, character classes, comments), so a parenthesis inside ``"("`` is not
counted and every one the parser would recurse on is.

Every grammar that reaches llama.cpp must pass here: ``constraint.gbnf_constraint``
calls it before llguidance or llama.cpp's grammar sampler sees the text, whichever
message built it.
"""

from __future__ import annotations

from shared.protocol import ErrorCode, ProtocolError

#: Bytes of GBNF text; the largest agent action grammar (7 tools) is about 10 KB.
MAX_GRAMMAR_BYTES = 128 * 1024
#: Levels of parentheses. llama.cpp's parser takes about 430 bytes of stack a level (the crash came between
#: 18,000 and 20,000 levels in a thread with the default 8 MiB stack); 1000 levels are 0.4 MiB. Grammars that
#: llama-cpp-python's json_schema_to_gbnf makes nest one level per character of a string's maxLength (the
#: agent's: 300); a converter that writes ``{0,N}`` repetitions does not nest at all.
MAX_GRAMMAR_NESTING = 1000


def _refuse(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, f"grammar refused: {message}")


def gbnf_pieces(grammar: str) -> list[tuple[str, bool]]:
    """The grammar cut into (piece, is_code): string literals, character classes and comments are not code,
    so their parentheses are characters (the one scanner of GBNF text: limits here, rewrites in the engine)."""
    pieces, start, i, n = [], 0, 0, len(grammar)
    while i < n:
        ch = grammar[i]
        if ch not in "\"[#":
            i += 1
            continue
        pieces.append((grammar[start:i], True))
        j = i + 1
        if ch == "#":
            while j < n and grammar[j] != "\n":
                j += 1
        else:
            close, what = ('"', "string") if ch == '"' else ("]", "character class")
            while j < n and grammar[j] != close:
                j += 2 if grammar[j] == "\\" else 1
            if j >= n:
                raise _refuse(f"unterminated {what}")
            j += 1
        pieces.append((grammar[i:j], False))
        start = i = j
    pieces.append((grammar[start:], True))
    return pieces


def nesting_depth(grammar: str) -> int:
    """The deepest level of parentheses llama.cpp's parser would recurse into."""
    depth = deepest = 0
    for piece, code in gbnf_pieces(grammar):
        for ch in piece if code else "":
            if ch == "(":
                depth += 1
                deepest = max(deepest, depth)
            elif ch == ")":
                depth = max(0, depth - 1)  # an unmatched ')' is llama.cpp's parse error to report
    return deepest


def check_grammar(grammar: str) -> None:
    """Raise ``bad_request`` for a grammar too large or too deeply nested to hand to llama.cpp."""
    size = len(grammar.encode("utf-8", errors="replace"))
    if size > MAX_GRAMMAR_BYTES:
        raise _refuse(f"{size} bytes; the limit is {MAX_GRAMMAR_BYTES}")
    depth = nesting_depth(grammar)
    if depth > MAX_GRAMMAR_NESTING:
        raise _refuse(f"parentheses nested {depth} deep; the limit is {MAX_GRAMMAR_NESTING}")
