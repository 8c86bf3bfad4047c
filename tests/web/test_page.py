"""The page of ``tak serve`` in a real Chromium: loading, the token, a turn's parallel calls,
cancelling, a persisted transcript, the Origin check (docs/web.md)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from kernel.wire import open_client

from .web_kit import SCREENSHOT_ENV, Server, screenshot, start_server

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

#: How long a browser-side wait may take before the test fails (ms): generous, never reached.
WAIT_MS = 15_000

FOUR_CALLS = "\n".join(
    [
        '/call sleep {"seconds": 0.3}',
        '/call add {"a": 2, "b": 40}',
        '/call divide {"a": 1, "b": 0}',
        '/call echo {"text": "<b>not bold</b>"}',
    ]
)


def open_page(page: Page, server: Server) -> None:
    response = page.goto(server.page_url)
    assert response is not None and response.status == 200
    page.locator("#connection[data-state=open]").wait_for(timeout=WAIT_MS)


def run_prompt(page: Page, session: str, prompt: str) -> None:
    page.fill("#session-id", session)
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")


def rows(page: Page) -> list[tuple[str, str, str]]:
    """``(index, tool, status)`` of the live turn's call rows, top to bottom."""
    return [
        (
            row.get_attribute("data-index") or "",
            row.locator(".call-name").inner_text(),
            row.get_attribute("data-status") or "",
        )
        for row in page.locator(".turn tr.call").all()
    ]


def test_a_good_token_loads_the_page_and_leaves_the_address_bar(
    page: Page, server: Server, tmp_path: Path
) -> None:
    response = page.goto(server.page_url)
    assert response is not None and response.status == 200
    headers = response.headers
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "'unsafe-inline'" not in headers["content-security-policy"]
    assert headers["referrer-policy"] == "no-referrer"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["cache-control"] == "no-store"
    page.locator("#connection[data-state=open]").wait_for(timeout=WAIT_MS)
    assert page.locator("#server-model").inner_text() == "scripted:demo"
    assert "token" not in page.url  # taken out of the address bar
    assert page.evaluate("document.cookie") == ""
    assert page.evaluate("localStorage.length + sessionStorage.length") == 0
    # The tools with their schemas.
    page.click(".panel summary")
    add = page.locator("li.tool[data-tool=add]")
    add.locator("summary").click()
    assert json.loads(add.locator("pre.schema").inner_text())["required"] == ["a", "b"]
    screenshot(page, tmp_path, "loaded")


@pytest.mark.parametrize("query", ["?token=wrong", ""])
def test_a_bad_or_missing_token_is_refused(page: Page, server: Server, query: str) -> None:
    response = page.goto(f"{server.origin}/{query}")
    assert response is not None and response.status == 401
    assert page.locator("#prompt").count() == 0  # the page was not served


def test_a_turn_shows_four_parallel_calls_in_declared_order(
    page: Page, server: Server, tmp_path: Path
) -> None:
    open_page(page, server)
    run_prompt(page, "four-calls", FOUR_CALLS)
    page.locator(".turn[data-state=final]").wait_for(timeout=WAIT_MS)
    assert rows(page) == [
        ("0", "sleep", "ok"),
        ("1", "add", "ok"),
        ("2", "divide", "error"),
        ("3", "echo", "ok"),
    ]
    failed = page.locator(".turn tr.call[data-index='2']")
    assert failed.locator(".call-status").inner_text() == "exception"
    assert "float division by zero" in failed.locator(".call-output summary").inner_text()
    for row in page.locator(".turn tr.call").all():
        assert row.locator(".call-duration").inner_text().endswith(("ms", " s"))
    # Text from tools is text: the echo's markup is shown, not interpreted.
    assert page.locator(".turn b").count() == 0
    assert "You said" not in page.locator(".turn").inner_text()
    assert "Calling 4 tool(s)." in page.locator(".turn .streamed").first.inner_text()
    assert page.locator(".turn .turn-status").inner_text() == "final"
    # The session is listed, with its numbers.
    item = page.locator("li.session[data-session=four-calls]")
    item.wait_for(timeout=WAIT_MS)
    assert "entries" in item.inner_text()
    screenshot(page, tmp_path, "four-calls")


