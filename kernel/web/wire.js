// The WebSocket protocol of `tak serve` (docs/protocol.md), for the page.
//
// One connection at a time; `hello` carries the token (never the URL, so no
// proxy or log sees it). Each request gets an id and its frames are routed
// by `re`: events to the request's `onEvent`, the one `reply` (or the `error`
// that refused it) settles its promise. When the connection drops, requests
// still waiting fail with `lost`, and the connection is opened again after a
// growing pause, by itself, until `hello` is refused.

const PROTOCOL_VERSION = 1;
const RETRY_MS = [250, 500, 1000, 2000, 4000];

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
      this.info = await this.request({ type: "hello", token: this.token, client: "tak-web" });
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
    this.attempt = 0;
    this.onState("open", this.info);
  }

  closed(socket, event) {
    if (socket !== this.socket) return;
    this.socket = null;
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
    const waiter = frame.re === undefined ? undefined : this.pending.get(frame.re);
    if (frame.type === "event") {
      if (waiter && waiter.onEvent) waiter.onEvent(frame);
      return;
    }
    if (!waiter) return;
    this.pending.delete(frame.re);
    if (frame.type === "reply" && frame.status === "ok") {
      waiter.resolve(frame.result);
    } else if (frame.type === "reply") {
      const error = frame.error ?? { code: frame.status, message: frame.status };
      waiter.reject(new RequestError(frame.status, error.code, error.message));
    } else {
      waiter.reject(new RequestError("refused", frame.error.code, frame.error.message));
    }
  }
}
