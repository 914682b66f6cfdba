// glassgpt view: the page's script. Plain JavaScript, no build step, nothing fetched from
// another site. Every number comes from the JSON API of the same server (see server.py).
"use strict";

const $ = (id) => document.getElementById(id);
const ZOOMS = [4, 6, 8, 10, 12, 14, 18, 24]; // pixels per token in an attention map
const LABEL_FONT = "12px ui-monospace, 'DejaVu Sans Mono', Menlo, monospace";
const LABEL_PX = 14; // a row needs this much height for its label to be drawn
const MAX_LABEL_PX = 90;
const LEGEND_PX = 34; // room under a map for its colour legend
// One colour per head (head view, thumbnails' titles), repeating past 12 heads.
const HEAD_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf",
  "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#393b79", "#637939"];

const state = {
  card: null,
  tokens: [], // [{id, text}]
  selected: null, // the position followed in every panel
  layer: 0,
  head: "all",
  zoom: { one: ZOOMS.indexOf(14), all: null }, // null: fit the prompt
  k: 5,
  predictions: null,
  attention: null,
  kind: "weights", // the attention maps show weights (after the softmax) or scores (before)
  attends: null, // the selected token in every layer and head (the head view draws it)
  overview: null,
  inside: { layer: 0, head: 0 },
  // Switched off in the Ablation panel: "layer,head" for heads, layer numbers for the rest.
  ablation: { heads: new Set(), attention: new Set(), mlp: new Set() },
  ablated: null,
  patching: null, // the last answer of the Patching panel
  attribution: null, // {answer, all}: the Attribution panel's answer, all its rows or the top
  generation: 0, // bumps on every prompt change; answers for older prompts are dropped
  sampler: null, // AbortController of the running sample
  step: null, // the Timeline's snapshot step the panels show (null: the run's own weights)
};

// The requests that answer for the Timeline's step (timeline.js): every panel that reads the
// model, except Features, Graph and Compare, which stay on the run's own weights.
const AT_STEP = new Set(["predictions", "attention", "overview", "attends", "head", "ablate",
  "mlp", "patching", "attribution", "sample"]);

// --- helpers ---------------------------------------------------------------------------------

