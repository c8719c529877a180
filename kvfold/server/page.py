"""GET /: the chat page (kvfold/server/web/chat.html), one static HTML file with its CSS and JS
inline. It uses this server's own /v1 API like any client (the API key, when one is set, is asked
for on the page and sent by it), so the page itself is served without one. `kvfold serve
--no-web-page` (create_app's `web_page=False`) leaves it out: then / is a 404 like any unknown path.

The response's Content-Security-Policy allows only that inline script and style (by their
hashes) and requests to this origin: the page can load nothing from the network, and text it
shows (the model's output included) can never run as script.
"""
from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE_PATH = "/"


@lru_cache(maxsize=1)
def page() -> tuple[str, dict[str, str]]:
    """The page's HTML and the headers it is served with."""
    html = resources.files(__package__).joinpath("web/chat.html").read_text(encoding="utf-8")

    def hashes(tag: str) -> str:
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, flags=re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                        for b in bodies)
    csp = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
           "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    headers = {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
               "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
    return html, headers


async def chat_page() -> HTMLResponse:
    html, headers = page()
    return HTMLResponse(html, headers=headers)


def add_chat_page(app: FastAPI) -> None:
    """Serve the chat page at / (left out of the OpenAPI document: it is no API)."""
    app.add_api_route(PAGE_PATH, chat_page, methods=["GET"], include_in_schema=False)
