// glassgpt view: the Graph panel (an attribution graph over the transcoders given with
// --transcoders). Loaded after app.js, whose helpers ($, el, api, fill, visible, svgAppender,
// debounce, ...) it calls, and features.js, whose openFeature a feature node calls. Every number comes from /api/graph and
// /api/graph/edge; this file only lays the nodes out.
"use strict";

const GRAPH_LEFT = 56; // room for the row names (emb, L0, ..., logits)
const GRAPH_RIGHT = 12;
const GRAPH_SLOT = 13; // a feature's or an error's square of room in its cell
const GRAPH_ROW_PAD = 10;
const GRAPH_BOX = 20; // height of a token's or a logit's box
const GRAPH_AXIS = 34; // room under the token row for the positions and their text
const EDGE_COLOURS = { positive: "#1f5fa8", negative: "#c62828" };

const graphPanel = { answer: null, prompt: null, request: 0 };

async function startGraph() {
  const { available } = await api("graph/available");
  $("graph-none").hidden = available;
  $("graph-body").hidden = !available;
  if (!available) return;
  $("graph-draw").addEventListener("click", () => loadGraph($("prompt").value));
  for (const id of ["graph-node", "graph-edge-threshold"]) {
    $(id).addEventListener("input", () => { showThresholds(); redrawGraph(); });
  }
  // A graph drawn for an older prompt stays, greyed out, until it is drawn again.
  $("prompt").addEventListener("input", () => $("graph").classList.toggle("stale",
    graphPanel.prompt !== null && graphPanel.prompt !== $("prompt").value));
  showThresholds();
}

function thresholds() {
  return { node_threshold: Number($("graph-node").value),
    edge_threshold: Number($("graph-edge-threshold").value) };
}

function showThresholds() {
  const t = thresholds();
  $("graph-node-value").textContent = t.node_threshold.toFixed(2);
  $("graph-edge-value").textContent = t.edge_threshold.toFixed(2);
}

// A slider moved: the server keeps the graph, so only the pruning is asked again.
const redrawGraph = debounce(() => {
  if (graphPanel.prompt !== null) loadGraph(graphPanel.prompt);
}, 120);

async function loadGraph(prompt) {
  const request = ++graphPanel.request;
  showError("graph-error", "");
  $("graph-status").textContent = "building the graph…";
  let answer;
  try {
    answer = await api("graph", { prompt, ...thresholds() });
  } catch (error) {
    if (request !== graphPanel.request) return;
    $("graph-status").textContent = "";
    showError("graph-error", error.message);
    return;
  }
  if (request !== graphPanel.request) return; // a later slider position is on its way
  if (prompt !== graphPanel.prompt) {
    fill($("graph-edge"), [el("p", { class: "hint" }, "Click an edge: its weight, its direct " +
      "part and its heads.")]);
    delete $("graph-edge").dataset.state;
  }
  graphPanel.answer = answer;
  graphPanel.prompt = prompt;
  $("graph").classList.toggle("stale", prompt !== $("prompt").value);
  const features = answer.nodes.filter((n) => n.kind === "feature").length;
  $("graph-status").textContent = `${answer.nodes.length} nodes (${features} features), ` +
    `${answer.edges.length} edges`;
  $("graph-scores").textContent = `replacement score ${answer.scores.replacement.toFixed(3)} · ` +
    `completeness score ${answer.scores.completeness.toFixed(3)}`;
  showWhy(answer.why);
  renderGraph(answer);
}

// Where few features were kept, the server's line saying why, under the scores.
function showWhy(why) {
  let line = $("graph-why");
  if (!line) {
    line = el("p", { id: "graph-why", class: "readout" });
    $("graph-scores").after(line);
  }
  line.textContent = why || "";
  line.hidden = !why;
}

