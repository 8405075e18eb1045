"""A route for the hot path: FastAPI's route, served without its dependency solving.

FastAPI solves an endpoint's dependencies anew on every request (a walk of its parameters, a
sub-response for their headers): on this machine 35 of the 47 µs a FastAPI route costs a
request beyond a Starlette route (`python -m bench.gateway_floor`). An endpoint that
takes only the request and dependencies that themselves take only the request needs none of
that: `DirectRoute` calls those dependencies and then the endpoint itself. Everything else is
FastAPI's route: the path match, the OpenAPI schema its signature declares, the exception
handlers its errors reach.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

_OTHER_INPUTS = (
    "path_params",
    "query_params",
    "header_params",
    "cookie_params",
    "body_params",
    "websocket_param_name",
    "http_connection_param_name",
    "response_param_name",
    "background_tasks_param_name",
    "security_scopes_param_name",
)


def _takes_only_the_request(dependant: Dependant) -> bool:
    return dependant.request_param_name is not None and not any(
        getattr(dependant, name) for name in _OTHER_INPUTS
    )


STREAMED_OR_WHOLE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The answer: whole (`stream` false) or as server-sent events.",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}
"""The documented answer of a model route, whose `stream` field picks its content type."""


class DirectRoute(APIRoute):
    """An APIRoute whose endpoint takes the request and async dependencies on the request
    alone (`Depends(f)` with `async def f(request)`), called in order without FastAPI's
    dependency solving. Any other endpoint is refused when the route is made (TypeError)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint, dependant = self.endpoint, self.dependant
        dependencies: list[tuple[str, Callable[[Request], Awaitable[Any]]]] = []
        for dependency in dependant.dependencies:
            if (
                dependency.name is None
                or dependency.call is None
                or dependency.dependencies
                or not _takes_only_the_request(dependency)
                or not inspect.iscoroutinefunction(dependency.call)
            ):
                raise TypeError(
                    f"{self.path}: a DirectRoute's dependencies must be async functions of the "
                    f"request alone ({dependency.call!r} is not)"
                )
            dependencies.append((dependency.name, dependency.call))
        request_name = dependant.request_param_name
        if request_name is None or not _takes_only_the_request(dependant):
            raise TypeError(
                f"{self.path}: a DirectRoute's endpoint takes the request and dependencies only"
            )

        async def handler(request: Request) -> Response:
            values = {name: await call(request) for name, call in dependencies}
            response: Response = await endpoint(**{request_name: request}, **values)
            return response

        return handler