def test_calls_run_side_by_side_and_escape_cancels_the_turn(
    page: Page, server: Server, tmp_path: Path
) -> None:
    open_page(page, server)
    prompt = FOUR_CALLS.replace('"seconds": 0.3', '"seconds": 60')
    run_prompt(page, "side-by-side", prompt)
    page.locator(".turn tr.call[data-index='3'][data-status=ok]").wait_for(timeout=WAIT_MS)
    # The sleeping call still runs while the ones declared after it are done.
    assert rows(page) == [
        ("0", "sleep", "running"),
        ("1", "add", "ok"),
        ("2", "divide", "error"),
        ("3", "echo", "ok"),
    ]
    assert page.locator(".turn tr.call[data-index='0'] .spinner").is_visible()
    if target := os.environ.get(SCREENSHOT_ENV):
        page.screenshot(path=target)
    screenshot(page, tmp_path, "running")
    page.keyboard.press("Escape")
    page.locator(".turn[data-state=cancelled]").wait_for(timeout=WAIT_MS)
    assert rows(page)[0] == ("0", "sleep", "cancelled")
    screenshot(page, tmp_path, "cancelled")


def test_the_cancel_button_of_the_turn_cancels_it(page: Page, server: Server) -> None:
    open_page(page, server)
    run_prompt(page, "cancel-turn", '/call sleep {"seconds": 60}')
    page.locator(".turn tr.call[data-status=running]").wait_for(timeout=WAIT_MS)
    page.click("#cancel-turn")
    page.locator(".turn[data-state=cancelled]").wait_for(timeout=WAIT_MS)
    assert rows(page) == [("0", "sleep", "cancelled")]
    assert page.locator("#run").is_enabled()


def test_a_call_is_cancelled_from_its_button_and_the_batch_goes_on(
    page: Page, server: Server, tmp_path: Path
) -> None:
    open_page(page, server)
    prompt = '/call sleep {"seconds": 60}\n/call sleep {"seconds": 0.5}'
    run_prompt(page, "cancel-one", prompt)
    page.locator(".turn tr.call[data-index='1']").wait_for(timeout=WAIT_MS)
    page.click(".turn tr.call[data-index='0'] .call-cancel")
    try:
        page.locator(".turn[data-state=final]").wait_for(timeout=3000)
        assert rows(page) == [("0", "sleep", "cancelled"), ("1", "sleep", "ok")]
    finally:
        screenshot(page, tmp_path, "cancel-one")
        page.keyboard.press("Escape")
        page.locator(".turn[data-state=cancelled], .turn[data-state=final]").wait_for()


def test_a_persisted_sessions_transcript_renders(
    page: Page, server: Server, tmp_path: Path
) -> None:
    async def record() -> None:
        async with open_client(server.ws_url) as client:
            await client.run("older", "hello")
            await trio.sleep(0.01)  # modification times are in milliseconds
            await client.run(
                "persisted", '/call divide {"a": 1, "b": 0}\n/call add {"a": 1, "b": 1}'
            )

    trio.run(record)
    open_page(page, server)
    page.locator("li.session[data-session=older]").wait_for(timeout=WAIT_MS)
    listed = [
        s
        for s in page.locator("li.session").evaluate_all(
            "(items) => items.map(i => i.dataset.session)"
        )
        if s in ("older", "persisted")
    ]
    assert listed == ["persisted", "older"]  # newest first
    page.click("li.session[data-session=persisted] button")
    page.locator("#transcript[data-session=persisted]").wait_for(timeout=WAIT_MS)
    transcript = page.locator("#transcript")
    assert transcript.locator(".entry.user").first.inner_text().startswith("you")
    calls = transcript.locator(".tool-call")
    assert calls.count() == 2
    assert json.loads(calls.first.locator("pre.arguments").inner_text()) == {"a": 1, "b": 0}
    failed = transcript.locator(".observation.is-error")
    assert failed.count() == 1
    assert failed.get_attribute("data-kind") == "exception"
    assert "float division by zero" in failed.inner_text()
    assert "2 call(s) finished" in transcript.locator(".entry.assistant").last.inner_text()
    screenshot(page, tmp_path, "transcript")


