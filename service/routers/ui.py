"""``GET /ui``: the page that shows each model's plans, memory and traffic (open, no API key:
it holds no data; what it reads from the JSON endpoints asks for the key when one is set).

The files live in ``planner/view/static`` (shared with ``vbs show --html``) and are read once.
``GET /`` sends a browser to the page; ``GET /favicon.ico`` is its icon (``service.favicon``),
which the page served here links.
"""

from __future__ import annotations

from functools import cache

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response

from planner.view.page import ASSETS, asset
from service import favicon
from service.errors import AssetNotFoundError
from service.claims import of as claims_of

router = APIRouter(tags=["ui"])
_SERVED = ("ui.js", "ui.css")
_ICON_LINK = b'<link rel="icon" href="favicon.ico" sizes="16x16 32x32 48x48">\n'


@cache
def _file(name: str) -> bytes:
    return asset(name)


@cache
def _page() -> bytes:
    """The page, linking the icon (relative, as its other files: it works under a prefix)."""
    return _file("ui.html").replace(b"</head>", _ICON_LINK + b"</head>", 1)


@router.get("/", summary="Redirect to the page", response_class=RedirectResponse,
            status_code=307)
async def get_root(request: Request) -> RedirectResponse:
    claims_of(request.state).endpoint = "other"
    return RedirectResponse("ui", status_code=307)


@router.get("/ui", summary="The page: plans, memory and live traffic of every model",
            response_class=Response, responses={200: {"content": {"text/html": {}}}})
async def get_ui(request: Request) -> Response:
    claims_of(request.state).endpoint = "other"
    return Response(_page(), media_type=ASSETS["ui.html"], headers={"Cache-Control": "no-cache"})


@router.get("/favicon.ico", summary="The page's icon", response_class=Response,
            responses={200: {"content": {favicon.MEDIA_TYPE: {}}}})
async def get_favicon(request: Request) -> Response:
    claims_of(request.state).endpoint = "other"
    return Response(favicon.icon(), media_type=favicon.MEDIA_TYPE,
                    headers={"Cache-Control": "public, max-age=86400"})


@router.get("/ui/{asset_name}", summary="The page's script and style sheet",
            response_class=Response, responses={404: {"description": "no such file"}})
async def get_asset(asset_name: str, request: Request) -> Response:
    claims_of(request.state).endpoint = "other"
    if asset_name not in _SERVED:
        raise AssetNotFoundError(f"asset_name: the page has no file {asset_name!r}; it has "
                                 f"{', '.join(_SERVED)}")
    return Response(_file(asset_name), media_type=ASSETS[asset_name], headers={"Cache-Control": "no-cache"})
