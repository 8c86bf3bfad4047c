// One running turn, drawn as its events arrive: the prompt, the text the
// model streams at each step, and each batch of tool calls as a table with a
// row per call in declared order (the `index` of its events), so calls that
// run at the same time are seen running at the same time.

import { el, json, seconds, visible } from "./view.js";
import { isObject } from "./wire.js";

export class LiveTurn {
  // onCancelCall(callId, row) asks the server to cancel that call alone.
  constructor(prompt, onCancelCall) {
    this.onCancelCall = onCancelCall;
    this.step = 0;
    this.text = null; // the element the current step's text streams into
    this.batch = null; // {table, body, rows: Map(index -> row)} of the current step
    this.status = el("div", { class: "turn-status", role: "status" }, "running…");
    this.element = el(
      "div",
      { class: "turn live", dataset: { state: "running" } },
      el("div", { class: "entry user" }, el("div", { class: "who" }, "you"),
        el("div", { class: "text" }, prompt)),
      this.status,
    );
  }

  // An event without the fields its kind needs (from a broken server) is dropped.
  event(frame) {
    switch (frame.kind) {
      case "model_delta":
        this.delta(frame.step, frame.text);
        break;
      case "call_started":
        if (isObject(frame.call)) this.started(frame.index, frame.call);
        break;
      case "call_finished":
        if (isObject(frame.observation)) this.finished(frame.index, frame.observation);
        break;
      case "turn_finished":
        this.end(frame.reason, frame.error);
        break;
      default:
        break; // a kind this page does not know yet
    }
  }

  delta(step, text) {
    if (step !== this.step || this.text === null || this.batch !== null) {
      this.step = step;
      this.batch = null;
      this.text = el("div", { class: "text streamed" });
      this.append(el("div", { class: "entry assistant" },
        el("div", { class: "who" }, `assistant · step ${step}`), this.text));
    }
    this.text.append(document.createTextNode(visible(text)));
  }

  append(node) {
    this.element.insertBefore(node, this.status);
  }

  newBatch() {
    const body = el("tbody");
    const table = el(
      "table",
      { class: "batch" },
      el("thead", {}, el("tr", {},
        el("th", {}, "#"), el("th", {}, "tool"), el("th", {}, "arguments"),
        el("th", {}, "status"), el("th", {}, "time"), el("th", {}, ""))),
      body,
    );
    this.batch = { table, body, rows: new Map() };
    this.append(el("div", { class: "batch-wrap" }, table));
    return this.batch;
  }

  row(index, call) {
    const batch = this.batch ?? this.newBatch();
    let row = batch.rows.get(index);
    if (row) return row;
    const cancel = el("button", { type: "button", class: "call-cancel", title: "cancel this call" },
      "cancel");
    row = {
      index,
      callId: call ? call.id : null,
      tr: el("tr", { class: "call", dataset: { index, status: "running" } }),
      name: el("td", { class: "call-name" }, call ? call.name : ""),
      args: el("td", { class: "call-args" },
        call ? el("code", {}, JSON.stringify(call.arguments)) : null),
      status: el("td", { class: "call-status" },
        el("span", { class: "spinner", "aria-hidden": "true" }), " running"),
      time: el("td", { class: "call-duration" }),
      cancel,
      note: el("div", { class: "call-note" }),
    };
    cancel.addEventListener("click", () => {
      if (row.callId !== null) this.onCancelCall(row.callId, row);
    });
    row.tr.append(el("td", { class: "call-index" }, String(index)), row.name, row.args,
      row.status, row.time, el("td", {}, cancel));
    // Declared order: before the first row with a larger index.
    const after = [...batch.rows.values()].filter((r) => r.index > index)
      .sort((a, b) => a.index - b.index)[0];
    batch.body.insertBefore(row.tr, after ? after.tr : null);
    batch.rows.set(index, row);
    return row;
  }

  // Running rows show their time so far, a few times a second, until the turn ends.
  tick() {
    if (this.timer !== undefined) return;
    this.timer = setInterval(() => {
      const now = performance.now();
      for (const row of this.batch ? this.batch.rows.values() : []) {
        if (row.tr.dataset.status === "running" && row.since !== undefined) {
          row.time.textContent = `${seconds((now - row.since) / 1000)}…`;
        }
      }
    }, 200);
  }

  stopTicking() {
    clearInterval(this.timer);
    this.timer = undefined;
  }

  started(index, call) {
    const seen = this.batch ? this.batch.rows.get(index) : undefined;
    if (seen && seen.callId !== call.id) this.newBatch(); // a next step that streamed no text
    const row = this.row(index, call);
    row.callId = call.id;
    row.name.textContent = visible(call.name);
    row.args.replaceChildren(el("code", {}, JSON.stringify(call.arguments)));
    row.since = performance.now();
    this.tick();
  }

  finished(index, observation) {
    const row = this.row(index, null);
    row.callId = row.callId ?? observation.call_id;
    if (!row.name.textContent) row.name.textContent = visible(observation.name);
    const error = observation.error;
    const status = observation.is_error ? (error ? error.kind : "error") : "ok";
    const state = !observation.is_error ? "ok" : status === "cancelled" ? "cancelled" : "error";
    row.tr.dataset.status = state;
    row.tr.classList.toggle("is-error", state === "error");
    row.status.replaceChildren(el("span", { class: `status status-${state}` }, status));
    row.time.textContent = seconds(observation.duration_s);
    row.cancel.remove();
    const detail = el("details", { class: "call-output" },
      el("summary", {}, observation.is_error && error ? error.message : "output"),
      el("pre", {}, observation.content));
    row.args.append(detail);
  }

  noteOnRow(row, text) {
    row.note.textContent = visible(text);
    if (!row.note.isConnected) row.status.append(row.note);
  }

  end(reason, error) {
    this.stopTicking();
    this.element.dataset.state = reason;
    this.status.replaceChildren(el("span", { class: `badge reason reason-${reason}` }, reason));
    if (error) {
      const why = `${error.kind ?? "error"}: ${error.message ?? json(error)}`;
      this.status.append(" ", el("span", { class: "turn-error" }, why));
    }
    for (const row of this.element.querySelectorAll("tr.call[data-status=running]")) {
      row.dataset.status = "unknown";
    }
  }

  fail(message) {
    this.stopTicking();
    this.element.dataset.state = "failed";
    this.status.replaceChildren(el("span", { class: "turn-error" }, message));
  }
}
