"""Moved to ``kernel.wire`` (``kernel/wire/_frames.py``, ``_codec.py``); this path keeps working."""

from __future__ import annotations

from .wire._codec import decode_request as decode_request
from .wire._codec import decode_server_frame as decode_server_frame
from .wire._codec import encode as encode
from .wire._frames import DEFAULT_PROJECT as DEFAULT_PROJECT
from .wire._frames import ERROR_CODES as ERROR_CODES
from .wire._frames import EVENT_KINDS as EVENT_KINDS
from .wire._frames import MAX_ID_LENGTH as MAX_ID_LENGTH
from .wire._frames import PROTOCOL_VERSION as PROTOCOL_VERSION
from .wire._frames import REQUEST_TYPES as REQUEST_TYPES
from .wire._frames import CallTools as CallTools
from .wire._frames import Cancel as Cancel
from .wire._frames import ErrorCode as ErrorCode
from .wire._frames import ErrorFrame as ErrorFrame
from .wire._frames import ErrorInfo as ErrorInfo
from .wire._frames import Event as Event
from .wire._frames import EventKind as EventKind
from .wire._frames import FrameError as FrameError
from .wire._frames import Hello as Hello
from .wire._frames import History as History
from .wire._frames import Reply as Reply
from .wire._frames import Request as Request
from .wire._frames import Run as Run
from .wire._frames import ServerFrame as ServerFrame
from .wire._frames import Sessions as Sessions
from .wire._frames import Status as Status
from .wire._frames import Tools as Tools

__all__ = [
    "DEFAULT_PROJECT",
    "ERROR_CODES",
    "EVENT_KINDS",
    "MAX_ID_LENGTH",
    "PROTOCOL_VERSION",
    "REQUEST_TYPES",
    "CallTools",
    "Cancel",
    "ErrorCode",
    "ErrorFrame",
    "ErrorInfo",
    "Event",
    "EventKind",
    "FrameError",
    "Hello",
    "History",
    "Reply",
    "Request",
    "Run",
    "ServerFrame",
    "Sessions",
    "Status",
    "Tools",
    "decode_request",
    "decode_server_frame",
    "encode",
]
