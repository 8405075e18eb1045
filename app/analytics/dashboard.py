"""`/dashboard`: the analysts' page, drawn in the browser from `/analytics/*` as SVG.

Sign-in is an analyst key, posted once by the login form and exchanged for a server-side
session (`app.auth.sessions`): the cookie holds a random session id, never the key, is
HttpOnly, SameSite=Strict and Secure (except on plain-HTTP loopback), expires, ends at
logout and with the key's revocation. Keys are never accepted in URLs. The page, its script
and its styles are files in `static/`, served from here: no CDN.
"""

from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from app.analytics.dependencies import ANALYTICS_ROLES, SESSION_COOKIE, analyst
from app.auth.service import hash_secret
from app.auth.sessions import SESSION_SECONDS
from app.http.dependencies import principal_for
from app.http.errors import ApiError
from app.http.state import app_state

router = APIRouter(tags=["dashboard"])

STATIC_DIR = Path(__file__).parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}

# What /openapi.json says of these routes: HTML pages, a form, redirects.
_PAGE = {"content": {"text/html": {"schema": {"type": "string"}}}}
_SIGN_IN_PAGE = _PAGE | {"description": "The sign-in form, with what went wrong"}
_REDIRECT = {"description": "To /dashboard (signed in: with the session cookie)"}
_SIGN_IN_FORM = {
    "requestBody": {
        "required": True,
        "content": {
            "application/x-www-form-urlencoded": {
                "schema": {
                    "type": "object",
                    "properties": {"key": {"type": "string", "description": "An analyst key"}},
                    "required": ["key"],
                }
            }
        },
    }
}
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@router.get(
    "/dashboard",
    response_class=HTMLResponse,
    responses={400: _SIGN_IN_PAGE, 401: _SIGN_IN_PAGE},
)
async def dashboard(request: Request) -> Response:
    """The dashboard for an analyst; the sign-in form for anyone else."""
    if "key" in request.query_params:
        # A key in a URL ends up in history, proxies and logs: sign in with the form.
        return _login_page("API keys are not accepted in URLs; sign in here.", 400)
    try:
        await analyst(request)
    except ApiError as exc:
        if exc.status_code not in (401, 403):
            raise
        return _login_page(exc.message if request.cookies.get(SESSION_COOKIE) else "", 401)
    return HTMLResponse((STATIC_DIR / "dashboard.html").read_text(), headers=SECURITY_HEADERS)


@router.post(
    "/dashboard/login",
    response_class=RedirectResponse,
    status_code=303,
    responses={303: _REDIRECT, 400: _SIGN_IN_PAGE, 401: _SIGN_IN_PAGE, 403: _SIGN_IN_PAGE},
    openapi_extra=_SIGN_IN_FORM,
)
async def login(request: Request) -> Response:
    """Sign in with the key from the form."""
    try:
        form = parse_qs((await request.body()).decode(errors="replace"), max_num_fields=5)
    except ValueError:  # more fields than the form has
        return _login_page("The sign-in form takes one field, key.", 400)
    return await _sign_in(request, (form.get("key") or [""])[0].strip())


@router.post(
    "/dashboard/logout",
    response_class=RedirectResponse,
    status_code=303,
    responses={303: _REDIRECT},
)
async def logout(request: Request) -> Response:
    session_id = request.cookies.get(SESSION_COOKIE)
    if session_id:
        await app_state(request.app).browser_sessions.close(session_id)
    response = RedirectResponse("/dashboard", status_code=303, headers=SECURITY_HEADERS)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


@router.get(
    "/dashboard/static/{asset}",
    response_class=FileResponse,
    responses={
        200: {"content": {media: {"schema": {"type": "string"}} for media in ASSETS.values()}}
    },
)
async def static_asset(asset: str) -> Response:
    """The dashboard's script and styles (a fixed list: nothing else on disk is reachable)."""
    if asset not in ASSETS:
        raise ApiError(404, "No such asset.", type="not_found_error", code="not_found")
    return FileResponse(
        STATIC_DIR / asset,
        media_type=ASSETS[asset],
        headers={"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"},
    )


async def _sign_in(request: Request, key: str) -> Response:
    if not key:
        return _login_page("Enter an analyst API key.", 401)
    try:
        principal = await principal_for(request, key)
    except ApiError as exc:
        return _login_page(exc.message, 401)
    if principal.role not in ANALYTICS_ROLES:
        return _login_page(
            f"This key has role {principal.role.value}; the dashboard needs analyst.", 403
        )
    sessions = app_state(request.app).browser_sessions
    session_id = await sessions.open(principal.key_id, hash_secret(key))
    response = RedirectResponse("/dashboard", status_code=303, headers=SECURITY_HEADERS)
    response.set_cookie(
        SESSION_COOKIE,
        session_id,
        max_age=SESSION_SECONDS,
        path="/",
        httponly=True,
        samesite="strict",
        secure=_secure_cookie(request),
    )
    return response


def _secure_cookie(request: Request) -> bool:
    """Secure unless the browser reached this gateway over plain HTTP on loopback."""
    settings = app_state(request.app).settings
    scheme = request.url.scheme
    if settings.trust_proxy_headers:
        scheme = request.headers.get("x-forwarded-proto", scheme).split(",")[0].strip()
    if scheme == "https":
        return True
    host = request.url.hostname or ""
    return host not in ("localhost", "127.0.0.1", "::1") and not host.startswith("127.")


def _login_page(message: str, status_code: int) -> HTMLResponse:
    page = (STATIC_DIR / "login.html").read_text()
    return HTMLResponse(
        page.replace("{{message}}", html.escape(message)),
        status_code=status_code,
        headers=SECURITY_HEADERS,
    )
