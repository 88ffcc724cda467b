// streamvqa web page: cameras (latest frame, status), ask with a streamed answer, transcript, alerts.
// Plain JS over the HTTP API; text from the model or the cameras file is only ever set as textContent.
"use strict";

const REFRESH = { frame: 1000, status: 2000, transcript: 3000, alerts: 3000 };
// The source's newest state (ingest events) -> badge text and style.
const BADGES = {
  connected: ["live", "up"], eof: ["file ended", "ended"], reconnecting: ["reconnecting", "down"],
  stalled: ["stalled", "down"], error: ["source error", "down"], gave_up: ["gave up", "down"],
};
const cards = new Map(); // stream name -> {el, frameUrl}
let token = localStorage.getItem("svqa-token") || "";

function authHeaders(extra = {}) {
  return token ? { ...extra, Authorization: `Bearer ${token}` } : extra;
}

async function api(path, options = {}) {
  const res = await fetch(path, { ...options, headers: authHeaders(options.headers) });
  if (!res.ok) {
    let message = `${res.status} ${res.statusText}`;
    try { message = (await res.json()).error.message; } catch (_) { /* not our JSON */ }
    const err = new Error(message);
    err.status = res.status;
    throw err;
  }
  return res;
}

function showError(message) {
  const box = document.getElementById("error");
  box.hidden = !message;
  box.textContent = message || "";
}

// Live streams carry unix times (shown as clock time), files carry media seconds (shown as m:ss.s).
function fmtTime(t) {
  if (t === null || t === undefined || t === "") return "–";
  t = Number(t);
  if (t > 1e8) return new Date(t * 1000).toLocaleTimeString();
  const m = Math.floor(t / 60);
  return `${m}:${(t - m * 60).toFixed(1).padStart(4, "0")}`;
}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (cls) node.className = cls;
  return node;
}

function card(name) {
  if (cards.has(name)) return cards.get(name);
  const node = document.getElementById("camera").content.firstElementChild.cloneNode(true);
  node.dataset.stream = name;
  node.querySelector(".name").textContent = name;
  node.querySelector("form.ask").addEventListener("submit", (e) => { e.preventDefault(); ask(name, node); });
  document.getElementById("cameras").appendChild(node);
  const entry = { el: node, frameUrl: null };
  cards.set(name, entry);
  refreshFrame(name);
  refreshTranscript(name);
  return entry;
}

function renderStatus(node, s) {
  const head = s.head || {};
  const badge = node.querySelector(".badge");
  const [label, cls] = BADGES[s.state] || (s.lease ? ["encoding", "up"] : ["idle", ""]);
  badge.textContent = label;
  badge.className = `badge ${cls}`;
  const range = head.time_range ? `${fmtTime(head.time_range[0])} – ${fmtTime(head.time_range[1])}` : "–";
  const rows = [
    ["version", head.version ?? "–"],
    ["cached tokens", head.tokens !== undefined ? head.tokens.toLocaleString() : "–"],
    ["video covered", range],
    ["lag", head.lag_s !== null && head.lag_s !== undefined ? `${head.lag_s} s` : "–"],
    ["frames waiting", (s.frames.lag || 0) + (s.frames.pending || 0)],
    ["dropped", s.dropped],
  ];
  const dl = node.querySelector(".status");
  dl.replaceChildren(...rows.map(([k, v]) => {
    const div = el("div");
    div.append(el("dt", k), el("dd", String(v)));
    return div;
  }));
}

async function refreshStatus() {
  try {
    const all = await (await api("/api/streams")).json();
    showError("");
    const q = all.questions;
    document.getElementById("overview").textContent =
      `${all.streams.length} stream(s) · questions: ${q.lag || 0} queued, ${q.pending || 0} being answered`;
    for (const s of all.streams) renderStatus(card(s.stream).el, s);
  } catch (err) {
    showError(err.status === 401 ? "This API needs a token: enter it at the top right." : `API: ${err.message}`);
  }
}

async function refreshFrame(name) {
  const entry = cards.get(name);
  try {
    const res = await api(`/api/streams/${encodeURIComponent(name)}/frame.jpg`);
    const url = URL.createObjectURL(await res.blob());
    entry.el.querySelector(".frame img").src = url;
    if (entry.frameUrl) URL.revokeObjectURL(entry.frameUrl);
    entry.frameUrl = url;
    entry.el.querySelector(".frame-time").textContent = fmtTime(res.headers.get("X-Frame-Ts"));
  } catch (_) { /* no frame yet */ }
}