async function api(name, body) {
  if (body !== undefined && state.step !== null && AT_STEP.has(name)) {
    body = { ...body, step: state.step };
  }
  const response = await fetch(`/api/${name}`, {
    method: body === undefined ? "GET" : "POST",
    headers: body === undefined ? {} : { "Content-Type": "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(data.error || `the server answered ${response.status}`);
  return data;
}

// Whitespace made visible, so a space or a newline token can be seen and clicked.
function visible(text) {
  if (text === "") return "∅";
  return text.replace(/ /g, "␣").replace(/\n/g, "⏎").replace(/\t/g, "⇥");
}

// Arrays that grow with the prompt, the model's width or the run (tokens, a vector, a matrix,
// the training log) are never spread into a call: Math.max(...values) or el("tr", {}, ...cells)
// passes each item as an argument, and Chromium takes about 65,536 (a 0.6B model's W_O slice,
// 128 x 1024 values, threw "Maximum call stack size exceeded" and the page stopped drawing).
// Such arrays go to `largest`, `smallest`, `maxAbs` and `fill`, or to `el` as one array.

function largest(values, floor = -Infinity) {
  let most = floor;
  for (const v of values) if (v > most) most = v;
  return most;
}

function smallest(values) {
  let least = Infinity;
  for (const v of values) if (v < least) least = v;
  return least;
}

// The largest magnitude in an array of numbers, or of rows of numbers; at least `floor`.
function maxAbs(values, floor = 0) {
  let most = floor;
  for (const v of values) {
    const size = Array.isArray(v) ? maxAbs(v) : Math.abs(v);
    if (size > most) most = size;
  }
  return most;
}

// `node`'s children replaced by `children` (an array of any length).
function fill(node, children) {
  const fragment = document.createDocumentFragment();
  for (const child of children) fragment.append(child);
  node.replaceChildren(fragment);
}

// A new element; a child may be an array of children (of any length: appended one by one).
function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    // Through the CSSOM: the page's security policy refuses style="..." attributes.
    else if (key === "style") Object.assign(node.style, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (Array.isArray(child)) for (const each of child) node.append(each);
    else node.append(child);
  }
  return node;
}

function fmt(p) { return p.toFixed(3); }
function integer(n) { return n.toLocaleString("en-US"); }

// Light to dark blue: weight or probability 0..1 as a colour.
function shade(w) {
  const t = Math.max(0, Math.min(1, w));
  const from = [247, 251, 255], to = [8, 48, 107];
  const c = from.map((f, i) => Math.round(f + (to[i] - f) * Math.sqrt(t)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}
function inkOn(w) { return Math.sqrt(w) > 0.55 ? "#fff" : "#1d2430"; }

// A value of a vector: blue for positive, red for negative, white at 0 (scale: the largest
// magnitude shown beside it).
function diverging(v, scale) {
  const t = Math.max(-1, Math.min(1, scale > 0 ? v / scale : 0));
  const to = t >= 0 ? [33, 102, 172] : [178, 24, 43];
  const c = [255, 255, 255].map((f, i) => Math.round(f + (to[i] - f) * Math.sqrt(Math.abs(t))));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// Masked cells (the future a causal model cannot see): grey hatching, never a colour of the
// scale, so a weight of 0 and a masked cell cannot be mistaken for one another.
function maskPattern(ctx) {
  const tile = document.createElement("canvas");
  tile.width = tile.height = 6;
  const t = tile.getContext("2d");
  t.fillStyle = "#e4e7ec";
  t.fillRect(0, 0, 6, 6);
  t.strokeStyle = "#a3abb8";
  t.lineWidth = 1;
  t.beginPath();
  t.moveTo(0, 6); t.lineTo(6, 0);
  t.moveTo(-1, 1); t.lineTo(1, -1);
  t.moveTo(5, 7); t.lineTo(7, 5);
  t.stroke();
  return ctx.createPattern(tile, "repeat");
}

// The colour of a map's value on its scale: weights 0..1, scores from their min to max.
function mapShade(v, scale) {
  const span = scale.max - scale.min;
  return shade(span > 0 ? (v - scale.min) / span : 0);
}

// A colour legend drawn under a map at (x, y): the scale's gradient with its ends and middle
// written out, and the masked swatch.
function drawLegend(ctx, x, y, scale, what) {
  const width = 120, height = 10;
  for (let i = 0; i < width; i++) {
    ctx.fillStyle = shade(i / (width - 1));
    ctx.fillRect(x + i, y, 1, height);
  }
  ctx.strokeStyle = "#9aa3b0";
  ctx.strokeRect(x + 0.5, y + 0.5, width - 1, height - 1);
  ctx.font = LABEL_FONT;
  ctx.fillStyle = "#1d2430";
  ctx.textBaseline = "top";
  const mid = (scale.min + scale.max) / 2;
  const label = (v) => (what === "weights" ? v.toFixed(1) : v.toFixed(2));
  ctx.textAlign = "left";
  ctx.fillText(label(scale.min), x, y + height + 3);
  ctx.textAlign = "center";
  ctx.fillText(label(mid), x + width / 2, y + height + 3);
  ctx.textAlign = "right";
  ctx.fillText(label(scale.max), x + width, y + height + 3);
  ctx.fillStyle = maskPattern(ctx);
  ctx.fillRect(x + width + 14, y, 14, height);
  ctx.strokeRect(x + width + 14.5, y + 0.5, 13, height - 1);
  ctx.fillStyle = "#1d2430";
  ctx.textAlign = "left";
  ctx.textBaseline = "middle";
  ctx.fillText(`masked · ${what}`, x + width + 32, y + height / 2);
}

function debounce(fn, ms) {
  let timer = null;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), ms); };
}

// --- the prompt and its tokens ---------------------------------------------------------------

const PANELS = ["attention-section", "overview-section", "head-section", "mlp-section",
  "predictions-section", "ablation-section", "attribution-section"];

function showPromptError(message) {
  const box = $("prompt-error");
  box.textContent = message || "";
  box.hidden = !message;
  if (message) {
    // The old prompt's count and chips would say the rejected text was understood.
    $("prompt-status").textContent = "";
    $("tokens").replaceChildren();
  }
  for (const id of PANELS) $(id).classList.toggle("stale", Boolean(message));
}

function showError(id, message) {
  $(id).textContent = message || "";
  $(id).hidden = !message;
}

async function promptChanged() {
  const generation = ++state.generation;
  const prompt = $("prompt").value;
  try {
    const answer = await api("tokenize", { prompt });
    if (generation !== state.generation) return;
    if (!keepsSelection(state.tokens, answer.tokens, state.selected)) {
      state.selected = answer.tokens.length - 1;
    }
    state.tokens = answer.tokens;
    showPromptError("");
    $("prompt-status").textContent =
      `${answer.tokens.length} of ${answer.block_size} tokens`;
    renderTokens();
    await Promise.all([loadAttention(generation), loadPredictions(generation),
      loadAttends(generation), loadOverview(generation), loadInside(generation),
      loadMlp(generation), loadAblation(generation), loadAttribution(generation),
      loadFeatures(generation)]);
  } catch (error) {
    if (generation === state.generation) showPromptError(error.message);
  }
}

// The selected token stays selected while the prompt up to it is unchanged (typing on at the
// end); a new prompt starts at its last token, as the first one did (a position chosen in the
// old prompt means nothing in the new one).
function keepsSelection(before, after, selected) {
  if (selected === null || selected >= after.length || selected >= before.length) return false;
  for (let i = 0; i <= selected; i++) if (before[i].id !== after[i].id) return false;
  return true;
}

function renderTokens() {
  const box = $("tokens");
  fill(box, state.tokens.map((token, i) => el("span", {
    class: "chip" + (i === state.selected ? " selected" : ""),
    title: `position ${i} · id ${token.id}`,
    dataset: { pos: i, id: token.id },
    onclick: () => select(i),
  }, visible(token.text))));
}

function select(position) {
  if (position === state.selected || position < 0 || position >= state.tokens.length) return;
  state.selected = position;
  renderTokens();
  renderAttention();
  renderPredictions();
  renderAblation();
  loadAttends(state.generation).catch((e) => showPromptError(e.message));
  loadInside(state.generation).catch((e) => showPromptError(e.message));
  loadMlp(state.generation).catch((e) => showPromptError(e.message));
  loadAttribution(state.generation).catch((e) => showPromptError(e.message));
  loadFeatures(state.generation).catch((e) => showPromptError(e.message));
}

function tokenName(i) { return `'${visible(state.tokens[i].text)}' (position ${i})`; }

// A layer as the page names it: with a sliding window anywhere in the model, whether this
// layer is local (its query sees W keys) or global (every earlier key).
function layerName(layer) {
  const kinds = (state.card && state.card.layers) || [];
  if (!kinds.some((k) => k.window !== null)) return `layer ${layer}`;
  const kind = kinds[layer];
  return kind.window === null ? `layer ${layer} · global` : `layer ${layer} · local, window ${kind.window}`;
}

// --- attention maps --------------------------------------------------------------------------

function fillLayerAndHead() {
  const m = state.card.model;
  const { n_layer: L, n_head: H } = m;
  $("layer").replaceChildren(...Array.from({ length: L }, (_, l) =>
    el("option", { value: l }, layerName(l))));
  $("head").replaceChildren(el("option", { value: "all" }, "all heads"),
    ...Array.from({ length: H }, (_, h) => el("option", { value: h }, `head ${h}`)));
  // Every head at once is the default while a full context's maps stay small to send (about
  // 200k weights for shakespeare-char); a GPT-2-sized model starts with one head.
  const weights = H * m.block_size * (m.block_size + 1) / 2;
  state.head = weights <= 400000 ? "all" : 0;
  $("head").value = String(state.head);
  $("inside-layer").replaceChildren(...Array.from({ length: L }, (_, l) =>
    el("option", { value: l }, layerName(l))));
  $("inside-head").replaceChildren(...Array.from({ length: H }, (_, h) =>
    el("option", { value: h }, `head ${h}`)));
  renderSwitches();
}

async function loadAttention(generation) {
  const body = { prompt: $("prompt").value, layer: state.layer,
    head: state.head === "all" ? null : state.head, kind: state.kind };
  const answer = await api("attention", body);
  if (generation !== state.generation) return;
  state.attention = answer;
  renderAttention();
}

function cellSize() {
  const mode = state.head === "all" ? "all" : "one";
  if (state.zoom[mode] === null) {
    // Two heads across the page; labels thin out instead of shrinking.
    const across = ($("attention").clientWidth || 1100) / 2 - 80;
    const fit = Math.floor(across / Math.max(1, state.tokens.length));
    state.zoom[mode] = Math.max(0, ZOOMS.filter((z) => z <= Math.max(fit, ZOOMS[0])).length - 1);
  }
  return ZOOMS[state.zoom[mode]];
}

function zoom(step) {
  const mode = state.head === "all" ? "all" : "one";
  cellSize();
  state.zoom[mode] = Math.max(0, Math.min(ZOOMS.length - 1, state.zoom[mode] + step));
  renderAttention();
}

function renderAttention() {
  const answer = state.attention;
  const box = $("attention");
  if (!answer || answer.weights[0].length !== state.tokens.length) return;
  const cell = cellSize();
  $("zoom-level").textContent = `${cell} px`;
  const labels = state.tokens.map((t) => visible(t.text));
  box.replaceChildren(...answer.heads.map((head, i) => {
    const canvas = drawMap(answer.weights[i], labels, cell, answer.scale, answer.kind);
    canvas.addEventListener("mousemove", (e) => hoverMap(e, canvas, answer, i));
    canvas.addEventListener("mouseleave", () => { $("attention-readout").textContent = ""; });
    canvas.addEventListener("click", (e) => {
      const at = mapCell(e, canvas);
      if (at) select(at.row);
    });
    const shared = answer.kv_head_of[i] !== head || state.card.model.n_kv_head
      ? ` · K/V head ${answer.kv_head_of[i]}` : "";
    return el("div", { class: "map-panel", dataset: { head } },
      el("p", { class: "panel-title" }, `${layerName(answer.layer)}, head ${head}${shared}`),
      canvas);
  }));
  box.dataset.kind = answer.kind;
  box.dataset.layer = answer.layer;
  box.dataset.head = answer.heads.length === 1 ? answer.heads[0] : "all";
}

// add(tag, attributes, text): a new SVG element appended to `svg`, returned.
function svgAppender(svg) {
  return (tag, attrs, text) => {
    const node = document.createElementNS(svg.namespaceURI, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    svg.append(node);
    return node;
  };
}

// A canvas of width x height CSS pixels, drawn at the screen's own resolution; its context.
function sharpCanvas(canvas, width, height) {
  const ratio = window.devicePixelRatio || 1;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  return ctx;
}

// One attention map on a canvas: token labels left (queries) and on top (keys), a cell per
// (query, key), the future hatched, and on a local layer the keys outside its window too (sent
// as null: hidden, not a weight of 0), the selected row outlined.
function drawMap(rows, labels, cell, scale = { min: 0, max: 1 }, what = "weights") {
  const T = labels.length;
  const canvas = document.createElement("canvas");
  const ctx = canvas.getContext("2d");
  ctx.font = LABEL_FONT;
  const widest = Math.min(MAX_LABEL_PX, largest(labels.map((s) => ctx.measureText(s).width)));
  const upright = labels.every((s) => [...s].length === 1);
  const left = Math.ceil(widest) + 10;
  const top = upright ? 20 : Math.ceil(widest) + 10;
  const width = Math.max(left + T * cell + 4, left + 290);
  const height = top + T * cell + 4 + LEGEND_PX;
  sharpCanvas(canvas, width, height);  // resizing resets the context; drawLabels sets the font
  Object.assign(canvas.dataset, { left, top, cell, tokens: T });
  ctx.fillStyle = maskPattern(ctx);
  ctx.fillRect(left, top, T * cell, T * cell);
  for (let q = 0; q < T; q++) {
    for (let k = 0; k <= q; k++) {
      if (rows[q][k] === null) continue; // outside the window: the hatching shows through
      ctx.fillStyle = mapShade(rows[q][k], scale);
      ctx.fillRect(left + k * cell, top + q * cell, cell, cell);
    }
  }
  drawLabels(ctx, labels, { left, top, cell, upright });
  drawLegend(ctx, left, top + T * cell + 10, scale, what);
  if (state.selected !== null && state.selected < T) {
    ctx.strokeStyle = "#d9480f";
    ctx.lineWidth = 2;
    ctx.strokeRect(left - 1, top + state.selected * cell, T * cell + 2, cell);
  }
  return canvas;
}

function drawLabels(ctx, labels, { left, top, cell, upright }) {
  const step = Math.ceil(LABEL_PX / cell); // thin the labels out, never shrink them
  ctx.font = LABEL_FONT;
  ctx.fillStyle = "#1d2430";
  ctx.textBaseline = "middle";
  for (let i = 0; i < labels.length; i += step) {
    const text = clip(ctx, labels[i]);
    const mid = i * cell + cell / 2;
    ctx.textAlign = "right";
    ctx.fillText(text, left - 5, top + mid);
    if (upright) {
      ctx.textAlign = "center";
      ctx.fillText(text, left + mid, top - 10);
    } else {
      ctx.save();
      ctx.translate(left + mid, top - 5);
      ctx.rotate(-Math.PI / 2);
      ctx.textAlign = "left";
      ctx.fillText(text, 0, 0);
      ctx.restore();
    }
  }
}

function clip(ctx, text) {
  if (ctx.measureText(text).width <= MAX_LABEL_PX) return text;
  let cut = text;
  while (cut.length > 1 && ctx.measureText(cut + "…").width > MAX_LABEL_PX) cut = cut.slice(0, -1);
  return cut + "…";
}

function mapCell(event, canvas) {
  const { left, top, cell, tokens } = canvas.dataset;
  const box = canvas.getBoundingClientRect();
  const col = Math.floor((event.clientX - box.left - left) / cell);
  const row = Math.floor((event.clientY - box.top - top) / cell);
  if (row < 0 || col < 0 || row >= +tokens || col >= +tokens) return null;
  return { row, col };
}

function hoverMap(event, canvas, answer, i) {
  const at = mapCell(event, canvas);
  const readout = $("attention-readout");
  if (!at) { readout.textContent = ""; return; }
  const head = `layer ${answer.layer} head ${answer.heads[i]}`;
  const what = answer.kind === "weights" ? "weight" : "score";
  const value = at.col > at.row ? null : answer.weights[i][at.row][at.col];
  if (at.col > at.row) {
    readout.textContent = `${head}: ${tokenName(at.row)} cannot see the later ` +
      `${tokenName(at.col)} (masked)`;
  } else if (value === null) {
    readout.textContent = `${head}: ${tokenName(at.row)} cannot see ${tokenName(at.col)}, ` +
      `${at.row - at.col} back: a local layer sees the last ${answer.window} keys (masked)`;
  } else {
    readout.textContent = `${head}: ${tokenName(at.row)} → ${tokenName(at.col)}: ${what} ` +
      `${fmt(value)}`;
  }
}

// --- what one token attends to, everywhere ---------------------------------------------------

async function loadAttends(generation) {
  if (state.selected === null) return;
  const position = state.selected;
  const answer = await api("attends", { prompt: $("prompt").value, position });
  if (generation !== state.generation || position !== state.selected) return;
  state.attends = answer;
  renderAttends(answer);
  renderHeadView();
}

function renderAttends(answer) {
  const p = answer.position;
  $("attends-title").textContent =
    `What ${tokenName(p)} attends to, in every layer and head (its three strongest keys)`;
  const H = answer.weights[0].length;
  const head = el("tr", {}, el("th", {}, ""),
    ...Array.from({ length: H }, (_, h) => el("th", {}, `head ${h}`)));
  const rows = answer.weights.map((heads, layer) => el("tr", {},
    el("th", {}, layerName(layer)),
    ...heads.map((weights) => el("td", {}, strip(weights), topKeys(weights)))));
  $("attends").replaceChildren(legendCanvas(), el("table", { class: "attends" }, head, ...rows));
  $("attends").dataset.position = p;
}

// A heat strip of one attention row: keys 0..p left to right (hatched: outside a local
// layer's window).
function strip(weights) {
  const width = 176, height = 12;
  const canvas = document.createElement("canvas");
  const ctx = sharpCanvas(canvas, width, height);
  const step = width / weights.length;
  const hidden = maskPattern(ctx);
  weights.forEach((w, k) => {
    ctx.fillStyle = w === null ? hidden : shade(w);
    ctx.fillRect(k * step, 0, Math.max(step, 1), height);
  });
  ctx.strokeStyle = "#d9dee6";
  ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
  return canvas;
}

function topKeys(weights) {
  const order = weights.map((w, k) => [w, k]).filter(([w]) => w !== null)
    .sort((a, b) => b[0] - a[0]).slice(0, 3);
  const lines = order.map(([w, k]) =>
    `${fmt(w)} ${visible(state.tokens[k].text).padEnd(2)} @${k}`);
  return el("div", { class: "top" }, lines.join("\n"));
}

// --- predictions and the logit lens ----------------------------------------------------------

async function loadPredictions(generation) {
  const body = { prompt: $("prompt").value, k: state.k,
    temperature: numberOrNull("dist-temperature") ?? state.card.sampling.predictions.temperature,
    top_k: numberOrNull("dist-top-k") };
  let answer;
  try {
    answer = await api("predictions", body);
  } catch (error) {
    if (generation !== state.generation) return;
    // A temperature or top-k the server refuses: said beside them, the prompt is fine.
    if (!/temperature|top_k/.test(error.message)) throw error;
    showError("predictions-error", error.message);
    return;
  }
  if (generation !== state.generation) return;
  showError("predictions-error", "");
  state.predictions = answer;
  renderPredictions();
  renderLensGrid();
}

function piece(id) { return visible(state.predictions.pieces[id]); }

function renderPredictions() {
  const P = state.predictions;
  const p = state.selected;
  if (!P || P.ids[0].length !== state.tokens.length || p === null) return;
  const last = P.ids.length - 1;
  const S = P.sampling;
  const settings = S.temperature === 1 && S.top_k === null ? ""
    : ` (sampling at temperature ${S.temperature}${S.top_k === null ? "" : `, top-k ${S.top_k}`})`;
  $("next-title").textContent = `After ${tokenName(p)} the model predicts${settings}`;
  $("next-tokens").replaceChildren(...S.ids[p].map((id, j) => {
    const prob = S.probs[p][j];
    return el("tr", {},
      el("td", { class: "tok" }, piece(id)),
      el("td", { class: "bar-cell" }, barOf(prob)),
      el("td", { class: "num prob" }, fmt(prob)));
  }));
  $("lens-title").textContent = `Logit lens at position ${p}`;
  $("lens-position").replaceChildren(...P.layers.map((name, l) => el("tr", {},
    el("th", {}, l === last ? `${name} (output)` : name),
    el("td", {}, ...P.ids[l][p].map((id, j) => lensToken(id, P.probs[l][p][j]))))));
  for (const cell of document.querySelectorAll(".lens-grid .selected")) {
    cell.classList.remove("selected");
  }
  for (const cell of document.querySelectorAll(`.lens-grid [data-pos="${p}"]`)) {
    cell.classList.add("selected");
  }
  revealColumn(document.querySelector(`.lens-grid thead [data-pos="${p}"]`));
}

// Scroll the lens grid sideways (never the page) until the selected column is in view.
function revealColumn(cell) {
  if (!cell) return;
  const box = $("lens-grid");
  const view = box.getBoundingClientRect(), at = cell.getBoundingClientRect();
  if (at.left < view.left + 100 || at.right > view.right) {
    box.scrollLeft += at.left - view.left - box.clientWidth / 2;
  }
}

function barOf(prob, kind = "") {
  return el("div", { class: `bar ${kind}`, style: { width: `${Math.max(0.5, prob * 100)}%` } });
}

function lensToken(id, prob) {
  return el("span", { class: "lens-tok", title: fmt(prob),
    style: { background: shade(prob), color: inkOn(prob) } }, `${piece(id)} ${fmt(prob)}`);
}

function renderLensGrid() {
  const P = state.predictions;
  const T = state.tokens.length;
  const last = P.ids.length - 1;
  const header = el("tr", {}, el("th", { class: "layer" }, "prompt"),
    state.tokens.map((t, i) => el("th", { dataset: { pos: i }, title: `position ${i}`,
      onclick: () => select(i) }, visible(t.text))));
  const body = [];
  for (let l = last; l >= 0; l--) {
    const name = l === last ? `${P.layers[l]} (output)` : P.layers[l];
    body.push(el("tr", {}, el("th", { class: "layer" }, name),
      Array.from({ length: T }, (_, i) => lensCell(P, l, i))));
  }
  body.push(el("tr", { class: "actual" }, el("th", { class: "layer" }, "actual next"),
    state.tokens.map((_, i) => (i + 1 < T
      ? el("td", { dataset: { pos: i } }, visible(state.tokens[i + 1].text))
      : el("td", { class: "none", dataset: { pos: i },
        title: "the prompt ends here: no next token to compare with" }, "")))));
  $("lens-grid").replaceChildren(el("table", { class: "lens-grid" },
    el("thead", {}, header), el("tbody", {}, ...body)));
  renderPredictions(); // re-marks the selected column
}

function lensCell(P, l, i) {
  const id = P.ids[l][i][0];
  const prob = P.probs[l][i][0];
  const next = i + 1 < state.tokens.length ? state.tokens[i + 1].id : null;
  const tops = P.ids[l][i].map((t, j) => `${piece(t)}  ${fmt(P.probs[l][i][j])}`).join("\n");
  return el("td", {
    class: id === next ? "hit" : "",
    title: `${P.layers[l]}, position ${i}\n${tops}`,
    style: { background: shade(prob), color: inkOn(prob) },
    dataset: { pos: i },
    onclick: () => select(i),
  }, piece(id));
}

// --- every layer and head at once -----------------------------------------------------------

async function loadOverview(generation) {
  const answer = await api("overview", { prompt: $("prompt").value });
  if (generation !== state.generation) return;
  state.overview = answer;
  renderOverview();
}

function renderOverview() {
  const O = state.overview;
  if (!O) return;
  const n = O.cells;
  const px = Math.max(2, Math.floor(96 / n));
  const H = O.weights[0].length;
  const header = el("tr", {}, el("th", {}, ""),
    ...Array.from({ length: H }, (_, h) => el("th", {}, `head ${h}`)));
  const rows = O.weights.map((heads, layer) => el("tr", {}, el("th", {}, layerName(layer)),
    ...heads.map((rows, head) => el("td", {}, thumbnail(rows, n, px, layer, head),
      ...scoreBadges(O.scores, layer, head)))));
  const legend = legendCanvas();
  const note = O.pooled ? `each cell averages ${Math.ceil(O.tokens / n)} tokens` : "";
  $("badges-note").textContent = badgesNote(O.scores);
  $("overview").replaceChildren(legend, el("p", { class: "hint" }, note),
    el("table", { class: "overview" }, header, ...rows));
}

// A colour legend on its own (for the thumbnails and the strips, which share one scale).
function legendCanvas(scale = { min: 0, max: 1 }, what = "weights") {
  const legend = document.createElement("canvas");
  legend.className = "legend";
  const ctx = sharpCanvas(legend, 300, 30);
  drawLegend(ctx, 2, 2, scale, what);
  return legend;
}

function thumbnail(rows, n, px, layer, head) {
  const canvas = document.createElement("canvas");
  const ctx = sharpCanvas(canvas, n * px, n * px);
  ctx.fillStyle = maskPattern(ctx);
  ctx.fillRect(0, 0, n * px, n * px);
  rows.forEach((row, q) => row.forEach((w, k) => {
    if (w === null) return; // a block a local layer's window hides: hatched
    ctx.fillStyle = shade(w);
    ctx.fillRect(k * px, q * px, px, px);
  }));
  Object.assign(canvas.dataset, { layer, head });
  canvas.className = "thumb";
  canvas.title = `layer ${layer}, head ${head}: click to open`;
  canvas.addEventListener("click", () => openHead(layer, head));
  return canvas;
}

// A thumbnail clicked: that head in the attention panel and inside-one-head panel.
function openHead(layer, head) {
  state.layer = layer;
  state.head = head;
  $("layer").value = String(layer);
  $("head").value = String(head);
  state.inside = { layer, head };
  $("inside-layer").value = String(layer);
  $("inside-head").value = String(head);
  const generation = state.generation;
  Promise.all([loadAttention(generation), loadInside(generation), loadMlp(generation)])
    .then(() => {
      renderHeadView();
      $("attention-section").scrollIntoView();
    }).catch((e) => showPromptError(e.message));
}

// The head view: the selected token on the left, every key it can see on the right, a line
// per head whose darkness is its weight (the layer of the attention panel).
function renderHeadView() {
  const A = state.attends;
  if (!A || A.position >= state.tokens.length) return;
  const p = A.position;
  const heads = A.weights[state.layer];
  const rowPx = 18, left = 130, right = 330, width = 470;
  const height = rowPx * (p + 1) + 10;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.dataset.layer = state.layer;
  svg.dataset.position = p;
  const add = svgAppender(svg);
  const y = (i) => 14 + i * rowPx;
  for (let i = 0; i <= p; i++) {
    const label = visible(state.tokens[i].text);
    add("text", { x: left - 8, y: y(i) + 4, "text-anchor": "end",
      class: i === p ? "query" : "faint" }, label);
    add("text", { x: right + 8, y: y(i) + 4, "text-anchor": "start" }, label);
  }
  // Each head has its own lane across a row, so heads that attend to the same key draw side
  // by side instead of on top of each other (one colour would hide the others).
  const lane = Math.min(6, (rowPx - 2) / heads.length);
  const offset = (h) => (h - (heads.length - 1) / 2) * lane;
  heads.forEach((weights, h) => weights.forEach((w, k) => {
    if (w === null || w < 0.01) return; // null: outside a local layer's window
    const line = add("line", { x1: left, y1: y(p) + offset(h), x2: right, y2: y(k) + offset(h),
      stroke: HEAD_COLOURS[h % HEAD_COLOURS.length],
      "stroke-width": Math.max(1, lane * (0.3 + 0.6 * w)),
      "stroke-opacity": Math.min(1, 0.15 + w), "data-head": h, "data-key": k });
    line.append(document.createElementNS(ns, "title"));
    line.lastChild.textContent = `head ${h} → ${tokenName(k)}: ${fmt(w)}`;
  }));
  $("head-view-title").textContent = `Head view: ${tokenName(p)} in layer ${state.layer}`;
  $("head-view-legend").replaceChildren(...heads.map((_, h) => el("span", { class: "swatch",
    style: { borderColor: HEAD_COLOURS[h % HEAD_COLOURS.length] } }, `head ${h}`)));
  $("head-view").replaceChildren(svg);
}

// --- inside one head -------------------------------------------------------------------------

async function loadInside(generation) {
  if (state.selected === null) return;
  const position = state.selected;
  const { layer, head } = state.inside;
  const answer = await api("head", { prompt: $("prompt").value, layer, head, position });
  if (generation !== state.generation || position !== state.selected) return;
  renderInside(answer);
}

const VECTOR_SHOWN = 12; // values of a vector written out; hover for the rest

function renderInside(answer) {
  const p = answer.position;
  const grouped = answer.n_kv_head < state.card.model.n_head
    ? ` · shares K/V head ${answer.kv_head} with heads ${sharing(answer)}` : "";
  $("inside-query").textContent =
    `query ${tokenName(p)} · ${layerName(answer.layer)}, head ${answer.head} · ` +
    `d = ${answer.head_dim}` + grouped +
    (answer.window === null ? "" : ` · sees keys ${answer.first_key}..${p}`) +
    (answer.softcap === null ? "" : ` · scores soft-capped at ±${answer.softcap}`);
  $("inside").replaceChildren(...answer.steps.map((step) => stepItem(step, p, answer.first_key)));
  $("inside").dataset.layer = answer.layer;
  $("inside").dataset.head = answer.head;
  $("inside").dataset.position = p;
}

function sharing(answer) {
  const group = state.card.model.n_head / answer.n_kv_head;
  const first = answer.kv_head * group;
  return Array.from({ length: group }, (_, i) => first + i).join(", ");
}

function stepBody(step, p, first = 0) {
  if (["scores", "weights", "mask"].includes(step.name)) return keyTable(step, p, first);
  if (step.shape.length === 2) return matrix(step);
  return vectorCells(step.values);
}

function vectorCells(values) {
  const scale = maxAbs(values, 1e-9);
  const shown = values.slice(0, VECTOR_SHOWN).map((v) => el("span", { class: "num-cell",
    dataset: { value: v }, style: { background: diverging(v, scale) } }, v.toFixed(3)));
  const more = values.length > VECTOR_SHOWN
    ? [el("span", { class: "more" }, `… ${values.length - VECTOR_SHOWN} more`)] : [];
  return el("div", { class: "vector", title: values.map((v) => v.toFixed(4)).join(" ") },
    ...shown, ...more);
}

// Scores, mask and weights: one column per key the query can see, from `first` on (the mask:
// every key).
function keyTable(step, p, first = 0) {
  const from = step.name === "mask" ? 0 : first;
  const keys = step.values.map((_, i) => el("th", { title: `position ${i + from}` },
    visible(state.tokens[i + from].text)));
  const cells = step.values.map((v, i) => {
    const k = i + from;
    if (step.name === "mask") {
      return el("td", { class: v ? "seen" : "masked", dataset: { value: v } },
        v ? "sees" : "masked");
    }
    const style = step.name === "weights"
      ? { background: shade(v), color: inkOn(v) } : {};
    return el("td", { dataset: { value: v }, style, class: k === p ? "self" : "" },
      v.toFixed(3));
  });
  // In a box of its own that scrolls sideways: a long prompt's row of keys is wider than the
  // card, and the page itself must never scroll sideways.
  return el("div", { class: "keys-box" },
    el("table", { class: "keys" }, el("tr", {}, keys), el("tr", {}, cells)));
}

// Keys, values (rows: the keys' tokens) and the head's slice of W_O as a heat map.
function matrix(step) {
  const [rows, cols] = step.shape;
  const px = Math.max(2, Math.min(10, Math.floor(480 / cols)));
  const rowPx = Math.max(2, Math.min(12, Math.floor(240 / rows)));
  const canvas = document.createElement("canvas");
  const ctx = sharpCanvas(canvas, cols * px, rows * rowPx);
  const scale = maxAbs(step.values, 1e-9);
  step.values.forEach((row, r) => row.forEach((v, c) => {
    ctx.fillStyle = diverging(v, scale);
    ctx.fillRect(c * px, r * rowPx, px, rowPx);
  }));
  const what = step.name === "w_o" ? "rows: the head's d outputs · columns: the residual width"
    : "rows: the keys the query sees, oldest first · columns: the head width d";
  return el("div", { class: "matrix" }, canvas, el("p", { class: "hint" },
    `${what} · blue > 0 > red, ±${scale.toFixed(3)} at the ends`));
}

// --- ablation --------------------------------------------------------------------------------

function renderSwitches() {
  const { n_layer: L, n_head: H } = state.card.model;
  const rows = Array.from({ length: L }, (_, layer) => el("tr", {},
    el("th", {}, `layer ${layer}`),
    el("td", {}, switchButton("attention", layer, null, "attention")),
    el("td", {}, state.card.model.attn_only ? "none" // an attention-only model
      : switchButton("mlp", layer, null, "MLP")),
    el("td", {}, ...Array.from({ length: H }, (_, head) =>
      switchButton("head", layer, head, `h${head}`)))));
  $("ablation-switches").replaceChildren(el("table", { class: "switch-table" },
    el("tr", {}, el("th", {}, ""), el("th", {}, "whole attention"), el("th", {}, "whole MLP"),
      el("th", {}, "heads")), ...rows));
}

function switchButton(kind, layer, head, label) {
  return el("button", { type: "button", class: "switch", "aria-pressed": "false",
    title: `switch ${kind === "head" ? `head ${head} of layer ${layer}` : `layer ${layer}'s ${label}`} off`,
    dataset: { kind, layer, head: head === null ? "" : head },
    onclick: (event) => toggleSwitch(event.currentTarget) }, label);
}

function toggleSwitch(button) {
  const { kind, layer, head } = button.dataset;
  const set = kind === "head" ? state.ablation.heads : state.ablation[kind];
  const key = kind === "head" ? `${layer},${head}` : Number(layer);
  if (set.has(key)) set.delete(key); else set.add(key);
  button.setAttribute("aria-pressed", String(set.has(key)));
  button.classList.toggle("off", set.has(key));
  loadAblation(state.generation).catch((e) => showPromptError(e.message));
}

function resetSwitches() {
  for (const set of Object.values(state.ablation)) set.clear();
  for (const button of document.querySelectorAll("#ablation-switches .switch")) {
    button.setAttribute("aria-pressed", "false");
    button.classList.remove("off");
  }
  loadAblation(state.generation).catch((e) => showPromptError(e.message));
}

async function loadAblation(generation) {
  const A = state.ablation;
  const body = { prompt: $("prompt").value, k: state.k,
    heads: [...A.heads].map((key) => key.split(",").map(Number)),
    attention: [...A.attention], mlp: [...A.mlp] };
  $("ablation-status").textContent = "computing…";
  const answer = await api("ablate", body);
  if (generation !== state.generation) return;
  state.ablated = answer;
  renderAblation();
}

function describeAblation(a) {
  const parts = [...a.heads.map(([l, h]) => `layer ${l} head ${h}`),
    ...a.attention.map((l) => `layer ${l} attention`), ...a.mlp.map((l) => `layer ${l} MLP`)];
  return parts.length ? `off: ${parts.join(", ")}` : "everything on (the intact model)";
}

function renderAblation() {
  const R = state.ablated;
  const p = state.selected;
  if (!R || p === null || R.intact.ids[0].length !== state.tokens.length) return;
  $("ablation-status").textContent = describeAblation(R.ablation);
  const name = (id) => visible(R.pieces[id]);
  const loss = (v) => (v === null ? "n/a" : v.toFixed(4));
  const { intact, ablated } = R;
  const delta = intact.loss === null ? "" : ` (${ablated.loss >= intact.loss ? "+" : ""}` +
    `${(ablated.loss - intact.loss).toFixed(4)})`;
  $("ablation-loss").replaceChildren("Loss on the prompt: intact ",
    el("b", { id: "loss-intact" }, loss(intact.loss)), " · ablated ",
    el("b", { id: "loss-ablated" }, loss(ablated.loss)), delta);
  const last = intact.ids.length - 1;
  $("ablation-next-title").textContent = `After ${tokenName(p)}: intact | ablated`;
  const rows = intact.ids[last][p].map((id, j) => {
    const other = ablated.ids[last][p][j];
    return el("tr", {},
      el("td", { class: "tok intact" }, name(id)),
      el("td", { class: "num", dataset: { value: intact.probs[last][p][j] } },
        fmt(intact.probs[last][p][j])),
      el("td", { class: "bar-cell" }, barOf(intact.probs[last][p][j])),
      el("td", { class: "tok ablated" + (other !== id ? " changed" : "") }, name(other)),
      el("td", { class: "num", dataset: { value: ablated.probs[last][p][j] } },
        fmt(ablated.probs[last][p][j])),
      el("td", { class: "bar-cell" }, barOf(ablated.probs[last][p][j], "ablated")));
  });
  $("ablation-next").replaceChildren(el("tr", {}, el("th", { colspan: 3 }, "intact"),
    el("th", { colspan: 3 }, "ablated")), ...rows);
  $("ablation-lens-title").textContent = `Logit lens at position ${p}: intact | ablated`;
  $("ablation-lens").replaceChildren(...R.layers.map((layer, l) => el("tr", {},
    el("th", {}, l === last ? `${layer} (output)` : layer),
    el("td", {}, ...intact.ids[l][p].slice(0, 3).map((id, j) =>
      lensTokenOf(name(id), intact.probs[l][p][j]))),
    el("td", { class: "ablated" }, ...ablated.ids[l][p].slice(0, 3).map((id, j) =>
      lensTokenOf(name(id), ablated.probs[l][p][j]))))));
}

function lensTokenOf(text, prob) {
  return el("span", { class: "lens-tok", title: fmt(prob),
    style: { background: shade(prob), color: inkOn(prob) } }, `${text} ${fmt(prob)}`);
}

// --- sampling --------------------------------------------------------------------------------

function numberOrNull(id) {
  const text = $(id).value.trim();
  return text === "" ? null : Number(text);
}

async function sample(event) {
  event.preventDefault();
  stopSampling();
  const controller = new AbortController();
  state.sampler = controller;
  const output = $("sample-output");
  const status = $("sample-status");
  const prompt = $("prompt").value;
  $("sample-prompt").textContent = prompt;
  $("sample-text").textContent = "";
  output.dataset.state = "streaming";
  status.textContent = "sampling…";
  setSampling(true);
  const body = { prompt, max_new_tokens: numberOrNull("max-new-tokens"),
    temperature: numberOrNull("temperature"), top_k: numberOrNull("sample-top-k"),
    top_p: numberOrNull("top-p"), seed: numberOrNull("seed") };
  for (const key of ["max_new_tokens", "temperature"]) if (body[key] === null) delete body[key];
  if (state.step !== null) body.step = state.step;
  try {
    const response = await fetch("/api/sample", { method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    if (!response.ok) {
      const data = await response.json().catch(() => ({}));
      throw new Error(data.error || `the server answered ${response.status}`);
    }
    await readEvents(response, (name, data) => onSampleEvent(name, data));
    if (output.dataset.state === "streaming") output.dataset.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      output.dataset.state = "stopped";
      status.textContent = "stopped";
    } else {
      output.dataset.state = "error";
      status.replaceChildren(el("span", { class: "error" }, error.message));
    }
  } finally {
    if (state.sampler === controller) { state.sampler = null; setSampling(false); }
  }
}

function onSampleEvent(name, data) {
  const status = $("sample-status");
  if (name === "token") {
    $("sample-text").textContent += data.text;
    const out = $("sample-output");
    out.scrollTop = out.scrollHeight;
  } else if (name === "done") {
    $("sample-output").dataset.state = "done";
    const rate = data.seconds > 0 ? ` (${Math.round(data.pieces / data.seconds)} per second)` : "";
    status.textContent = `done: ${data.pieces} pieces in ${data.seconds.toFixed(2)} s${rate}`;
  } else if (name === "error") {
    $("sample-output").dataset.state = "error";
    status.replaceChildren(el("span", { class: "error" }, data.error));
  }
}

// Server-sent events from a fetch body: blocks of "event: NAME" and "data: JSON" lines.
async function readEvents(response, handle) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) name = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      handle(name, JSON.parse(data));
    }
  }
}

