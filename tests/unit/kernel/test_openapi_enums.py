"""kernel.openapi_enums: a wire enum is documented as the inline string enum its Literal was."""

from enum import Enum, IntEnum, StrEnum
from typing import Literal

import msgspec
import pytest
from litestar import Litestar, get

from kernel.openapi_enums import inline_enums, inline_schema


class Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


ColourLiteral = Literal["red", "blue"]


class WithEnum(msgspec.Struct):
    required: Colour
    optional: Colour | None = None
    many: list[Colour] = []


class WithLiteral(msgspec.Struct):
    required: ColourLiteral
    optional: ColourLiteral | None = None
    many: list[ColourLiteral] = []


def _schema(model: type, *, inline: bool) -> dict:
    @get("/x", sync_to_thread=False)
    def handler() -> model:  # type: ignore[valid-type]  # the return model is a parameter of the test
        raise AssertionError("never served")

    app = Litestar([handler], debug=False)
    if inline:
        inline_enums(app, Colour)
    return app.openapi_schema.to_schema()


def test_enum_fields_are_documented_exactly_as_the_literal_was():
    enum_doc = _schema(WithEnum, inline=True)
    literal_doc = _schema(WithLiteral, inline=False)
    assert enum_doc["components"]["schemas"]["WithEnum"]["properties"] == \
        literal_doc["components"]["schemas"]["WithLiteral"]["properties"]
    assert "Colour" not in enum_doc["components"]["schemas"]  # no component left behind


def test_without_the_rewrite_litestar_documents_a_reference():
    """The reason the helper exists: the plain enum changes the document's shape."""
    doc = _schema(WithEnum, inline=False)
    assert doc["components"]["schemas"]["WithEnum"]["properties"]["required"] == {"$ref": "#/components/schemas/Colour"}
    assert "Colour" in doc["components"]["schemas"]


def test_inline_schema_shapes():
    assert inline_schema(Colour, optional=False).to_schema() == {"type": "string", "enum": ["red", "blue"]}
    assert inline_schema(Colour, optional=True).to_schema() == {"type": ["null", "string"],
                                                                "enum": ["red", "blue", None]}

    class Level(IntEnum):
        LOW = 1
        HIGH = 2

    assert inline_schema(Level, optional=False).to_schema() == {"type": "integer", "enum": [1, 2]}


def test_an_enum_that_cannot_be_inlined_is_refused_at_start_up():
    class Mixed(Enum):
        A = 1.5

    @get("/y", sync_to_thread=False)
    def handler() -> None:
        return None

    with pytest.raises(TypeError, match="Mixed"):
        inline_enums(Litestar([handler]), Mixed)
