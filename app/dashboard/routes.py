"""The page (at `/` and `/ui`), its files (`/ui/<file>`, from the package's `static/` folder) and the push
stream (`/dashboard/events`, SSE). The page and its files need no API key (the page asks for it); the stream
needs it like the API does."""

from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sluice.app.dashboard.feed import Feed
from sluice.app.state import ServerState
from sluice.app.streaming import EventStreamResponse

EVENTS_PATH = "/dashboard/events"
PAGE_PATHS = ("/", "/ui", "/ui/")  # the folder's path too: a browser may add the slash
_MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}


def _static_files() -> dict[str, tuple[bytes, str]]:
    """`/ui/<relative path>` -> (content, media type) for every file under static/."""
    found: dict[str, tuple[bytes, str]] = {}
    pending = [("", files("sluice.app.dashboard") / "static")]
    while pending:
        prefix, folder = pending.pop()
        for entry in folder.iterdir():
            if entry.is_dir():
                pending.append((f"{prefix}{entry.name}/", entry))
            else:
                suffix = entry.name[entry.name.rfind("."):] if "." in entry.name else ""
                found[f"/ui/{prefix}{entry.name}"] = (entry.read_bytes(), _MEDIA_TYPES.get(suffix, "text/plain"))
    return found


STATIC_FILES = _static_files()
OPEN_PATHS = frozenset(PAGE_PATHS) | frozenset(STATIC_FILES)


async def _page(request: Request) -> Response:
    content, media_type = STATIC_FILES["/ui/index.html"]
    return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})


async def _static(request: Request) -> Response:
    content, media_type = STATIC_FILES[request.url.path]
    return Response(content, media_type=media_type, headers={"Cache-Control": "no-cache"})


async def _events(request: Request) -> Response:
    feed: Feed = request.app.state.feed
    state: ServerState = request.app.state.sluice
    # A tab that stops reading (a suspended laptop) is let go as an API stream's reader is: its stream skips the
    # ticks it cannot take, so its memory stays bounded, but its task and connection would stay for ever.
    return EventStreamResponse(feed.events(), on_close=_nothing, keepalive_s=state.settings.sse_keepalive_s,
                               stall_timeout_s=state.settings.stream_stall_timeout_s or None)


async def _nothing() -> None:
    return None


def ui_routes() -> list[Route]:
    return ([Route(path, _page, methods=["GET"]) for path in PAGE_PATHS]
            + [Route(path, _static, methods=["GET"]) for path in STATIC_FILES]
            + [Route(EVENTS_PATH, _events, methods=["GET"])])