function stopSampling() {
  if (state.sampler) state.sampler.abort();
}

function setSampling(running) {
  $("sample-button").disabled = running;
  $("stop-button").disabled = !running;
}

// --- the model card --------------------------------------------------------------------------

// The forms start where the server fills a request in (glassgpt.config's one table).
function fillSamplingDefaults({ predictions, sample }) {
  const start = { "dist-temperature": predictions.temperature, "dist-top-k": predictions.top_k,
    "max-new-tokens": sample.max_new_tokens, temperature: sample.temperature,
    "sample-top-k": sample.top_k, "top-p": sample.top_p, seed: sample.seed };
  for (const [id, value] of Object.entries(start)) $(id).value = value === null ? "" : value;
}

async function loadCard() {
  const card = await api("card");
  state.card = card;
  fillSamplingDefaults(card.sampling);
  const m = card.model;
  $("run-name").textContent = card.name;
  $("run-summary").textContent = `${integer(card.parameters.total)} parameters · ${m.n_layer} ` +
    `layers · ${m.n_head} heads · width ${m.n_embd} · context ${m.block_size} · ` +
    `${card.tokenizer.kind} tokenizer, ${integer(card.tokenizer.vocab_size)} tokens` +
    (card.training.best_val_loss === null ? ""
      : ` · best val loss ${card.training.best_val_loss.toFixed(4)}`);
  $("config-table").replaceChildren(...Object.entries(m).map(([key, value]) =>
    el("tr", {}, el("td", {}, key), el("td", {}, String(value)))),
  el("tr", {}, el("td", {}, "tokenizer"), el("td", {}, card.tokenizer.kind)));
  renderParameters(card.parameters, m);
  $("lens-hint").textContent = "The residual stream after each layer, read out through the " +
    `final ${normName(m)} and the ${m.tie_weights ? "tied" : "untied"} LM head` +
    `${m.logit_softcap ? " (and the logit soft-cap)" : ""}, as if the model ended there.`;
  const settings = card.training.settings || {};
  const shown = ["max_iters", "batch_size", "lr", "min_lr", "warmup_iters", "weight_decay",
    "dropout", "grad_clip", "eval_interval", "device", "dtype", "seed"];
  const rows = shown.filter((key) => key in settings).map((key) =>
    el("tr", {}, el("td", {}, key), el("td", {}, String(settings[key]))));
  if (card.lora) {  // a LoRA fine-tune: its adapters, merged into the weights shown
    const { rank, alpha, scaling, dropout, targets } = card.lora;
    rows.unshift(el("tr", {}, el("td", {}, "LoRA"),
      el("td", {}, `rank ${rank}, alpha ${alpha} (scale ${scaling}), dropout ${dropout}, ` +
        `on ${targets.join(", ")}`)));
  }
  $("train-table").replaceChildren(...(rows.length ? rows
    : [el("tr", {}, el("td", {}, "no training settings recorded in this run"))]));
  renderCurve(card.training);
  fillLayerAndHead();
}