async function refreshTranscript(name) {
  const entry = cards.get(name);
  try {
    const { cues } = await (await api(`/api/streams/${encodeURIComponent(name)}/transcript?count=50`)).json();
    if (!cues.length) return;
    const list = entry.el.querySelector(".transcript");
    list.replaceChildren(...cues.map((c) => {
      const li = el("li");
      li.append(el("span", `${fmtTime(c.start)} – ${fmtTime(c.end)}`, "time"), el("span", c.text, "text"));
      return li;
    }));
    list.scrollTop = list.scrollHeight;
  } catch (_) { /* shown by the status refresh */ }
}

function alertWhen(a) {
  return `${new Date(a.at * 1000).toLocaleString()} · P(yes) ${a.score.toFixed(2)}`;
}

async function refreshAlerts() {
  try {
    const { alerts } = await (await api("/api/alerts?count=20")).json();
    if (!alerts.length) return;
    const list = document.getElementById("alerts");
    list.replaceChildren(...alerts.reverse().map((a) => {
      const li = el("li", undefined, a.acked ? "acked" : "");
      li.dataset.alert = a.id;
      li.tabIndex = 0;
      li.append(el("b", `${a.stream} · ${a.job}`), el("div", a.question), el("div", alertWhen(a), "when"));
      li.addEventListener("click", () => openAlert(a));
      li.addEventListener("keydown", (e) => { if (e.key === "Enter") openAlert(a); });
      return li;
    }));
  } catch (_) { /* shown by the status refresh */ }
}

// An alert opened: the frame it fired on (fetched with the token, so as a blob), and a button
// that acknowledges it for everyone (POST .../ack: the first acknowledgement stands).
let alertFrameUrl = null;
async function openAlert(a) {
  const dialog = document.getElementById("alert-dialog");
  const path = `/api/streams/${encodeURIComponent(a.stream)}/alerts/${encodeURIComponent(a.id)}`;
  dialog.querySelector("#alert-title").textContent = `${a.stream} · ${a.job}`;
  dialog.querySelector(".alert-question").textContent = a.question;
  const when = dialog.querySelector(".alert-when");
  when.textContent = alertWhen(a) + (a.acked ? ` · acknowledged ${new Date(a.acked * 1000).toLocaleString()}` : "");
  const img = dialog.querySelector(".alert-frame");
  img.removeAttribute("src");
  img.alt = "the frame the alert fired on";
  showEvidence(dialog.querySelector(".evidence"), a.evidence);
  const ack = dialog.querySelector("button.ack");
  ack.disabled = Boolean(a.acked);
  ack.onclick = async () => {
    ack.disabled = true;
    try {
      const { acked } = await (await api(`${path}/ack`, { method: "POST" })).json();
      a.acked = acked;
      when.textContent = `${alertWhen(a)} · acknowledged ${new Date(acked * 1000).toLocaleString()}`;
      document.querySelector(`#alerts li[data-alert="${a.id}"]`)?.classList.add("acked");
    } catch (err) {
      ack.disabled = false;
      when.textContent = `could not acknowledge: ${err.message}`;
    }
  };
  dialog.showModal();
  try {
    const url = URL.createObjectURL(await (await api(`${path}/frame.jpg`)).blob());
    if (alertFrameUrl) URL.revokeObjectURL(alertFrameUrl);
    alertFrameUrl = img.src = url;
  } catch (err) {
    img.alt = `no frame: ${err.message}`;
  }
}

// An answer's or an alert's evidence (its `evidence` field, where the API reads a frames log): a
// button that fetches its clip with the token (a <video src> would send no Authorization header)
// and plays it.
const clipUrls = new WeakMap(); // video -> the object URL it plays
function showEvidence(box, evidence) {
  const button = box.querySelector("button.clip");
  const video = box.querySelector("video");
  box.hidden = !evidence;
  video.hidden = true;
  video.removeAttribute("src");
  if (clipUrls.has(video)) URL.revokeObjectURL(clipUrls.get(video));
  clipUrls.delete(video);
  button.disabled = false;
  button.textContent = "▶ clip";
  if (!evidence) return;
  button.onclick = async () => {
    button.disabled = true;
    try {
      const url = URL.createObjectURL(await (await api(evidence.clip)).blob());
      clipUrls.set(video, url);
      video.src = url;
      video.hidden = false;
      video.play().catch(() => { /* autoplay refused: the controls are there */ });
    } catch (err) {
      button.textContent = `no clip: ${err.message}`;
    }
  };
}