// Where each node goes: columns are positions, rows layers (token embeddings at the bottom,
// logits on top). Nodes sharing a cell fill it left to right, then upwards, so none overlap;
// a row is as tall as its fullest cell.
function graphLayout(answer, width) {
  const T = answer.tokens.length, L = answer.n_layers;
  const cell = (width - GRAPH_LEFT - GRAPH_RIGHT) / T;
  const perLine = Math.max(1, Math.floor(cell / GRAPH_SLOT));
  const cells = new Map(); // "layer,position" -> nodes, features before the error node
  for (const node of answer.nodes) {
    if (node.kind !== "feature" && node.kind !== "error") continue;
    const key = `${node.layer},${node.position}`;
    if (!cells.has(key)) cells.set(key, []);
    cells.get(key).push(node);
  }
  const lines = new Array(L).fill(1);
  for (const [key, nodes] of cells) {
    nodes.sort((a, b) => (a.kind === "error") - (b.kind === "error") || a.index - b.index);
    const layer = Number(key.split(",")[0]);
    lines[layer] = Math.max(lines[layer], Math.ceil(nodes.length / perLine));
  }
  const logits = answer.nodes.filter((n) => n.kind === "logit");
  // Rows from the top: logits, layer L-1 ... layer 0, tokens; each row's centre line.
  let y = 8;
  const logitY = y + GRAPH_BOX / 2;
  y += GRAPH_BOX + 2 * GRAPH_ROW_PAD;
  const layerTop = [];
  for (let layer = L - 1; layer >= 0; layer--) {
    layerTop[layer] = y;
    y += lines[layer] * GRAPH_SLOT + 2 * GRAPH_ROW_PAD;
  }
  const tokenY = y + GRAPH_BOX / 2;
  const height = y + GRAPH_BOX + GRAPH_AXIS;
  const columnX = (p) => GRAPH_LEFT + (p + 0.5) * cell;
  const at = new Map();
  for (const nodes of cells.values()) {
    nodes.forEach((node, i) => {
      const line = Math.floor(i / perLine), slot = i % perLine;
      const inLine = Math.min(perLine, nodes.length - line * perLine);
      at.set(node.id, { x: columnX(node.position) + (slot - (inLine - 1) / 2) * GRAPH_SLOT,
        y: layerTop[node.layer] + (lines[node.layer] - line - 0.5) * GRAPH_SLOT });
    });
  }
  for (const node of answer.nodes) {
    if (node.kind === "token") at.set(node.id, { x: columnX(node.position), y: tokenY });
  }
  // Logits side by side along the top, as wide as fits, the likeliest nearest the last token.
  const logitWidth = Math.min(96, (width - GRAPH_LEFT - GRAPH_RIGHT) / Math.max(1, logits.length));
  const firstX = Math.max(Math.min(columnX(T - 1), width - GRAPH_RIGHT - logitWidth / 2),
    GRAPH_LEFT + (logits.length - 0.5) * logitWidth); // far enough right for all of them
  logits.forEach((node, k) => at.set(node.id, { x: firstX - k * logitWidth, y: logitY }));
  const rows = [{ name: "logits", y: logitY }, { name: "emb", y: tokenY }];
  for (let layer = 0; layer < L; layer++) {
    rows.push({ name: `L${layer}`, y: layerTop[layer] + (lines[layer] * GRAPH_SLOT) / 2 });
  }
  return { at, cell, height, logitWidth, rows, columnX, tokenY };
}

function renderGraph(answer) {
  const box = $("graph");
  const width = Math.max(320, Math.floor(box.clientWidth));
  const layout = graphLayout(answer, width);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", layout.height);
  svg.setAttribute("viewBox", `0 0 ${width} ${layout.height}`);
  svg.dataset.nodeThreshold = answer.thresholds.node;
  svg.dataset.edgeThreshold = answer.thresholds.edge;
  const add = svgAppender(svg);
  for (const row of layout.rows) {
    add("text", { x: 4, y: row.y + 4, class: "graph-row" }, row.name);
  }
  answer.tokens.forEach((text, p) => {
    const x = layout.columnX(p);
    add("text", { x, y: layout.height - GRAPH_AXIS + 14, class: "graph-axis" }, `${p}`);
    add("text", { x, y: layout.height - GRAPH_AXIS + 28, class: "graph-axis" },
      clipped(visible(text), layout.cell));
  });
  const heaviest = maxAbs(answer.edges.map((e) => e.weight), 1e-12);
  // Lightest first, so the heavy edges are drawn over them.
  for (const edge of [...answer.edges].reverse()) drawEdge(add, layout, edge, heaviest);
  for (const node of answer.nodes) drawNode(add, layout, node, answer);
  fill(box, [svg]);
  $("graph-hover").textContent = "hover a node for its numbers; click an edge for its heads";
}

// Text cut to what `room` pixels hold at the axis's font (7 px a character).
function clipped(text, room) {
  const most = Math.max(1, Math.floor(room / 7));
  return text.length <= most ? text : `${text.slice(0, Math.max(1, most - 1))}…`;
}

