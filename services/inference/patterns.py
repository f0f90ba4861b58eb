"""Regular expressions that come with requests (JSON-schema ``pattern``s), run in linear time.

Python's ``re`` backtracks: ``^(a+)+$`` against a long run of ``a`` followed by ``!`` takes longer than the
universe, and jsonschema validates ``pattern`` with ``re``. A tool schema is the client's input, so every
pattern in it is compiled by RE2 (google-re2), whose matching time is linear in the text, and validation uses
that compiled RE2. A pattern RE2 cannot compile (backreferences, lookaround) is refused with a 400 that names
where it is; ``patternProperties`` (matched by jsonschema internals with ``re``) is refused the same way.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterator

import jsonschema
import re2

from shared.protocol import ErrorCode, ProtocolError

#: Keywords whose values are data, not schemas: a "pattern" key inside them is not a pattern.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
#: Keywords whose values map names to schemas.
_NAMED_SCHEMAS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})
_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is the client's error, answered; not worth a line on stderr


@lru_cache(maxsize=1024)
def _compiled(pattern: str) -> Any:
    return re2.compile(pattern, _OPTIONS)


def check_patterns(schema: Any, what: str) -> None:
    """Refuse (400, naming the place) a pattern RE2 cannot run, and ``patternProperties``."""
    for where, key, value in _keywords(schema, what):
        if key == "patternProperties":
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}.patternProperties is not supported "
                                                       "(use properties, or additionalProperties with a schema)")
        if key == "pattern":
            if not isinstance(value, str):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}.pattern must be a string")
            try:
                _compiled(value)
            except re2.error as err:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}.pattern cannot run in linear time "
                                                           f"(RE2: {err}); backreferences and lookaround are not "
                                                           "supported") from None


def _keywords(node: Any, where: str) -> Iterator[tuple[str, str, Any]]:
    """Every (place, keyword, value) in a schema: not inside data keywords, and a property *named* "pattern"
    is a name, not a keyword."""
    stack = [(node, where)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((value, f"{where}[{i}]") for i, value in enumerate(node))
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            yield where, key, value
            if key in _NAMED_SCHEMAS and isinstance(value, dict):
                stack.extend((schema, f"{where}.{key}.{name}") for name, schema in value.items())
            elif key not in _DATA_KEYWORDS:
                stack.append((value, f"{where}.{key}"))


def _pattern(validator: Any, pattern: str, instance: Any, schema: dict) -> Iterator[jsonschema.ValidationError]:
    if validator.is_type(instance, "string") and not _compiled(pattern).search(instance):
        yield jsonschema.ValidationError(f"{instance[:80]!r} does not match {pattern!r}")


@lru_cache(maxsize=None)
def _linear(base: type) -> type:
    return jsonschema.validators.extend(base, {"pattern": _pattern})


def linear_validator(schema: dict) -> Any:
    """A jsonschema validator of ``schema`` (already through ``check_patterns``) that matches patterns with RE2;
    raises ``jsonschema.SchemaError`` for a schema that is not valid."""
    base = jsonschema.validators.validator_for(schema)
    base.check_schema(schema)
    return _linear(base)(schema)
