"""kernel.openapi_problems: every operation documents its error answers as problem+json."""

from litestar import Litestar, get, post
from litestar.params import JSONBody

from kernel.openapi_problems import STATUSES, document_problems


@get("/thing", sync_to_thread=False)
def read_thing() -> dict:
    return {}


@post("/thing", sync_to_thread=False)
def write_thing(data: JSONBody[dict]) -> dict:
    return data


def test_every_operation_lists_the_error_statuses_as_problem_json():
    app = Litestar([read_thing, write_thing])
    document_problems(app)
    doc = app.openapi_schema.to_schema()
    for method in ("get", "post"):
        responses = doc["paths"]["/thing"][method]["responses"]
        assert set(STATUSES) <= set(responses)
        for code in STATUSES:
            content = responses[code]["content"]
            assert list(content) == ["application/problem+json"], (method, code)  # never application/json
            schema = content["application/problem+json"]["schema"]
            assert schema["required"] == ["type", "title", "status"]
        assert "200" in responses or "201" in responses  # the success answer is kept
