"""Document the error answers both services really give: every error is an RFC 9457 problem
(``application/problem+json``, see ``kernel.errors.to_problem``). Litestar documents
its own 400 as ``application/json``; this replaces that and adds the other statuses, so the
schema tells clients (and schemathesis) the truth."""

from __future__ import annotations

from typing import Any

from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Schema

PROBLEM = Schema(
    type=OpenAPIType.OBJECT,
    required=["type", "title", "status"],
    properties={
        "type": Schema(type=OpenAPIType.STRING),
        "title": Schema(type=OpenAPIType.STRING),
        "status": Schema(type=OpenAPIType.INTEGER),
        "detail": Schema(type=OpenAPIType.STRING),
        "retriable": Schema(type=OpenAPIType.BOOLEAN),
        "instance": Schema(type=OpenAPIType.STRING),
    },
    description="RFC 9457 problem details (more members may be present)",
)
STATUSES = {"400": "Malformed request", "401": "Missing or invalid credentials", "403": "Not permitted",
            "404": "No such resource", "405": "Method not allowed", "409": "Conflict",
            "413": "Request body too large",
            "415": "Request body is not application/json", "422": "Request failed validation",
            "503": "Dependency unavailable (retriable)"}


def document_problems(app: Any) -> None:
    """Rewrite the app's OpenAPI document in place (call once, before it is first served)."""
    openapi = app.openapi_schema
    for path_item in (openapi.paths or {}).values():
        for method in ("get", "post", "put", "delete", "patch"):
            op = getattr(path_item, method, None)
            if op is None:
                continue
            responses = op.responses if op.responses is not None else {}
            for code, description in STATUSES.items():
                responses[code] = OpenAPIResponse(
                    description=description,
                    content={"application/problem+json": OpenAPIMediaType(schema=PROBLEM)})
            op.responses = responses
