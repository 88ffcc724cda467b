// streamvqa web page: cameras (latest frame, status), ask with a streamed answer (now or about a
// past span), transcript, alerts, search of the past with thumbnails, and the clips of what was seen.
// Plain JS over the HTTP API; text from the model or the cameras file is only ever set as textContent.
"use strict";

const REFRESH = { frame: 1000, status: 2000, transcript: 3000, alerts: 3000 };
const SEARCH_LIMIT = 24; // results a search shows
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

// A failed request as an Error: the API's message, the field it names (`param`: prefixed where the
// message does not say it) and, for a busy API (503, 429), when to try again (Retry-After).
async function api(path, options = {}) {
  const res = await fetch(path, { ...options, headers: authHeaders(options.headers) });
  if (!res.ok) {
    let error = {};
    try { error = (await res.json()).error || {}; } catch (_) { /* not our JSON */ }
    const retry = res.headers.get("Retry-After");
    const err = failure(error.message || `${res.status} ${res.statusText}`, error.param, retry);
    err.status = res.status;
    throw err;
  }
  return res;
}

function failure(message, param, retryAfter) {
  let text = param && !message.includes(param) ? `${param}: ${message}` : message;
  if (retryAfter) text += ` (try again in ${retryAfter} s)`;
  const err = new Error(text);
  err.param = param || null;
  return err;
}

