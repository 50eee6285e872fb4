"""The page's files, and the page as one self-contained HTML file with its data embedded.

The service serves ``static/ui.html`` as it is: it links ``ui/ui.css`` and ``ui/ui.js`` and
reads the service's JSON. ``render_page`` inlines both files and embeds a ``data.book`` per
model as JSON, so the same script draws the same pictures from a file opened without any
server (``vbs show --html``): nothing is fetched, the page works offline.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from core.errors import UsageError

ASSETS = {"ui.html": "text/html; charset=utf-8", "ui.js": "text/javascript; charset=utf-8",
          "ui.css": "text/css; charset=utf-8"}
_CSS_LINK = '<link rel="stylesheet" href="ui/ui.css">'
_JS_TAG = '<script src="ui/ui.js" defer></script>'
_DATA_MARK = "<!-- vbs:data -->"


def asset(name: str) -> bytes:
    """The bytes of one of the page's files (``ASSETS``)."""
    if name not in ASSETS:
        raise UsageError(f"the page has no file {name!r}; it has {', '.join(sorted(ASSETS))}")
    return (resources.files("planner.view") / "static" / name).read_bytes()


def _script_json(data: Any) -> str:
    """JSON safe inside a <script> element: no '<' can close it or open a comment."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def render_page(books: list[dict[str, Any]], title: str = "vbs-serve plans") -> str:
    """The page with its CSS, script and ``books`` (``planner.view.data.book``) inlined."""
    html = asset("ui.html").decode()
    for mark in (_CSS_LINK, _JS_TAG, _DATA_MARK):
        if mark not in html:
            raise AssertionError(f"static/ui.html lost its {mark!r}; the static page needs it")
    css = asset("ui.css").decode()
    js = asset("ui.js").decode().replace("</script", "<\\/script")
    data = {"schema": "vbs.view/1", "title": title, "books": books}
    html = html.replace("<title>vbs-serve</title>", f"<title>{_escape(title)}</title>")
    html = html.replace(_CSS_LINK, f"<style>\n{css}</style>")
    html = html.replace(_DATA_MARK, '<script type="application/json" id="vbs-data">'
                        f"{_script_json(data)}</script>")
    return html.replace(_JS_TAG, f"<script>\n{js}</script>")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
