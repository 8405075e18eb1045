"""`DirectRoute`: the chat route served without FastAPI's dependency solving still admits,
refuses and documents exactly as a FastAPI route does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi import Depends, FastAPI, Request, Response
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from app.gateway.service import CHAT_PATH
from app.http.errors import ApiError, install_error_handlers
from app.http.routes import DirectRoute
from app.models import Role
from tests.http.test_dependencies import assert_openai_error, bearer


def test_the_chat_route_refuses_a_missing_key_and_a_wrong_role_before_any_model_call(
    client: TestClient, make_key: Callable[..., Any]
) -> None:
    body = {"model": "rtrl", "messages": [{"role": "user", "content": "hi"}]}
    route = next(r for r in client.app.routes if getattr(r, "path", "") == CHAT_PATH)  # type: ignore[attr-defined]
    assert isinstance(route, DirectRoute)

    missing = assert_openai_error(client.post(CHAT_PATH, json=body), 401, "authentication_error")
    assert missing["code"] == "missing_api_key"
    _, ops = make_key(Role.ops)
    wrong = client.post(CHAT_PATH, json=body, headers=bearer(ops))
    assert assert_openai_error(wrong, 403, "permission_error")["code"] == "insufficient_role"
    # An ide key is let through to the model, which is not running here: a clear 503.
    _, ide = make_key(Role.ide)
    answer = client.post(CHAT_PATH, json=body, headers=bearer(ide))
    assert assert_openai_error(answer, 503, "service_unavailable")["code"] == "upstream_unavailable"
    assert answer.headers["x-request-id"]


async def caller(request: Request) -> str:
    name = request.headers.get("x-caller")
    if name is None:
        raise ApiError(401, "Say who you are.", type="authentication_error", code="anonymous")
    return name


async def greet(request: Request, who: str = Depends(caller)) -> Response:
    """Greets the caller."""
    return Response(f"hello {who}, {len(await request.body())} bytes".encode())


def app_with(route_class: type[APIRoute]) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.router.add_api_route(
        "/greet", greet, methods=["POST"], response_model=None, route_class_override=route_class
    )
    return app


def test_it_calls_the_dependencies_and_the_endpoint_and_their_errors_reach_the_handlers() -> None:
    with TestClient(app_with(DirectRoute)) as client:
        assert client.post("/greet", content=b"abc", headers={"x-caller": "ada"}).text == (
            "hello ada, 3 bytes"
        )
        anonymous = assert_openai_error(client.post("/greet"), 401, "authentication_error")
        assert anonymous["code"] == "anonymous"


def test_its_openapi_schema_is_the_fastapi_routes() -> None:
    assert app_with(DirectRoute).openapi() == app_with(APIRoute).openapi()


async def by_query(request: Request, limit: int = 10) -> Response:
    return Response(str(limit))


def sync_caller(request: Request) -> str:
    return "sync"


async def with_sync(request: Request, who: str = Depends(sync_caller)) -> Response:
    return Response(who)


@pytest.mark.parametrize("endpoint", [by_query, with_sync])
def test_an_endpoint_it_cannot_serve_as_declared_is_refused_when_the_route_is_made(
    endpoint: Callable[..., Any],
) -> None:
    app = FastAPI()
    with pytest.raises(TypeError, match="DirectRoute"):
        app.router.add_api_route("/x", endpoint, methods=["GET"], route_class_override=DirectRoute)
