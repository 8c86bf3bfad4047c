// Building the page's elements. Text from the server only ever goes in as
// text (through `el`, or `visible` for textContent), never as HTML.

import { isObject } from "./wire.js";

// Unicode's bidirectional controls: embeddings, overrides, isolates and marks. Shown
// raw they reorder the text around them, so that a call the model makes can read as
// another one ("Trojan Source"); they are shown as escapes instead.
const BIDI_CONTROLS = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;

// `value` as text to show: bidi controls written as `\u202e`. Everything from the
// server (model text, tool names, arguments, output, titles) goes through here.
export function visible(value) {
  return String(value).replace(BIDI_CONTROLS,
    (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);
}

export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : visible(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(visible(child)));
  }
  return node;
}

export function json(value) {
  return JSON.stringify(value, null, 2);
}

export function seconds(value) {
  if (typeof value !== "number") return "";
  return value < 1 ? `${Math.round(value * 1000)} ms` : `${value.toFixed(2)} s`;
}

export function cost(nanoUsd) {
  if (!nanoUsd) return "$0";
  return `$${(nanoUsd / 1e9).toFixed(4)}`;
}

// --- sessions ------------------------------------------------------------------------

export function sessionItem(summary, selected, onOpen) {
  const data = summary.data ?? {};
  const tokens = (data.input_tokens ?? 0) + (data.output_tokens ?? 0);
  const damaged = summary.problem !== null && summary.problem !== undefined;
  return el(
    "li",
    { class: `session${selected ? " selected" : ""}${damaged ? " damaged" : ""}`,
      dataset: { session: summary.session_id } },
    el(
      "button",
      { type: "button", class: "session-open", onclick: () => onOpen(summary.session_id),
        title: damaged ? summary.problem : summary.session_id },
      el("span", { class: "session-title" }, data.title || summary.session_id),
      damaged ? el("span", { class: "badge damaged-badge" }, "damaged") : null,
      el(
        "span",
        { class: "session-stats" },
        `${data.entry_count ?? 0} entries · ${tokens} tokens · ${cost(data.cost_nano_usd)}`,
      ),
    ),
  );
}

// --- transcript ----------------------------------------------------------------------

function partsOf(entry) {
  const parts = entry.message && Array.isArray(entry.message.parts) ? entry.message.parts : [];
  return parts.filter(isObject);
}

function textParts(entry) {
  return partsOf(entry).filter((p) => p.type === "text").map((p) => p.text).join("");
}

export function callBlock(call) {
  return el(
    "div",
    { class: "tool-call", dataset: { call: call.id } },
    el("span", { class: "call-label" }, "call "),
    el("code", { class: "call-name" }, call.name),
    el("pre", { class: "arguments" }, json(call.arguments)),
  );
}

export function observationBlock(observation) {
  const error = observation.error;
  const kind = observation.is_error ? (error ? error.kind : "error") : "ok";
  return el(
    "div",
    { class: `observation${observation.is_error ? " is-error" : ""}`,
      dataset: { kind, call: observation.call_id } },
    el(
      "div",
      { class: "observation-head" },
      el("code", { class: "call-name" }, observation.name),
      el("span", { class: `status status-${observation.is_error ? "error" : "ok"}` }, kind),
      el("span", { class: "duration" }, seconds(observation.duration_s)),
    ),
    el("pre", { class: "content" }, observation.content),
  );
}

export function entryBlock(entry) {
  switch (entry.type) {
    case "user":
      return el("div", { class: "entry user" }, el("div", { class: "who" }, "you"),
        el("div", { class: "text" }, textParts(entry)));
    case "system":
      return el("div", { class: "entry system" }, el("div", { class: "who" }, "system"),
        el("div", { class: "text" }, textParts(entry)));
    case "assistant": {
      const calls = partsOf(entry).filter((p) => p.type === "tool_call");
      const text = textParts(entry);
      return el("div", { class: "entry assistant" },
        el("div", { class: "who" }, entry.model ? `assistant · ${entry.model}` : "assistant"),
        text ? el("div", { class: "text" }, text) : null,
        calls.map(callBlock));
    }
    case "tool":
      return el("div", { class: "entry tool" },
        partsOf(entry).filter((p) => p.type === "observation").map(observationBlock));
    case "compaction":
      return el("details", { class: "entry compaction" },
        el("summary", {}, "compacted: the model sees this summary instead of what came before"),
        el("div", { class: "text" }, entry.summary ?? ""));
    case "title":
      return el("div", { class: "entry title-entry" }, `title: ${entry.title ?? ""}`);
    default:
      return el("div", { class: "entry other" }, `(${entry.type ?? "unknown"} entry)`);
  }
}

// --- tools ---------------------------------------------------------------------------

export function toolItem(spec) {
  const limits = [];
  if (spec.timeout !== undefined) limits.push(`timeout ${spec.timeout} s`);
  if (spec.exclusive) limits.push("exclusive");
  if (spec.max_output !== undefined) limits.push(`max output ${spec.max_output}`);
  return el(
    "li",
    { class: "tool", dataset: { tool: spec.name } },
    el(
      "details",
      {},
      el("summary", {}, el("code", {}, spec.name), " ",
        el("span", { class: "tool-description" }, String(spec.description ?? "").split("\n")[0])),
      limits.length ? el("div", { class: "tool-limits" }, limits.join(" · ")) : null,
      el("pre", { class: "schema" }, json(spec.parameters)),
    ),
  );
}
