"""Server-sent events, decoded one line at a time (the WHATWG event-stream rules).

The decoder is fed lines without their terminators, as ``httpx.Response.
aiter_lines`` gives them, and returns an event when a blank line ends one.
Comments (``:``) and unknown fields are skipped; several ``data:`` lines join
with ``\\n``. An event cut off by the end of the stream is never returned:
the caller sees that the stream ended early instead of half an event.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class SSEEvent:
    event: str
    data: str
    id: str | None = None


class SSEDecoder:
    def __init__(self) -> None:
        self._event = ""
        self._data: list[str] = []
        self._id: str | None = None

    def feed(self, line: str) -> SSEEvent | None:
        """Take one line; return the event it completes, if any."""
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._data:
            # A blank line after only "event:" lines dispatches nothing (per the spec).
            self._event = ""
            return None
        event = SSEEvent(event=self._event or "message", data="\n".join(self._data), id=self._id)
        self._event = ""
        self._data = []
        return event
