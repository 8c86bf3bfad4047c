// The WebSocket protocol of `tak serve` (docs/protocol.md), for the page.
//
// One connection at a time; `hello` carries the token (never the URL, so no
// proxy or log sees it). Each request gets an id and its frames are routed
// by `re`: events to the request's `onEvent`, the one `reply` (or the `error`
// that refused it) settles its promise. When the connection drops, requests
// still waiting fail with `lost`, and the connection is opened again after a
// growing pause, by itself, until `hello` is refused. The pause starts again
// from the shortest only once a connection has stayed open a while: a server
// that takes `hello` and then drops the page at once is not called every 250 ms.
//
// A frame is the server's, not to be trusted: one that is not a JSON object with
// a string `type` is dropped, and a refusal's code and message are taken only
// when they are strings.

const PROTOCOL_VERSION = 1;
const RETRY_MS = [250, 500, 1000, 2000, 4000];
// How long a connection stays open before the next drop retries after the shortest pause.
const STEADY_MS = 5000;

export class RequestError extends Error {
  // status: "error" | "cancelled" | "refused" | "lost"; code: the protocol's error code.
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export class Wire {
  // token: kept here only, in memory. onState(state, detail) hears
  // "connecting", "open" (detail: hello's result), "retrying" (detail: ms),
  // "refused" (detail: why).
  constructor(url, token, onState) {
    this.url = url;
    this.token = token;
    this.onState = onState;
    this.socket = null;
    this.pending = new Map(); // id -> {resolve, reject, onEvent}
    this.nextId = 1;
    this.attempt = 0;
    this.steady = undefined; // the timer that resets `attempt` once a connection holds
    this.stopped = false;
    this.info = null;
  }

  connect() {
    if (this.stopped) return;
    this.onState("connecting");
    const socket = new WebSocket(this.url);
    this.socket = socket;
    socket.addEventListener("open", () => this.greet(socket));
    socket.addEventListener("message", (event) => this.receive(event.data));
    socket.addEventListener("close", (event) => this.closed(socket, event));
  }

  async greet(socket) {
    try {
      const info = await this.request({ type: "hello", token: this.token, client: "tak-web" });
      if (!isObject(info)) throw new RequestError("refused", "bad_reply", "hello: no result");
      this.info = info;
    } catch (error) {
      if (error.code === "unauthorized") {
        // The server restarted with a new token: only the new URL can help.
        this.stopped = true;
        this.onState("refused", "the server does not take this page's token " +
          "(restarted with a new one?): open the URL tak serve printed");
        socket.close();
      }
      return;
    }
    this.steady = setTimeout(() => {
      if (socket === this.socket) this.attempt = 0;
    }, STEADY_MS);
    this.onState("open", this.info);
  }

  closed(socket, event) {
    if (socket !== this.socket) return;
    this.socket = null;
    clearTimeout(this.steady);
    for (const [id, waiter] of this.pending) {
      waiter.reject(new RequestError("lost", "lost",
        `connection lost (${event.code}${event.reason ? " " + event.reason : ""})`));
      this.pending.delete(id);
    }
    if (this.stopped) return;
    const delay = RETRY_MS[Math.min(this.attempt, RETRY_MS.length - 1)];
    this.attempt += 1;
    this.onState("retrying", delay);
    setTimeout(() => this.connect(), delay);
  }

  get isOpen() {
    return this.socket !== null && this.socket.readyState === WebSocket.OPEN;
  }

  newId() {
    return `w${this.nextId++}`;
  }

  // Send a request; resolves with its reply's result. `frame.id` is set when missing.
  request(frame, onEvent = null) {
    const id = frame.id ?? this.newId();
    const message = { v: PROTOCOL_VERSION, ...frame, id };
    return new Promise((resolve, reject) => {
      if (!this.isOpen) {
        reject(new RequestError("lost", "lost", "not connected"));
        return;
      }
      this.pending.set(id, { resolve, reject, onEvent });
      this.socket.send(JSON.stringify(message));
    });
  }

  receive(text) {
    let frame;
    try {
      frame = JSON.parse(text);
    } catch {
      return;
    }
    if (!isObject(frame) || typeof frame.type !== "string") return;
    const waiter = typeof frame.re === "string" ? this.pending.get(frame.re) : undefined;
    if (frame.type === "event") {
      if (waiter && waiter.onEvent) waiter.onEvent(frame);
      return;
    }
    if (!waiter) return;
    this.pending.delete(frame.re);
    if (frame.type === "reply" && frame.status === "ok") {
      waiter.resolve(frame.result);
    } else if (frame.type === "reply") {
      const status = typeof frame.status === "string" ? frame.status : "error";
      waiter.reject(problem(status, frame.error, status));
    } else {
      waiter.reject(problem("refused", frame.error, "refused"));
    }
  }
}

// Whether `value` is a JSON object (not null, not an array): what a frame, a result or
// a record from the server must be before its fields are read.
export function isObject(value) {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

// The RequestError of a refusal or a failed reply; `error` is the frame's, whatever it holds.
function problem(status, error, fallback) {
  const field = (name) =>
    isObject(error) && typeof error[name] === "string" ? error[name] : fallback;
  return new RequestError(status, field("code"), field("message"));
}
