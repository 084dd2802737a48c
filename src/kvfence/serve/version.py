"""What `GET /version` answers on every kvfence HTTP server: the installed package's version.

No key is needed, as on vLLM's /version: the version is what a client or a
deploy check compares before it relies on an API, and it names no tenant.
Read from the package metadata, so it is the version pip installed; a source
tree run without an install falls back to the package's own constant.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import kvfence

ENGINE = "kvfence"


def version_info() -> dict[str, Any]:
    try:
        version = metadata.version("kvfence")
    except metadata.PackageNotFoundError:
        version = kvfence.__version__
    return {"version": version, "engine": ENGINE}


async def version_response(_request: Request) -> Response:
    """The route's handler, shared by every kvfence app (create_app, the sglang stack's edge)."""
    return JSONResponse(version_info())