function drawEdge(add, layout, edge, heaviest) {
  const from = layout.at.get(edge.source), to = layout.at.get(edge.target);
  const g = add("g", { class: "graph-edge" });
  g.dataset.source = edge.source;
  g.dataset.target = edge.target;
  g.dataset.weight = edge.weight;
  const put = svgAppender(g);
  const colour = edge.weight < 0 ? EDGE_COLOURS.negative : EDGE_COLOURS.positive;
  put("line", { x1: from.x, y1: from.y, x2: to.x, y2: to.y, stroke: colour,
    "stroke-width": (0.6 + (3.4 * Math.abs(edge.weight)) / heaviest).toFixed(2),
    class: "graph-line" });
  // A wide transparent twin: a thin line is hard to hit with the mouse.
  put("line", { x1: from.x, y1: from.y, x2: to.x, y2: to.y, class: "graph-hit" });
  put("title", {}, `${edge.source} → ${edge.target}: ${edge.weight.toFixed(4)}`);
  g.addEventListener("click", () => openEdge(edge));
}

function drawNode(add, layout, node, answer) {
  const { x, y } = layout.at.get(node.id);
  const g = add("g", { class: `graph-node ${node.kind}` });
  g.dataset.id = node.id;
  g.dataset.kind = node.kind;
  const put = svgAppender(g);
  if (node.kind === "feature") {
    put("circle", { cx: x, cy: y, r: 5 });
    g.addEventListener("click", () => openGraphFeature(node, answer));
  } else if (node.kind === "error") {
    put("path", { d: `M${x} ${y - 5.5}L${x + 5.5} ${y}L${x} ${y + 5.5}L${x - 5.5} ${y}Z` });
  } else {
    const text = node.kind === "logit" ? `${visible(node.text)} ${node.probability.toFixed(2)}`
      : visible(node.text);
    const w = node.kind === "logit" ? layout.logitWidth - 4 : Math.max(10, layout.cell - 2);
    put("rect", { x: x - w / 2, y: y - GRAPH_BOX / 2, width: w, height: GRAPH_BOX, rx: 3 });
    put("text", { x, y: y + 4 }, clipped(text, w));
  }
  const said = describeNode(node);
  put("title", {}, said);
  g.addEventListener("mouseenter", () => { $("graph-hover").textContent = said; });
}

function describeNode(node) {
  const parts = [node.id];
  if (node.kind === "feature") parts.push(`activation ${node.activation.toFixed(4)}`);
  if (node.kind === "logit") parts.push(`'${visible(node.text)}' p ${node.probability.toFixed(4)}`);
  if (node.kind === "token") parts.push(`'${visible(node.text)}'`);
  parts.push(`influence ${node.influence.toFixed(4)}`);
  return parts.join(" · ");
}

// A feature node opens its page in the Features panel, under its transcoder's name there.
function openGraphFeature(node, answer) {
  const name = answer.dictionaries[node.dictionary];
  $("features-section").scrollIntoView();
  openFeature(node.feature, name).catch((e) => showError("graph-error", e.message));
}

async function openEdge(edge) {
  for (const g of $("graph").querySelectorAll(".graph-edge.chosen")) g.classList.remove("chosen");
  const chosen = [...$("graph").querySelectorAll(".graph-edge")].find((g) =>
    g.dataset.source === edge.source && g.dataset.target === edge.target);
  if (chosen) chosen.classList.add("chosen");
  const box = $("graph-edge");
  box.dataset.state = "loading";
  fill(box, [el("h3", {}, `${edge.source} → ${edge.target}`), el("p", { class: "hint" },
    "reading its heads…")]);
  let answer;
  try {
    answer = await api("graph/edge", { prompt: graphPanel.prompt, source: edge.source,
      target: edge.target });
  } catch (error) {
    fill(box, [el("p", { class: "error" }, error.message)]);
    box.dataset.state = "error";
    return;
  }
  fill(box, [el("h3", {}, `${answer.source} → ${answer.target}`),
    el("p", { class: "readout", id: "graph-edge-weight" },
      `weight ${answer.weight.toFixed(4)} · direct ${answer.direct.toFixed(4)}`),
    el("table", { class: "graph-heads" },
      el("tr", {}, el("th", {}, "head"), el("th", {}, "share")),
      answer.heads.map((h) => el("tr", { dataset: { layer: h.layer, head: h.head } },
        el("td", {}, `L${h.layer}H${h.head}`), el("td", { class: "num" }, h.share.toFixed(4))))),
    el("p", { class: "hint" }, answer.note)]);
  box.dataset.source = answer.source;
  box.dataset.target = answer.target;
  box.dataset.state = "shown";
}

document.addEventListener("DOMContentLoaded", () =>
  startGraph().catch((e) => showError("graph-error", e.message)));