// The model's own names for its parts: its norm and how it knows positions are switches.
function normName(model) {
  return model.norm === "rmsnorm" ? "RMSNorm" : "LayerNorm";
}

const EMBEDDINGS = { learned: "embeddings (token + position)",
  rope: "embeddings (token; rotary positions have no weights)",
  none: "embeddings (token; no positions)" };

function renderParameters(parameters, model) {
  const names = { embeddings: EMBEDDINGS[model.position] || "embeddings",
    attention: "attention (qkv + proj)", ffn: "feed-forward (MLP)",
    norm: `norms (${normName(model)})`, lm_head: "LM head (untied)", other: "other" };
  const rows = Object.entries(parameters.parts).filter(([, n]) => n > 0).map(([part, n]) => {
    const share = n / parameters.total;
    return el("tr", { dataset: { part } }, el("td", {}, names[part] || part),
      el("td", { class: "num" }, integer(n)),
      el("td", { class: "num" }, `${(100 * share).toFixed(1)}%`),
      el("td", { class: "bar-cell" }, barOf(share)));
  });
  rows.push(el("tr", {}, el("td", {}, el("b", {}, "total")),
    el("td", { class: "num" }, el("b", {}, integer(parameters.total))), el("td", {}, "")));
  $("params-table").replaceChildren(...rows);
  $("params-note").textContent = parameters.parts.lm_head === 0
    ? "The LM head is the token embedding matrix (tied): counted once, with the embeddings."
    : "";
}