def test_the_runs_model_and_settings_go_into_the_request(page: Page, server: Server) -> None:
    open_page(page, server)
    page.click(".run-settings summary")
    page.fill("#temperature", "7")
    run_prompt(page, "settings", "hello")
    failed = page.locator(".turn[data-state=failed]")
    failed.wait_for(timeout=WAIT_MS)
    assert "invalid_request: $.settings.temperature: expected a number from 0 to 2, got 7" in (
        failed.inner_text()
    )
    page.fill("#temperature", "0.2")
    page.fill("#max_tokens", "64")
    page.fill("#run-tools", "search*")
    run_prompt(page, "settings", "hello")
    refused = page.locator(".turn[data-state=failed]", has_text="no tool matches 'search*'")
    refused.wait_for(timeout=WAIT_MS)
    page.fill("#run-tools", "add, divide")
    page.fill("#model", "nonsense:model")
    run_prompt(page, "settings", "hello")
    page.locator(".turn[data-state=failed]", has_text="$.model:").wait_for(timeout=WAIT_MS)
    page.fill("#model", "scripted:demo")
    run_prompt(page, "settings", "hello")
    page.locator(".turn[data-state=final]", has_text="You said: hello").wait_for(timeout=WAIT_MS)


def _entry(kind: str, uuid: str, **fields: object) -> str:
    return json.dumps(
        {"type": kind, "uuid": uuid, "timestamp": "2026-01-02T03:04:05.000Z", **fields}
    )


def _text(role: str, text: str) -> dict[str, object]:
    return {"role": role, "parts": [{"type": "text", "text": text}]}


def test_compaction_markers_and_damaged_sessions_show(
    page: Page, server: Server, tmp_path: Path
) -> None:
    sessions = server.home / "data" / "sessions" / "default"
    (sessions / "compacted").mkdir(parents=True)
    (sessions / "compacted" / "transcript.jsonl").write_text(
        "\n".join(
            [
                _entry("user", "u1", message=_text("user", "first question")),
                _entry("assistant", "a1", message=_text("assistant", "first answer")),
                _entry(
                    "compaction",
                    "c1",
                    summary="The user asked a first question.",
                    through="a1",
                    usage={"input_tokens": 10, "output_tokens": 5},
                    model="scripted:demo",
                ),
                _entry("user", "u2", message=_text("user", "second question")),
            ]
        )
        + "\n"
    )
    (sessions / "damaged").mkdir(parents=True)
    (sessions / "damaged" / "transcript.jsonl").write_text(
        _entry("user", "u1", message=_text("user", "hi"))
        + "\n{not json\n"
        + _entry("title", "t", title="x")
        + "\n"
    )
    open_page(page, server)
    damaged = page.locator("li.session[data-session=damaged]")
    damaged.wait_for(timeout=WAIT_MS)
    assert damaged.locator(".damaged-badge").inner_text() == "damaged"
    assert "quarantines" in (damaged.locator("button").get_attribute("title") or "")
    page.click("li.session[data-session=compacted] button")
    page.locator("#transcript[data-session=compacted]").wait_for(timeout=WAIT_MS)
    marker = page.locator("#transcript .entry.compaction")
    assert marker.count() == 1
    marker.locator("summary").click()
    assert "The user asked a first question." in marker.inner_text()
    texts = page.locator("#transcript .entry .text").all_inner_texts()
    assert texts == [
        "first question",
        "first answer",
        "The user asked a first question.",
        "second question",
    ]
    screenshot(page, tmp_path, "compaction")