// The control a refused field names is marked (aria-invalid) until the form is sent again; a span
// chosen from the presets is the preset's.
function markInvalid(form, param) {
  form.querySelectorAll("[aria-invalid]").forEach((c) => c.removeAttribute("aria-invalid"));
  const custom = form.querySelector(".custom");
  const name = ["since", "until"].includes(param) && custom && custom.hidden ? "preset" : param;
  const control = name && form.elements[name];
  if (control instanceof Element) control.setAttribute("aria-invalid", "true");
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

// A unix time with its date when it is not today's (the past reaches back days).
function fmtWhen(t) {
  const d = new Date(t * 1000);
  const time = d.toLocaleTimeString();
  return d.toDateString() === new Date().toDateString() ? time : `${d.toLocaleDateString()} ${time}`;
}

function fmtRange(start, end) {
  return `${fmtWhen(start)} – ${fmtTime(end)}`;
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
  const form = node.querySelector("form.ask");
  addSpan(form, form.querySelector(".scope"), "now (live)");
  form.addEventListener("submit", (e) => { e.preventDefault(); ask(name, node); });
  document.getElementById("cameras").appendChild(node);
  const option = el("option", name);
  option.value = name;
  document.querySelector("form.search select[name=stream]").append(option);
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

// An alert opened: the frame it fired on, its clip, and a button that acknowledges it for
// everyone (POST .../ack: the first acknowledgement stands).
function openAlert(a) {
  const path = `/api/streams/${encodeURIComponent(a.stream)}/alerts/${encodeURIComponent(a.id)}`;
  const acked = (t) => ` · acknowledged ${new Date(t * 1000).toLocaleString()}`;
  const dialog = openEvidence({
    title: `${a.stream} · ${a.job}`, about: a.question, when: alertWhen(a) + (a.acked ? acked(a.acked) : ""),
    picture: `${path}/frame.jpg`, alt: "the frame the alert fired on", evidence: a.evidence,
  });
  const when = dialog.querySelector(".when");
  const ack = dialog.querySelector("button.ack");
  ack.hidden = false;
  ack.disabled = Boolean(a.acked);
  ack.onclick = async () => {
    ack.disabled = true;
    try {
      a.acked = (await (await api(`${path}/ack`, { method: "POST" })).json()).acked;
      when.textContent = alertWhen(a) + acked(a.acked);
      document.querySelector(`#alerts li[data-alert="${a.id}"]`)?.classList.add("acked");
    } catch (err) {
      ack.disabled = false;
      when.textContent = `could not acknowledge: ${err.message}`;
    }
  };
}

// The dialog for an alert or a search result: a title, what it is about, a picture (fetched with
// the token, so as a blob), when, and its evidence; `play`: its clip starts at once.
let pictureUrl = null;
function openEvidence({ title, about, when, picture, alt, evidence, play = false }) {
  const dialog = document.getElementById("evidence-dialog");
  dialog.querySelector("#evidence-title").textContent = title;
  dialog.querySelector(".about").textContent = about;
  dialog.querySelector(".when").textContent = when;
  dialog.querySelector("button.ack").hidden = true;
  const img = dialog.querySelector("img.picture");
  img.removeAttribute("src");
  img.alt = alt;
  const box = dialog.querySelector(".evidence");
  showEvidence(box, evidence);
  if (!dialog.open) dialog.showModal();
  if (play) box.querySelector("button.clip").click();
  (async () => {
    try {
      const url = URL.createObjectURL(await (await api(picture)).blob());
      if (pictureUrl) URL.revokeObjectURL(pictureUrl);
      pictureUrl = img.src = url;
    } catch (err) {
      img.alt = `no picture: ${err.message}`;
    }
  })();
  return dialog;
}

// An answer's or an alert's evidence (its `evidence` field, where the API reads a frames log): what
// was seen, a button for each of its capture ranges and, with several, one for the evidence's own
// clip (button.clip: from the first to the last, their newest 10 minutes when they stretch
// further); a button fetches its clip with the token (a <video src> would send no Authorization
// header) and plays it.
const clipUrls = new WeakMap(); // video -> the object URL it plays
function showEvidence(box, evidence) {
  const video = box.querySelector("video");
  box.hidden = !evidence;
  video.hidden = true;
  video.pause();
  video.removeAttribute("src");
  if (clipUrls.has(video)) URL.revokeObjectURL(clipUrls.get(video));
  clipUrls.delete(video);
  if (!evidence) return;
  const ranges = evidence.ranges;
  const button = (label, path, cls, range) => {
    const b = el("button", label, cls);
    b.type = "button";
    if (range) [b.dataset.from, b.dataset.to] = range;
    b.addEventListener("click", () => playClip(box, b, path));
    return b;
  };
  const buttons = ranges.length === 1
    ? [button(`▶ ${fmtRange(...ranges[0])}`, evidence.clip, "clip", ranges[0])]
    : [...ranges.map((r) => button(`▶ ${fmtRange(...r)}`, clipOf(evidence.clip, r), "range", r)),
      button(`▶ in one clip: ${fmtRange(...clipSpan(evidence.clip))}`, evidence.clip, "clip")];
  box.querySelector(".ranges").replaceChildren(el("span", "seen", "muted"), ...buttons);
}

// A clip URL's span, and the same URL for another span.
function clipSpan(clip) {
  const params = new URL(clip, location.href).searchParams;
  return [Number(params.get("from")), Number(params.get("to"))];
}

function clipOf(clip, [start, end]) {
  const url = new URL(clip, location.href);
  url.searchParams.set("from", start.toFixed(3));
  url.searchParams.set("to", end.toFixed(3));
  return url.pathname + url.search;
}

async function playClip(box, button, path) {
  const video = box.querySelector("video");
  box.querySelectorAll("button[aria-current]").forEach((b) => b.removeAttribute("aria-current"));
  button.disabled = true;
  try {
    const url = URL.createObjectURL(await (await api(path)).blob());
    if (clipUrls.has(video)) URL.revokeObjectURL(clipUrls.get(video));
    clipUrls.set(video, url);
    video.src = url;
    video.hidden = false;
    button.setAttribute("aria-current", "true");
    video.play().catch(() => { /* autoplay refused: the controls are there */ });
  } catch (err) {
    button.textContent = `no clip: ${err.message}`;
  } finally {
    button.disabled = false;
  }
}

// The span control (template#span) of a search or question, put before `before`; `now`: what no
// span means there ("any time", "now (live)").
function addSpan(form, before, now) {
  const part = document.getElementById("span").content.cloneNode(true);
  part.querySelector("option").textContent = now;
  const preset = part.querySelector("select");
  const custom = part.querySelector(".custom");
  preset.addEventListener("change", () => {
    custom.hidden = preset.value !== "custom";
    if (!custom.hidden) custom.querySelector("input").focus();
  });
  form.insertBefore(part, before);
}

// since/until as the API takes them: a preset, or the free fields.
function spanOf(form) {
  const preset = form.elements.preset.value;
  if (preset !== "custom") return preset ? { since: preset } : {};
  const span = {};
  for (const name of ["since", "until"]) {
    const value = form.elements[name].value.trim();
    if (value) span[name] = withOffset(value);
  }
  return span;
}

// The API needs a time's UTC offset: one typed without it is the viewer's local time (as the CLI reads it).
const NAIVE_TIME = /^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?$/;
function withOffset(value) {
  if (!NAIVE_TIME.test(value)) return value;
  const local = value.replace(" ", "T");
  const east = -new Date(local).getTimezoneOffset(); // minutes east of UTC, at that time
  if (Number.isNaN(east)) return value; // no such day: the API says what is wrong
  const abs = Math.abs(east);
  const hhmm = `${String(Math.floor(abs / 60)).padStart(2, "0")}:${String(abs % 60).padStart(2, "0")}`;
  return `${local}${east < 0 ? "-" : "+"}${hhmm}`;
}

// A search of the cameras' past: results best first, each a moment (a camera's adjacent matching
// chunks) with its thumbnail (its best chunk's middle frame), camera, time range and score (its
// best chunk's); a result opens the dialog on its clip, playing.
const thumbnailUrls = [];
async function search(form) {
  const status = document.querySelector("#search .search-status");
  const list = document.querySelector("#search .results");
  const button = form.querySelector("button[type=submit]");
  const q = form.elements.q.value;
  const params = new URLSearchParams({ q, ...spanOf(form), limit: String(SEARCH_LIMIT) });
  if (form.elements.stream.value) params.set("stream", form.elements.stream.value);
  markInvalid(form, null);
  button.disabled = true;
  status.className = "search-status muted";
  status.textContent = "searching…";
  try {
    const found = await (await api(`/api/search?${params}`)).json();
    const took = found.elapsed_s != null ? ` · ${found.elapsed_s.toFixed(2)} s` : "";
    status.textContent = found.results.length
      ? `${found.results.length} result(s), best first${took}`
      : "nothing kept from that span: no chunk of it is indexed";
    showResults(list, found.results, q);
  } catch (err) {
    status.className = "search-status failed";
    status.textContent = err.message;
    markInvalid(form, err.param);
    showResults(list, [], q);
  } finally {
    button.disabled = false;
  }
}

function showResults(list, results, q) {
  thumbnailUrls.splice(0).forEach((url) => URL.revokeObjectURL(url));
  list.replaceChildren(...results.map((hit) => {
    const range = fmtRange(hit.start, hit.end);
    const item = el("button", undefined, "result");
    item.type = "button";
    [item.dataset.stream, item.dataset.score] = [hit.stream, hit.score];
    const img = el("img");
    img.alt = `${hit.stream}, ${range}`;
    item.append(img, el("span", hit.stream, "stream"), el("span", range, "time"),
      el("span", `score ${hit.score.toFixed(3)}`, "score"));
    const best = hit.chunks > 1 ? `, best of ${hit.chunks} chunks at ${fmtRange(hit.best_start, hit.best_end)}` : "";
    item.addEventListener("click", () => openEvidence({
      title: `${hit.stream} · ${range}`, about: `“${q}”: score ${hit.score.toFixed(3)}${best}`,
      when: `frames ${hit.first_seq}–${hit.last_seq}`, picture: hit.thumbnail,
      alt: `the frame at the middle of ${fmtRange(hit.best_start, hit.best_end)}`,
      evidence: { ranges: [[hit.start, hit.end]], clip: hit.clip },
      play: true,
    }));
    thumbnail(img, hit.thumbnail);
    const li = el("li");
    li.append(item);
    return li;
  }));
}

async function thumbnail(img, path) {
  try {
    const url = URL.createObjectURL(await (await api(path)).blob());
    thumbnailUrls.push(url);
    img.src = url;
  } catch (err) {
    img.alt = `no thumbnail: ${err.message}`;
  }
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

// What an answer saw: a live version's video, or (about the past) the ranges it was answered over.
function answerMeta(data) {
  const video = data.version != null
    ? `version ${data.version} · video ${fmtTime(data.t_start)} – ${fmtTime(data.t_end)}`
    : `the past: ${(data.ranges || []).length} range(s) of ${fmtRange(data.t_start, data.t_end)}`;
  const compute = data.first_token_s != null
    ? `first token ${(data.first_token_s * 1000).toFixed(0)} ms · ${data.tokens} tokens in ${data.total_s.toFixed(2)} s`
    : `answered in ${data.total_s.toFixed(2)} s`;
  const waited = data.queue_s != null ? ` · waited ${data.queue_s.toFixed(1)} s in the queue` : "";
  const total = data.elapsed_s != null ? ` · ${data.elapsed_s.toFixed(2)} s in all` : "";
  return `${video} · ${compute}${waited}${total}`;
}

// A question, now or (with a span, or "search the past": scope history) about the camera's past.
async function ask(name, node) {
  const form = node.querySelector("form.ask");
  const choices = form.elements.choices.value.split(",").map((c) => c.trim()).filter(Boolean);
  const button = form.querySelector("button[type=submit]");
  const answer = node.querySelector(".answer");
  const meta = node.querySelector(".answer-meta");
  answer.textContent = "";
  answer.className = "answer streaming";
  meta.textContent = "";
  showEvidence(node.querySelector(".evidence"), null);
  markInvalid(form, null);
  button.disabled = true;
  const body = {
    question: form.elements.question.value, stream: true, ...spanOf(form),
    ...(choices.length ? { choices } : {}), ...(form.elements.scope.checked ? { scope: "history" } : {}),
  };
  try {
    const res = await api(`/api/streams/${encodeURIComponent(name)}/ask`, {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(body),
    });
    for await (const { event, data } of sseEvents(res)) {
      if (event === "queued") {
        const left = data.wait_s == null ? "" : ` · about ${data.wait_s.toFixed(0)} s to go`;
        meta.textContent = `waiting: ${ordinal(data.position)} in the queue · ${data.waited_s.toFixed(0)} s so far${left}`;
      } else if (event === "delta") {
        if (!answer.textContent) meta.textContent = "";
        answer.textContent += data.text;
      }
      else if (event === "restart") answer.textContent = ""; // its worker died: another answers from the start
      else if (event === "final") {
        if (data.error) throw failure(data.error, data.param);
        answer.textContent = data.text;
        if (data.scores) {
          const box = el("div", undefined, "scores");
          renderScores(box, data);
          answer.append(box);
        }
        meta.textContent = answerMeta(data);
        showEvidence(node.querySelector(".evidence"), data.evidence);
        node.dataset.answered = "1";
      } else if (event === "error") throw failure(data.error.message, data.error.param);
    }
    answer.className = "answer";
  } catch (err) {
    answer.className = "answer failed";
    answer.textContent = err.message;
    markInvalid(form, err.param);
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
  const searchForm = document.querySelector("form.search");
  addSpan(searchForm, searchForm.querySelector("button[type=submit]"), "any time");
  searchForm.addEventListener("submit", (e) => { e.preventDefault(); search(searchForm); });
  const dialog = document.getElementById("evidence-dialog");
  dialog.addEventListener("close", () => dialog.querySelector("video").pause());
  every(REFRESH.status, refreshStatus);
  every(REFRESH.alerts, refreshAlerts);
  setInterval(() => cards.forEach((_, name) => refreshFrame(name)), REFRESH.frame);
  setInterval(() => cards.forEach((_, name) => refreshTranscript(name)), REFRESH.transcript);
});