// Server-sent events from a POST: read the body and split it into events ourselves.
async function* sseEvents(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      let event = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) yield { event, data: JSON.parse(data) }; // a comment (": keep-alive") carries none
    }
  }
}

function ordinal(n) {
  const s = ["th", "st", "nd", "rd"], v = n % 100;
  return n + (s[(v - 20) % 10] || s[v] || s[0]);
}

// Log-probability scores of a multiple-choice answer -> each option's share, as bars.
function renderScores(box, data) {
  const entries = Object.entries(data.scores);
  const top = Math.max(...entries.map(([, s]) => s));
  const weights = entries.map(([c, s]) => [c, Math.exp(s - top)]);
  const sum = weights.reduce((acc, [, w]) => acc + w, 0);
  box.replaceChildren(...weights.flatMap(([c, w]) => {
    const share = (100 * w) / sum;
    const bar = el("span", undefined, "bar");
    bar.style.width = `${share}%`;
    const track = el("span");
    track.append(bar);
    return [el("span", c, c === data.choice ? "chosen" : ""), track, el("span", `${Math.round(share)}%`)];
  }));
}

function answerMeta(data) {
  const video = `version ${data.version} · video ${fmtTime(data.t_start)} – ${fmtTime(data.t_end)}`;
  const compute = data.first_token_s != null
    ? `first token ${(data.first_token_s * 1000).toFixed(0)} ms · ${data.tokens} tokens in ${data.total_s.toFixed(2)} s`
    : `answered in ${data.total_s.toFixed(2)} s`;
  const waited = data.queue_s != null ? ` · waited ${data.queue_s.toFixed(1)} s in the queue` : "";
  const total = data.elapsed_s != null ? ` · ${data.elapsed_s.toFixed(2)} s in all` : "";
  return `${video} · ${compute}${waited}${total}`;
}

async function ask(name, node) {
  const input = node.querySelector("input[name=question]");
  const choices = node.querySelector("input[name=choices]").value.split(",").map((c) => c.trim()).filter(Boolean);
  const button = node.querySelector("button");
  const answer = node.querySelector(".answer");
  const meta = node.querySelector(".answer-meta");
  answer.textContent = "";
  answer.className = "answer streaming";
  meta.textContent = "";
  showEvidence(node.querySelector(".evidence"), null);
  button.disabled = true;
  try {
    const res = await api(`/api/streams/${encodeURIComponent(name)}/ask`, {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify({ question: input.value, stream: true, ...(choices.length ? { choices } : {}) }),
    });
    for await (const { event, data } of sseEvents(res)) {
      if (event === "queued") {
        meta.textContent = `waiting: ${ordinal(data.position)} in the queue · ${data.waited_s.toFixed(0)} s so far`;
      } else if (event === "delta") {
        if (!answer.textContent) meta.textContent = "";
        answer.textContent += data.text;
      }
      else if (event === "restart") answer.textContent = ""; // its worker died: another answers from the start
      else if (event === "final") {
        if (data.error) throw new Error(data.error);
        answer.textContent = data.text;
        if (data.scores) {
          const box = el("div", undefined, "scores");
          renderScores(box, data);
          answer.append(box);
        }
        meta.textContent = answerMeta(data);
        showEvidence(node.querySelector(".evidence"), data.evidence);
        node.dataset.answered = "1";
      } else if (event === "error") throw new Error(data.error.message);
    }
    answer.className = "answer";
  } catch (err) {
    answer.className = "answer failed";
    answer.textContent = err.message;
  } finally {
    button.disabled = false;
  }
}

function every(ms, fn) { fn(); setInterval(fn, ms); }

document.addEventListener("DOMContentLoaded", () => {
  const tokenInput = document.getElementById("token");
  tokenInput.value = token;
  tokenInput.addEventListener("change", () => {
    token = tokenInput.value.trim();
    localStorage.setItem("svqa-token", token);
    refreshStatus();
  });
  every(REFRESH.status, refreshStatus);
  every(REFRESH.alerts, refreshAlerts);
  setInterval(() => cards.forEach((_, name) => refreshFrame(name)), REFRESH.frame);
  setInterval(() => cards.forEach((_, name) => refreshTranscript(name)), REFRESH.transcript);
});
