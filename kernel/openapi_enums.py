"""Wire enums shown inline in the OpenAPI document, as the string enum a ``Literal`` gave.

Litestar documents a ``StrEnum`` field as a ``$ref`` to a component schema, a ``Literal`` field as
an inline ``enum``. A wire field that became an enum in the code (e.g. the agent's ``deniedScope``)
keeps the document clients already use: :func:`inline_enums` rewrites every reference to the
listed enums, alone or ``| None``, exactly as the ``Literal`` of their values was documented
(``null`` last, type ``["null", "<type>"]``), and drops their component schemas.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from litestar.openapi.spec import OpenAPIType, Reference, Schema

_TYPES = ((str, OpenAPIType.STRING), (int, OpenAPIType.INTEGER))
_NESTED = ("all_of", "any_of", "one_of", "prefix_items")  # lists of schemas
_SINGLE = ("items", "schema_not", "additional_properties")  # one schema


def value_type(enum: type[Enum]) -> OpenAPIType:
    for base, t in _TYPES:
        if issubclass(enum, base):
            return t
    raise TypeError(f"{enum.__name__}: only str and int enums can be documented inline")


def inline_schema(enum: type[Enum], *, optional: bool) -> Schema:
    """The schema Litestar gives ``Literal[<enum's values>]`` (``| None`` when ``optional``)."""
    values: list[Any] = [m.value for m in enum]
    t = value_type(enum)
    if optional:
        return Schema(type=[OpenAPIType.NULL, t], enum=[*values, None])
    return Schema(type=t, enum=values)


def inline_enums(app: Any, *enums: type[Enum]) -> None:
    """Rewrite the app's OpenAPI document in place (call once, before it is first served)."""
    by_ref = {f"#/components/schemas/{e.__name__}": e for e in enums}
    for e in enums:
        value_type(e)  # refuse, at start-up, an enum this cannot document
    openapi = app.openapi_schema
    schemas = openapi.components.schemas if openapi.components is not None else {}
    for schema in schemas.values():
        _rewrite(schema, by_ref)
    for e in enums:
        schemas.pop(e.__name__, None)


def _replacement(node: Any, by_ref: dict[str, type[Enum]]) -> Schema | None:
    if isinstance(node, Reference) and node.ref in by_ref:
        return inline_schema(by_ref[node.ref], optional=False)
    if isinstance(node, Schema) and node.one_of is not None and len(node.one_of) == 2:
        ref, null = node.one_of
        if (isinstance(ref, Reference) and ref.ref in by_ref and isinstance(null, Schema)
                and null.type == OpenAPIType.NULL):
            return inline_schema(by_ref[ref.ref], optional=True)
    return None


def _sub(node: Any, by_ref: dict[str, type[Enum]]) -> Any:
    new = _replacement(node, by_ref)
    if new is not None:
        return new
    if isinstance(node, Schema):
        _rewrite(node, by_ref)
    return node


def _rewrite(schema: Schema, by_ref: dict[str, type[Enum]]) -> None:
    if schema.properties:
        schema.properties = {k: _sub(v, by_ref) for k, v in schema.properties.items()}
    for name in _NESTED:
        value = getattr(schema, name, None)
        if isinstance(value, list):
            setattr(schema, name, [_sub(v, by_ref) for v in value])
    for name in _SINGLE:
        value = getattr(schema, name, None)
        if isinstance(value, (Schema, Reference)):
            setattr(schema, name, _sub(value, by_ref))
