"""The web page at `/` (off with `--no-ui`): three static files from the package (web/), no templating, so
nothing a request sends reaches the HTML. The page calls the same public API a client does; the API key, when
the server has one, is typed into the page and kept in the browser."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

WEB = Path(__file__).resolve().parent / "web"
# Scripts, styles, media and requests from the page's own origin only; the finished videos play from blob: URLs
# the page makes of what it downloaded (with the API key, a <video src> could not send it).
POLICY = ("default-src 'self'; media-src 'self' blob:; img-src 'self' blob: data:; object-src 'none'; "
          "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-cache"}


class PageFiles(StaticFiles):
    """The page's script and style, with the page's headers."""

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(HEADERS)
        return response


def add_page(app: FastAPI) -> None:
    async def index():
        return FileResponse(WEB / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.mount("/ui", PageFiles(directory=WEB), name="ui")
