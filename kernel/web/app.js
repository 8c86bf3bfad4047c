// The page of `tak serve` (docs/web.md): sessions, a session's transcript,
// a prompt that runs a turn with its tool calls drawn live, the tools.
//
// The token comes in the page's URL once: it is read, taken out of the
// address bar (history.replaceState) and kept in this module's memory only —
// no cookie, no storage. It reaches the server in `hello`.

import { el, entryBlock, sessionItem, toolItem, visible } from "./view.js";
import { LiveTurn } from "./turn.js";
import { Wire, isObject } from "./wire.js";

const SESSION_NAME = /^[A-Za-z0-9._-]{1,128}$/;

const $ = (id) => document.getElementById(id);

const token = new URLSearchParams(window.location.search).get("token") ?? "";
window.history.replaceState(null, "", window.location.pathname);

const state = {
  session: null,
  sessions: [],
  turn: null, // {id, view} while a turn runs
};

const wire = new Wire(`ws://${window.location.host}/`, token, onConnection);

function onConnection(status, detail) {
  const badge = $("connection");
  badge.dataset.state = status;
  if (status === "open") {
    badge.textContent = "connected";
    $("server-model").textContent = visible(detail.model);
    $("model").placeholder = visible(detail.model);
    refreshAll();
  } else if (status === "retrying") {
    badge.textContent = `reconnecting in ${(detail / 1000).toFixed(1)} s…`;
  } else if (status === "refused") {
    badge.textContent = "refused";
    showNotice(detail);
  } else {
    badge.textContent = "connecting…";
  }
  updateButtons();
}

function showNotice(text) {
  const notice = $("notice");
  notice.textContent = visible(text);
  notice.hidden = !text;
}

// The records listed under `field` of a reply's result, each an object whose `key` is a
// string; anything else a broken server sends is left out rather than thrown on.
function records(result, field, key) {
  const listed = isObject(result) && Array.isArray(result[field]) ? result[field] : [];
  return listed.filter((item) => isObject(item) && typeof item[key] === "string");
}

async function refreshAll() {
  await Promise.all([refreshSessions(), refreshTools()]);
  if (state.session !== null && state.turn === null) await openSession(state.session);
}

async function refreshSessions() {
  let result;
  try {
    result = await wire.request({ type: "sessions" });
  } catch (error) {
    showNotice(`sessions: ${error.message}`);
    return;
  }
  state.sessions = records(result, "sessions", "session_id")
    .sort((a, b) => (b.mtime_ms ?? 0) - (a.mtime_ms ?? 0));
  drawSessions();
}

function drawSessions() {
  const list = $("sessions");
  list.replaceChildren(...state.sessions.map(
    (s) => sessionItem(s, s.session_id === state.session, openSession)));
  $("sessions-empty").hidden = state.sessions.length > 0;
}

async function refreshTools() {
  let result;
  try {
    result = await wire.request({ type: "tools" });
  } catch (error) {
    showNotice(`tools: ${error.message}`);
    return;
  }
  const tools = records(result, "tools", "name");
  $("tools-count").textContent = String(tools.length);
  $("tools").replaceChildren(...tools.map(toolItem));
}

async function openSession(sessionId) {
  if (state.turn !== null) return; // the running turn's session stays on screen
  state.session = sessionId;
  $("session-id").value = sessionId;
  drawSessions();
  const transcript = $("transcript");
  let result;
  try {
    result = await wire.request({ type: "history", session: sessionId });
  } catch (error) {
    transcript.replaceChildren(el("div", { class: "entry error" }, error.message));
    return;
  }
  if (state.session !== sessionId) return; // another was opened meanwhile
  transcript.replaceChildren(...records(result, "entries", "type").map(entryBlock));
  transcript.dataset.session = sessionId;
  scrollDown();
}

function newSession() {
  const stamp = new Date().toISOString().replace(/[-:]/g, "").replace("T", "-").slice(0, 15);
  state.session = null;
  $("session-id").value = `web-${stamp}`;
  $("transcript").replaceChildren();
  delete $("transcript").dataset.session;
  drawSessions();
  $("prompt").focus();
}