def test_only_the_servers_own_origin_may_open_the_websocket(page: Page, server: Server) -> None:
    """A page of another origin, in the same browser, is refused by the Origin check."""
    other = f"http://127.0.0.1:{_free_port()}/"
    page.route(
        other,
        lambda route: route.fulfill(
            body="<!doctype html><title>other</title>", content_type="text/html"
        ),
    )
    page.goto(other)
    probe = """(url) => new Promise((resolve) => {
        const ws = new WebSocket(url);
        ws.onopen = () => { ws.close(); resolve("open"); };
        ws.onerror = () => resolve("refused");
    })"""
    assert page.evaluate(probe, server.ws_url) == "refused"
    open_page(page, server)
    assert page.evaluate(probe, server.ws_url) == "open"


def test_the_websocket_handshake_refuses_a_foreign_origin(server: Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(
            (
                f"GET /?token={server.token} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
                "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                "Origin: http://evil.example\r\n\r\n"
            ).encode()
        )
        assert conn.recv(4096).startswith(b"HTTP/1.1 403 ")


def test_phone_width_and_dark_mode(browser: object, server: Server, tmp_path: Path) -> None:
    from playwright.sync_api import Browser

    assert isinstance(browser, Browser)
    context = browser.new_context(viewport={"width": 390, "height": 800}, color_scheme="dark")
    page = context.new_page()
    try:
        open_page(page, server)
        run_prompt(page, "phone", FOUR_CALLS)
        page.locator(".turn[data-state=final]").wait_for(timeout=WAIT_MS)
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(21, 23, 26)"
        screenshot(page, tmp_path, "phone-dark")
    finally:
        context.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_page_reconnects_by_itself_after_the_server_restarts(
    page: Page, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    first = start_server(tmp_path / "home", "--token-file", str(token_file))
    try:
        open_page(page, first)
        run_prompt(page, "before", "hello")
        page.locator(".turn[data-state=final]").wait_for(timeout=WAIT_MS)
    finally:
        first.stop()
    page.locator("#connection[data-state=retrying]").wait_for(timeout=WAIT_MS)
    again = start_server(
        tmp_path / "home", "--token-file", str(token_file), "--port", str(first.port)
    )
    try:
        page.locator("#connection[data-state=open]").wait_for(timeout=WAIT_MS)
        run_prompt(page, "after", "hello again")
        finished = page.locator(".turn[data-state=final]", has_text="You said: hello again")
        finished.wait_for(timeout=WAIT_MS)
        page.locator("li.session[data-session=after]").wait_for(timeout=WAIT_MS)
        screenshot(page, tmp_path, "reconnected")
    finally:
        again.stop()


# -- hostile data: a prompt-injected model, tool output, a session file, a broken server --


#: Markup and URLs that must arrive as text; each would set window.__pwned if it ran.
XSS = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'


LINK = "javascript:window.__pwned=3"


BIDI = "safe\u202etxt.exe"


def _no_markup_ran(page: Page) -> None:
    assert page.evaluate("window.__pwned") is None
    found = page.evaluate(
        """() => [...document.querySelectorAll(
            '#transcript img, #transcript script, #transcript a, #transcript iframe,'
            + '#sessions img, #sessions script, #sessions a, #tools img, #tools script,'
            + '#notice img, #notice script')].map(e => e.outerHTML)"""
    )
    assert found == []


def test_hostile_tool_names_arguments_output_and_model_text_stay_text(
    page: Page, server: Server
) -> None:
    open_page(page, server)
    prompt = "\n".join(
        [
            "/call <img/src=x/onerror=window.__pwned=4> {}",
            '/call echo {"text": ' + json.dumps(XSS + LINK + BIDI + "x" * 100_000) + "}",
            "/call add " + json.dumps({XSS: LINK}),
            f"/call divide not-json {XSS}",
        ]
    )
    page.fill("#session-id", "hostile")
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    turn = page.locator(".turn[data-state=final]")
    turn.wait_for(timeout=WAIT_MS)
    text = turn.inner_text()
    assert "<img/src=x/onerror=window.__pwned=4>" in text  # the unknown tool's name, as text
    assert "<script>window.__pwned=2</script>" in page.locator(".turn tr.call").nth(1).inner_text()
    _no_markup_ran(page)
    # An error message that quotes what it refuses.
    page.click(".run-settings summary")
    page.fill("#model", XSS)
    page.fill("#prompt", "hello")
    page.press("#prompt", "Enter")
    page.locator(".turn[data-state=failed]", has_text="$.model").wait_for(timeout=WAIT_MS)
    page.fill("#model", "")
    _no_markup_ran(page)
    # The same entries, persisted and drawn again from history; a hostile title too.
    sessions = server.home / "data" / "sessions" / "default"
    recorded = (sessions / "hostile" / "transcript.jsonl").read_text()
    (sessions / "hostile-copy").mkdir()
    (sessions / "hostile-copy" / "transcript.jsonl").write_text(
        recorded
        + _entry("title", "t-hostile", title=XSS + LINK)
        + "\n"
        + _entry(
            "compaction",
            "c-hostile",
            summary=XSS,
            through="t-hostile",
            usage={"input_tokens": 1, "output_tokens": 1},
            model=XSS,
        )
        + "\n"
    )
    open_page(page, server)
    item = page.locator("li.session[data-session=hostile-copy]")
    item.wait_for(timeout=WAIT_MS)
    assert item.locator(".session-title").inner_text() == XSS + LINK
    item.locator("button").click()
    page.locator("#transcript[data-session=hostile-copy]").wait_for(timeout=WAIT_MS)
    assert page.locator("#transcript .tool-call").count() == 4
    assert "<script>window.__pwned=2</script>" in page.locator("#transcript").inner_text()
    _no_markup_ran(page)


def _own_page(browser: Browser) -> tuple[Any, Page, list[str]]:
    """A context and page of our own, collecting page errors (the fixture fails on them)."""
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    return context, page, errors


def test_the_content_security_policy_blocks_injected_inline_script(
    browser: Browser, server: Server
) -> None:
    context, page, _ = _own_page(browser)
    try:
        open_page(page, server)
        blocked = page.evaluate(
            """() => new Promise((resolve) => {
                const seen = [];
                document.addEventListener('securitypolicyviolation',
                    (e) => seen.push(e.violatedDirective));
                const s = document.createElement('script');
                s.textContent = 'window.__pwned = 5';
                document.body.append(s);
                const d = document.createElement('div');
                d.innerHTML = '<img src="data:," onerror="window.__pwned = 6">';
                document.body.append(d);
                const a = document.createElement('a');
                a.href = 'javascript:window.__pwned = 7';
                document.body.append(a);
                a.click();
                setTimeout(() => resolve(seen), 300);
            })"""
        )
        assert page.evaluate("window.__pwned") is None
        assert any(d.startswith("script-src") for d in blocked), blocked
    finally:
        context.close()


def test_the_token_leaves_no_trace_in_the_page_its_requests_or_the_servers_log(
    browser: Browser, server: Server
) -> None:
    context, page, _ = _own_page(browser)
    sent: list[dict[str, str]] = []
    page.on("request", lambda request: sent.append(request.headers))
    try:
        open_page(page, server)
        page.fill("#session-id", "trace")
        page.fill("#prompt", "hello")
        page.press("#prompt", "Enter")
        page.locator(".turn[data-state=final]").wait_for(timeout=WAIT_MS)
        assert server.token not in page.url
        assert server.token not in page.content()
        assert server.token not in page.evaluate("document.documentElement.outerHTML")
        assert page.evaluate("document.cookie") == ""
        assert page.evaluate("localStorage.length + sessionStorage.length") == 0
        assert len(sent) >= 5  # the page, its modules and style sheet
        for headers in sent[1:]:
            assert not headers.get("referer"), headers
            assert all(server.token not in value for value in headers.values())
        # Back to the page's entry in history: no token there either.
        page.goto("about:blank")
        page.go_back()
        assert server.token not in page.url
    finally:
        context.close()
    assert server.token not in (server.home / "serve.log").read_text()


def test_malformed_frames_from_the_server_do_not_throw_in_the_page(
    browser: Browser, server: Server
) -> None:
    from playwright.sync_api import WebSocketRoute

    context, page, errors = _own_page(browser)

    def fake_server(ws: WebSocketRoute) -> None:
        def on_message(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame.get("type") == "hello":
                ws.send("null")
                ws.send("[1, 2]")
                ws.send(json.dumps({"type": "error", "re": frame["id"]}))
                ws.close()

        ws.on_message(on_message)

    try:
        page.route_web_socket(f"ws://127.0.0.1:{server.port}/", fake_server)
        response = page.goto(server.page_url)
        assert response is not None and response.status == 200
        page.locator("#connection[data-state=retrying]").wait_for(timeout=WAIT_MS)
        assert errors == []
    finally:
        context.close()


def test_malformed_replies_and_events_do_not_throw_in_the_page(
    browser: Browser, server: Server
) -> None:
    """Replies without their result and events without their fields, from a broken server."""
    from playwright.sync_api import WebSocketRoute

    context, page, errors = _own_page(browser)

    def fake_server(ws: WebSocketRoute) -> None:
        def reply(frame: dict[str, Any], result: object) -> None:
            ws.send(
                json.dumps({"type": "reply", "re": frame["id"], "status": "ok", "result": result})
            )

        def on_message(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame.get("type") == "hello":
                reply(frame, {"model": None, "protocol": 1})
            elif frame.get("type") == "sessions":
                reply(frame, {"sessions": [None, 3, {"session_id": 7, "data": None}]})
            elif frame.get("type") == "tools":
                reply(frame, None)
            elif frame.get("type") == "history":
                reply(frame, {"entries": [None, {"type": "assistant", "message": 3}]})
            elif frame.get("type") == "run":
                for event in [
                    {"kind": "model_delta", "step": 1, "text": None},
                    {"kind": "call_started", "index": 0},
                    {"kind": "call_started", "index": 1, "call": {"id": None, "name": 5}},
                    {"kind": "call_finished", "index": 0, "observation": None},
                    {"kind": "call_finished", "index": 1, "observation": {"error": 3}},
                    {"kind": "turn_finished", "reason": None, "error": "x"},
                    None,
                ]:
                    ws.send(json.dumps({"type": "event", "re": frame["id"], **(event or {})}))
                reply(frame, None)

        ws.on_message(on_message)

    try:
        page.route_web_socket(f"ws://127.0.0.1:{server.port}/", fake_server)
        response = page.goto(server.page_url)
        assert response is not None and response.status == 200
        page.locator("#connection[data-state=open]").wait_for(timeout=WAIT_MS)
        page.fill("#session-id", "broken")
        page.fill("#prompt", "hello")
        page.press("#prompt", "Enter")
        page.locator("body[data-running=no] .turn").wait_for(timeout=WAIT_MS)
        page.wait_for_timeout(300)  # what the last frames set off
        assert errors == []
    finally:
        context.close()


#: Unicode's explicit direction controls: each reorders the text after it when shown raw.
BIDI_CONTROLS = "/[\\u202a-\\u202e\\u2066-\\u2069]/"


def test_bidi_controls_in_a_calls_name_arguments_and_output_are_shown_not_obeyed(
    page: Page, server: Server
) -> None:
    # A prompt-injected model can make `rm -rf ~/work` read as something harmless in the
    # row the operator watches ("Trojan Source"); the row should show the control itself.
    open_page(page, server)
    page.fill("#session-id", "bidi")
    page.fill(
        "#prompt",
        '/call echo {"text": "keep \u202e~/krow/ fr- mr"}\n/call ech\u202eo {}',
    )
    page.press("#prompt", "Enter")
    page.locator(".turn[data-state=final]").wait_for(timeout=WAIT_MS)
    shown = page.evaluate(
        f"""() => [...document.querySelectorAll('.turn tr.call')]
            .map(row => row.querySelector('.call-name').textContent
                 + ' ' + row.querySelector('.call-args').textContent)
            .filter(text => {BIDI_CONTROLS}.test(text))"""
    )
    assert shown == []
    assert "ech\\u202eo" in page.locator(".turn tr.call").nth(1).inner_text()
    # Nowhere else either: the prompt, the output, the model's text; nor drawn from history.
    raw = f"() => {BIDI_CONTROLS}.test(document.body.textContent)"
    assert page.evaluate(raw) is False
    open_page(page, server)
    page.locator("li.session[data-session=bidi] button").click()
    page.locator("#transcript[data-session=bidi] .tool-call").first.wait_for(timeout=WAIT_MS)
    assert "keep \\u202e~/krow/" in page.locator("#transcript").inner_text()
    assert page.evaluate(raw) is False


def test_a_server_that_drops_the_page_after_hello_is_not_hammered(
    browser: Browser, server: Server
) -> None:
    """E.g. a request that hits a bug closes the connection with 1011, again after each hello."""
    from playwright.sync_api import WebSocketRoute

    context, page, _ = _own_page(browser)
    hellos: list[str] = []

    def fake_server(ws: WebSocketRoute) -> None:
        def on_message(message: str | bytes) -> None:
            frame = json.loads(message)
            if frame.get("type") == "hello":
                hellos.append(frame["id"])
                result = {"model": "scripted:demo", "protocol": 1}
                ws.send(
                    json.dumps(
                        {"type": "reply", "re": frame["id"], "status": "ok", "result": result}
                    )
                )
            else:
                ws.close(code=1011, reason="internal error")

        ws.on_message(on_message)

    try:
        page.route_web_socket(f"ws://127.0.0.1:{server.port}/", fake_server)
        page.add_init_script(
            """new MutationObserver(() => {
                const badge = document.getElementById('connection');
                if (badge && badge.dataset.state === 'retrying')
                    (window.__retries ??= []).push(badge.textContent);
            }).observe(document, {subtree: true, childList: true, characterData: true,
                                   attributes: true})"""
        )
        response = page.goto(server.page_url)
        assert response is not None and response.status == 200
        page.wait_for_function("() => (window.__retries ?? []).length >= 4", timeout=WAIT_MS)
        retries = page.evaluate("window.__retries")
        assert len(hellos) >= 4  # each reconnection was accepted, then dropped
        # A backoff: the fourth pause is longer than the first.
        assert retries[3] != retries[0], retries
    finally:
        context.close()


def test_a_server_that_keeps_refusing_the_socket_is_retried_with_a_growing_pause(
    browser: Browser, server: Server
) -> None:

    context, page, _ = _own_page(browser)
    try:
        page.route_web_socket(f"ws://127.0.0.1:{server.port}/", lambda ws: ws.close())
        page.add_init_script(
            """new MutationObserver(() => {
                const badge = document.getElementById('connection');
                if (badge && badge.dataset.state === 'retrying'
                        && (window.__retries ?? []).at(-1) !== badge.textContent)
                    (window.__retries ??= []).push(badge.textContent);
            }).observe(document, {subtree: true, childList: true, characterData: true,
                                   attributes: true})"""
        )
        response = page.goto(server.page_url)
        assert response is not None and response.status == 200
        page.wait_for_function("() => (window.__retries ?? []).length >= 4", timeout=WAIT_MS)
        assert page.evaluate("window.__retries")[:4] == [
            "reconnecting in 0.3 s…",
            "reconnecting in 0.5 s…",
            "reconnecting in 1.0 s…",
            "reconnecting in 2.0 s…",
        ]
    finally:
        context.close()