// The training curve as SVG: the loss of each logged batch, and train/val loss at evaluations.
function renderCurve(training) {
  const box = $("curve");
  const { train, eval: evals } = training;
  if (!train.length && !evals.length) {
    box.replaceChildren(el("p", { class: "hint" }, "this run has no metrics.jsonl"));
    $("best-val").textContent = "";
    return;
  }
  const W = 1100, H = 280, pad = { l: 56, r: 170, t: 12, b: 40 };
  const points = [...train.map((p) => [p[0], p[1]]), ...evals.map((e) => [e[0], e[1]]),
    ...evals.map((e) => [e[0], e[2]])];
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const x0 = 0, x1 = largest(xs, 1);
  const y0 = smallest(ys), y1 = largest(ys);
  const span = y1 - y0 || 1;
  const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * (W - pad.l - pad.r);
  const Y = (y) => pad.t + (1 - (y - y0 + 0.05 * span) / (1.1 * span)) * (H - pad.t - pad.b);
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("width", "100%");
  const add = svgAppender(svg);
  for (const t of ticks(y0, y1, 5)) {
    add("line", { x1: pad.l, x2: W - pad.r, y1: Y(t), y2: Y(t), stroke: "#e6e9ee" });
    add("text", { x: pad.l - 6, y: Y(t) + 4, "text-anchor": "end" }, t.toFixed(2));
  }
  for (const t of ticks(x0, x1, 6)) {
    add("text", { x: X(t), y: H - pad.b + 16, "text-anchor": "middle" }, integer(t));
  }
  add("text", { x: (pad.l + W - pad.r) / 2, y: H - 6, "text-anchor": "middle" }, "iteration");
  add("text", { x: 14, y: (H - pad.b) / 2, transform: `rotate(-90 14 ${(H - pad.b) / 2})`,
    "text-anchor": "middle" }, "cross-entropy loss");
  const line = (pts, colour, width, dots) => {
    if (!pts.length) return;
    add("polyline", { points: pts.map(([x, y]) => `${X(x)},${Y(y)}`).join(" "), fill: "none",
      stroke: colour, "stroke-width": width });
    if (dots) for (const [x, y] of pts) add("circle", { cx: X(x), cy: Y(y), r: 3, fill: colour });
  };
  const series = [["train (batch)", "#9dbbe0", 1.2, false, train],
    ["train (eval)", "#1f5fa8", 2, true, evals.map((e) => [e[0], e[1]])],
    ["val (eval)", "#d9480f", 2, true, evals.map((e) => [e[0], e[2]])]];
  series.forEach(([name, colour, width, dots, pts], i) => {
    line(pts, colour, width, dots);
    add("line", { x1: W - pad.r + 16, x2: W - pad.r + 40, y1: 22 + 20 * i, y2: 22 + 20 * i,
      stroke: colour, "stroke-width": 3 });
    add("text", { x: W - pad.r + 46, y: 26 + 20 * i }, name);
  });
  box.replaceChildren(svg);
  const best = $("best-val");
  if (training.best_val_loss === null) best.textContent = "no evaluation yet";
  else {
    best.replaceChildren("best val loss ", el("b", {}, training.best_val_loss.toFixed(4)),
      ` at iteration ${integer(training.best_val_iter)} of ${integer(training.iterations)}`);
  }
}

