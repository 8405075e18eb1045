"""`/dashboard`: the analysts' page, drawn in the browser from `/analytics/*` as SVG.

Sign-in is an analyst key, sent once (the login form, or `/dashboard?key=...` for scripts)
and then kept in an HttpOnly, SameSite=Strict cookie that the analytics API accepts. The
page, its script and its styles are files in `static/`, served from here: no CDN.
"""

from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from app.analytics.dependencies import ANALYTICS_ROLES, SESSION_COOKIE, analyst
from app.http.dependencies import principal_for
from app.http.errors import ApiError

router = APIRouter(tags=["dashboard"], include_in_schema=False)

STATIC_DIR = Path(__file__).parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
SESSION_SECONDS = 8 * 3600
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard(request: Request) -> Response:
    """The dashboard for an analyst; the sign-in form for anyone else."""
    key = request.query_params.get("key")
    if key is not None:
        return await _sign_in(request, key)
    try:
        await analyst(request)
    except ApiError as exc:
        if exc.status_code not in (401, 403):
            raise
        return _login_page(exc.message if request.cookies.get(SESSION_COOKIE) else "", 401)
    return HTMLResponse((STATIC_DIR / "dashboard.html").read_text(), headers=SECURITY_HEADERS)


@router.post("/dashboard/login")
async def login(request: Request) -> Response:
    """Sign in with the key from the form."""
    form = parse_qs((await request.body()).decode(errors="replace"), max_num_fields=5)
    return await _sign_in(request, (form.get("key") or [""])[0].strip())


@router.post("/dashboard/logout")
async def logout() -> Response:
    response = RedirectResponse("/dashboard", status_code=303, headers=SECURITY_HEADERS)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


@router.get("/dashboard/static/{asset}")
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
    response = RedirectResponse("/dashboard", status_code=303, headers=SECURITY_HEADERS)
    response.set_cookie(
        SESSION_COOKIE,
        key,
        max_age=SESSION_SECONDS,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


def _login_page(message: str, status_code: int) -> HTMLResponse:
    page = (STATIC_DIR / "login.html").read_text()
    return HTMLResponse(
        page.replace("{{message}}", html.escape(message)),
        status_code=status_code,
        headers=SECURITY_HEADERS,
    )
