"""`parse_body`: a body that is not JSON, not an object or not the model is refused in the
OpenAI error shape, naming the field at fault."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from app.http.bodies import json_object, parse_body
from app.http.errors import ApiError


class Order(BaseModel):
    items: list[str] = Field(min_length=1)
    choice: Literal["none", "auto"] | int | None = None


def refusal(raw: bytes | dict[str, Any], **options: Any) -> ApiError:
    with pytest.raises(ApiError) as refused:
        parse_body(raw, Order, **options)
    return refused.value


def test_a_valid_body_is_the_model() -> None:
    assert parse_body(b'{"items": ["tea"]}', Order).items == ["tea"]
    assert parse_body({"items": ["tea"]}, Order, status=400).items == ["tea"]


def test_a_body_that_is_not_json_is_a_400() -> None:
    error = refusal(b"{")
    assert (error.status_code, error.code) == (400, "invalid_json")
    assert error.message.startswith("The body is not valid JSON: ")


def test_an_invalid_body_names_its_field_in_the_given_status_code_and_message() -> None:
    error = refusal(b'{"items": []}')
    assert (error.status_code, error.code, error.param) == (422, "invalid_body", "items")
    assert error.message.startswith("items: List should have at least 1 item")

    error = refusal(b"[]", status=400, code="invalid_value", message="Invalid {where}: {error}")
    assert (error.status_code, error.code, error.param) == (400, "invalid_value", None)
    assert error.message.startswith("Invalid body: Input should be a valid dictionary")


def test_union_members_are_left_out_of_the_field_when_asked() -> None:
    body = {"items": ["tea"], "choice": "some"}
    assert refusal(body).param == "choice.literal['none','auto']"
    assert refusal(body, skip_union_members=True).param == "choice"


def test_json_object_refuses_json_that_is_not_an_object() -> None:
    assert json_object(b'{"a": 1}') == {"a": 1}
    with pytest.raises(ApiError) as refused:
        json_object(b"[1]")
    assert (refused.value.status_code, refused.value.code) == (400, "invalid_json")
    assert refused.value.message == "The body must be a JSON object."