function ticks(low, high, count) {
  const raw = (high - low) / count || 1;
  const step = [1, 2, 2.5, 5, 10].map((m) => m * 10 ** Math.floor(Math.log10(raw)))
    .find((s) => s >= raw);
  const out = [];
  for (let t = Math.ceil(low / step) * step; t <= high + 1e-9; t += step) out.push(t);
  return out;
}

// --- start -----------------------------------------------------------------------------------

async function start() {
  $("prompt").addEventListener("input", debounce(promptChanged, 200));
  $("layer").addEventListener("change", () => {
    state.layer = Number($("layer").value);
    loadAttention(state.generation).catch((e) => showPromptError(e.message));
    renderHeadView();
  });
  $("head").addEventListener("change", () => {
    state.head = $("head").value === "all" ? "all" : Number($("head").value);
    loadAttention(state.generation).catch((e) => showPromptError(e.message));
  });
  $("zoom-in").addEventListener("click", () => zoom(1));
  $("zoom-out").addEventListener("click", () => zoom(-1));
  $("top-k").addEventListener("change", () => {
    state.k = Number($("top-k").value);
    loadPredictions(state.generation).catch((e) => showPromptError(e.message));
    loadAblation(state.generation).catch((e) => showPromptError(e.message));
  });
  const redistribute = debounce(() =>
    loadPredictions(state.generation).catch((e) => showPromptError(e.message)), 150);
  $("dist-temperature").addEventListener("input", redistribute);
  $("dist-top-k").addEventListener("input", redistribute);
  $("attention-kind").addEventListener("change", () => {
    state.kind = $("attention-kind").value;
    loadAttention(state.generation).catch((e) => showPromptError(e.message));
  });
  for (const id of ["inside-layer", "inside-head"]) {
    $(id).addEventListener("change", () => {
      state.inside = { layer: Number($("inside-layer").value),
        head: Number($("inside-head").value) };
      loadInside(state.generation).catch((e) => showPromptError(e.message));
      loadMlp(state.generation).catch((e) => showPromptError(e.message));
    });
  }
  $("patch-button").addEventListener("click", runPatching);
  for (const id of ["attribution-token", "attribution-against"]) {
    $(id).addEventListener("change", () =>
      loadAttribution(state.generation, ...chosenAttribution())
        .catch((e) => showPromptError(e.message)));
  }
  $("attribution-all").addEventListener("click", () => {
    state.attribution.all = !state.attribution.all;
    renderAttribution();
  });
  $("ablation-reset").addEventListener("click", resetSwitches);
  $("sample-form").addEventListener("submit", sample);
  $("stop-button").addEventListener("click", stopSampling);
  try {
    await loadCard();
  } catch (error) {
    $("run-summary").textContent = `cannot load the model card: ${error.message}`;
    return;
  }
  await startFeatures();
  await startTimeline().catch((e) => showError("timeline-error", e.message));
  $("prompt").value = state.card.example_prompt;
  $("patch-clean").value = state.card.example_prompt;
  await promptChanged();
  document.body.dataset.ready = "true";
}

start();
