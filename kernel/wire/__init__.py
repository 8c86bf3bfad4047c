"""The WebSocket front door (floor 7): ``tak serve``'s server, its protocol, and a client.

Nothing below imports this package; it imports the kernel (``kernel.kernel``)
and everything under it. docs/protocol.md is the protocol; its modules:

- ``_frames``: the frames (requests, ``reply``, ``event``, ``error``) as
  records in tagged unions, with the protocol's converter;
- ``_codec``: frames to JSON text and back, and what a bad frame is told;
- ``_payloads``: each event kind's payload and each request's result;
- ``_admission``: the accept loop and its connection budgets;
- ``_handshake``: the HTTP handshake's checks (Host, Origin, token);
- ``_http``: plain HTTP on the same port: the browser page (files in
  ``kernel/web/``, docs/web.md);
- ``_connection``: one WebSocket's reader, writer, keep-alive and requests;
- ``_send``: several text messages in one write (the writer's and the client's);
- ``_handlers``: what the server does for each request type (``HANDLERS``);
- ``_server``: ``serve_websocket``, which puts them together;
- ``_client``: ``open_client``, the Trio client ``tak repl`` uses.

A new protocol message is one request record (``_frames``), one result
record (``_payloads``), one handler (``_handlers``) and its paragraph in
docs/protocol.md.

The names below load their modules on first use, so ``from kernel.wire import
open_client`` does not import the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Client": "_client",
    "ConnectionLost": "_client",
    "Exchange": "_client",
    "HandshakeRefused": "_client",
    "RequestFailed": "_client",
    "open_client": "_client",
    "serve_websocket": "_server",
    "ServerLimits": "_limits",
    "DEFAULT_PROJECT": "_frames",
    "ERROR_CODES": "_frames",
    "EVENT_KINDS": "_frames",
    "MAX_ID_LENGTH": "_frames",
    "PROTOCOL_VERSION": "_frames",
    "REQUEST_TYPES": "_frames",
    "CallTools": "_frames",
    "Cancel": "_frames",
    "ErrorCode": "_frames",
    "ErrorFrame": "_frames",
    "ErrorInfo": "_frames",
    "Event": "_frames",
    "EventKind": "_frames",
    "FrameError": "_frames",
    "Hello": "_frames",
    "History": "_frames",
    "Reply": "_frames",
    "Request": "_frames",
    "Run": "_frames",
    "ServerFrame": "_frames",
    "Sessions": "_frames",
    "Status": "_frames",
    "Tools": "_frames",
    "decode_request": "_codec",
    "decode_server_frame": "_codec",
    "encode": "_codec",
    "wire_converter": "_frames",
    "EVENT_CLASSES": "_payloads",
    "CallFinishedEvent": "_payloads",
    "CallStartedEvent": "_payloads",
    "CallToolsResult": "_payloads",
    "CancelResult": "_payloads",
    "EventData": "_payloads",
    "HistoryResult": "_payloads",
    "ModelDeltaEvent": "_payloads",
    "OtherEvent": "_payloads",
    "Result": "_payloads",
    "RunResult": "_payloads",
    "ServerInfo": "_payloads",
    "SessionsResult": "_payloads",
    "ToolsResult": "_payloads",
    "TurnFinishedEvent": "_payloads",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from ._client import Client as Client
    from ._client import ConnectionLost as ConnectionLost
    from ._client import Exchange as Exchange
    from ._client import HandshakeRefused as HandshakeRefused
    from ._client import RequestFailed as RequestFailed
    from ._client import open_client as open_client
    from ._codec import decode_request as decode_request
    from ._codec import decode_server_frame as decode_server_frame
    from ._codec import encode as encode
    from ._frames import DEFAULT_PROJECT as DEFAULT_PROJECT
    from ._frames import ERROR_CODES as ERROR_CODES
    from ._frames import EVENT_KINDS as EVENT_KINDS
    from ._frames import MAX_ID_LENGTH as MAX_ID_LENGTH
    from ._frames import PROTOCOL_VERSION as PROTOCOL_VERSION
    from ._frames import REQUEST_TYPES as REQUEST_TYPES
    from ._frames import CallTools as CallTools
    from ._frames import Cancel as Cancel
    from ._frames import ErrorCode as ErrorCode
    from ._frames import ErrorFrame as ErrorFrame
    from ._frames import ErrorInfo as ErrorInfo
    from ._frames import Event as Event
    from ._frames import EventKind as EventKind
    from ._frames import FrameError as FrameError
    from ._frames import Hello as Hello
    from ._frames import History as History
    from ._frames import Reply as Reply
    from ._frames import Request as Request
    from ._frames import Run as Run
    from ._frames import ServerFrame as ServerFrame
    from ._frames import Sessions as Sessions
    from ._frames import Status as Status
    from ._frames import Tools as Tools
    from ._frames import wire_converter as wire_converter
    from ._limits import ServerLimits as ServerLimits
    from ._payloads import EVENT_CLASSES as EVENT_CLASSES
    from ._payloads import CallFinishedEvent as CallFinishedEvent
    from ._payloads import CallStartedEvent as CallStartedEvent
    from ._payloads import CallToolsResult as CallToolsResult
    from ._payloads import CancelResult as CancelResult
    from ._payloads import EventData as EventData
    from ._payloads import HistoryResult as HistoryResult
    from ._payloads import ModelDeltaEvent as ModelDeltaEvent
    from ._payloads import OtherEvent as OtherEvent
    from ._payloads import Result as Result
    from ._payloads import RunResult as RunResult
    from ._payloads import ServerInfo as ServerInfo
    from ._payloads import SessionsResult as SessionsResult
    from ._payloads import ToolsResult as ToolsResult
    from ._payloads import TurnFinishedEvent as TurnFinishedEvent
    from ._server import serve_websocket as serve_websocket


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