// --- a turn --------------------------------------------------------------------------

function runRequest(sessionId, prompt) {
  const frame = { type: "run", session: sessionId, prompt };
  const model = $("model").value.trim();
  if (model) frame.model = model;
  const settings = {};
  for (const name of ["temperature", "top_p"]) {
    const value = $(name).value.trim();
    if (value) settings[name] = Number(value);
  }
  for (const name of ["max_tokens", "seed"]) {
    const value = $(name).value.trim();
    if (value) settings[name] = Number.parseInt(value, 10);
  }
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) settings.stop = stop;
  for (const name of ["tool_choice", "reasoning_effort"]) {
    const value = $(name).value.trim();
    if (value) settings[name] = value;
  }
  const parallel = $("parallel_tool_calls").value;
  if (parallel) settings.parallel_tool_calls = parallel === "true";
  const extra = $("extra").value.trim();
  if (extra) {
    try {
      settings.extra = JSON.parse(extra);
    } catch (error) {
      throw new Error(`settings.extra: not JSON: ${error.message}`);
    }
  }
  if (Object.keys(settings).length) frame.settings = settings;
  const tools = $("run-tools").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (tools.length) frame.tools = tools;
  return frame;
}

async function runTurn() {
  const prompt = $("prompt").value;
  if (!prompt.trim() || state.turn !== null || !wire.isOpen) return;
  const sessionId = $("session-id").value.trim();
  if (!SESSION_NAME.test(sessionId)) {
    showNotice("session: 1 to 128 letters, digits, '.', '_' or '-'");
    return;
  }
  let frame;
  try {
    frame = runRequest(sessionId, prompt);
  } catch (error) {
    showNotice(error.message);
    return;
  }
  showNotice("");
  if (state.session !== sessionId) {
    state.session = sessionId;
    $("transcript").replaceChildren();
  }
  const id = wire.newId();
  const view = new LiveTurn(prompt, (callId, row) => cancelCall(id, callId, row));
  state.turn = { id, view };
  $("transcript").append(view.element);
  $("prompt").value = "";
  updateButtons();
  scrollDown();
  try {
    let first = true;
    await wire.request({ ...frame, id }, (event) => {
      if (first) refreshSessions(); // the prompt is recorded: a new session is listed now
      first = false;
      view.event(event);
      scrollDown();
    });
  } catch (error) {
    if (error.status === "cancelled") view.end("cancelled", null);
    else view.fail(`${error.code}: ${error.message}`);
  } finally {
    state.turn = null;
    updateButtons();
    refreshSessions();
  }
}

async function cancelTurn() {
  if (state.turn === null) return;
  try {
    await wire.request({ type: "cancel", target: state.turn.id });
  } catch (error) {
    showNotice(`cancel: ${error.message}`);
  }
}

async function cancelCall(turnId, callId, row) {
  row.cancel.disabled = true;
  try {
    // One call of the turn: the rest of the batch goes on.
    await wire.request({ type: "cancel", target: turnId, call: callId });
  } catch (error) {
    row.cancel.disabled = false;
    const unsupported = error.code === "bad_message";
    state.turn?.view.noteOnRow(row, unsupported
      ? "this server cancels whole turns only (Esc)"
      : `cancel: ${error.message}`);
  }
}

function updateButtons() {
  const running = state.turn !== null;
  $("run").disabled = running || !wire.isOpen;
  $("cancel-turn").disabled = !running;
  document.body.dataset.running = running ? "yes" : "no";
}

function scrollDown() {
  const transcript = $("transcript");
  transcript.scrollTop = transcript.scrollHeight;
}

// --- wiring ------------------------------------------------------------------------

$("prompt-form").addEventListener("submit", (event) => {
  event.preventDefault();
  runTurn();
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    runTurn();
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && state.turn !== null) {
    event.preventDefault();
    cancelTurn();
  }
});
$("cancel-turn").addEventListener("click", cancelTurn);
$("new-session").addEventListener("click", newSession);
$("refresh-sessions").addEventListener("click", refreshSessions);

newSession();
if (token) {
  wire.connect();
} else {
  onConnection("refused", "no token: open the http:// URL tak serve printed");
}
