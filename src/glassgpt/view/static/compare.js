// glassgpt view: the Compare panel (what a fine-tune changed: `glassgpt view RUN2 --compare
// RUN`). Loaded after app.js, whose helpers ($, el, api, fill, visible, shade, svgAppender,
// maxAbs, largest, ...) it calls. Every number comes from /api/compare/*; this file only draws.
"use strict";

const COMPARE_TOP_TOKENS = 8; // rows of the token table: the largest differences
const COMPARE_MAP_WIDTH = 230; // pixels a layer x head map may take across
const COMPARE_LEFT = 30; // room for the layer names (L0, L1, ...)
const COMPARE_TOP = 16; // room for the head numbers
const PATTERN_PX = 300; // an attention map's side at most
const COMPARE_MAPS = [["outputs", "head output on this prompt"], ["q", "W_Q"], ["k", "W_K"],
  ["v", "W_V"], ["o", "W_O"], ["mlp", "MLP (all its weights)"]];

const comparePanel = { prompt: null, tokens: null, changes: null, request: 0 };

async function startCompare() {
  const { available } = await api("compare/available");
  $("compare-none").hidden = available;
  $("compare-body").hidden = !available;
  if (!available) return;
  $("compare-button").addEventListener("click", () => runCompare($("prompt").value));
  // What was compared for an older prompt stays, greyed out, until Compare is clicked again.
  $("prompt").addEventListener("input", () => $("compare-results").classList.toggle("stale",
    comparePanel.prompt !== null && comparePanel.prompt !== $("prompt").value));
}

async function runCompare(prompt) {
  const request = ++comparePanel.request;
  showError("compare-error", "");
  $("compare-status").textContent = "running both models…";
  let tokens, changes;
  try {
    [tokens, changes] = await Promise.all([api("compare/tokens", { prompt }),
      api("compare/changes", { prompt })]);
  } catch (error) {
    if (request !== comparePanel.request) return;
    $("compare-status").textContent = "";
    showError("compare-error", error.message);
    return;
  }
  if (request !== comparePanel.request) return; // a later click is on its way
  Object.assign(comparePanel, { prompt, tokens, changes });
  $("compare-results").classList.remove("stale");
  const mean = tokens.mean_difference;
  $("compare-status").textContent = `${tokens.tokens.length} tokens · mean log-prob ` +
    `difference ${signed(mean)} (tuned − base)`;
  renderCompareTokens(tokens);
  renderCompareTable(tokens);
  renderCompareMaps(changes);
  fill($("compare-attention"), [el("p", { class: "hint" },
    "Click a head in a map: its attention on this prompt before and after the tune.")]);
  delete $("compare-attention").dataset.state;
}

function signed(v) { return `${v >= 0 ? "+" : "−"}${Math.abs(v).toFixed(4)}`; }

// Green: likelier after the tune; red: less likely; white: unchanged (scale: the largest
// difference of the prompt).
function logprobShade(v, scale) {
  const t = Math.max(-1, Math.min(1, scale > 0 ? v / scale : 0));
  const to = t >= 0 ? [27, 120, 55] : [178, 24, 43];
  const c = [255, 255, 255].map((f, i) => Math.round(f + (to[i] - f) * Math.sqrt(Math.abs(t))));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// The first token has no log-probability (nothing comes before it): its cell stays plain.
function tokenNumbers(answer, p) {
  if (p === 0) return null;
  return { tuned: answer.tuned[p - 1], base: answer.base[p - 1],
    difference: answer.difference[p - 1] };
}

function describeToken(answer, p) {
  const n = tokenNumbers(answer, p);
  const name = `'${visible(answer.tokens[p])}' (position ${p})`;
  if (n === null) return `${name}: the first token, predicted by neither model`;
  return `${name}: log p tuned ${n.tuned.toFixed(4)} · base ${n.base.toFixed(4)} · ` +
    `difference ${signed(n.difference)}`;
}

function renderCompareTokens(answer) {
  const scale = maxAbs(answer.difference, 1e-9);
  fill($("compare-tokens"), answer.tokens.map((text, p) => {
    const n = tokenNumbers(answer, p);
    const said = describeToken(answer, p);
    const cell = el("span", { class: "chip compare-token", title: said,
      dataset: { position: p, difference: n === null ? "" : n.difference },
      onmouseenter: () => { $("compare-hover").textContent = said; } }, visible(text));
    if (n !== null) {
      const ink = Math.abs(n.difference) / scale > 0.6 ? "#fff" : "#1d2430";
      cell.style.background = logprobShade(n.difference, scale);
      cell.style.color = ink;
    } else {
      cell.classList.add("first");
    }
    return cell;
  }));
  $("compare-hover").textContent = "hover a token for its log-probabilities";
}

// The tokens whose log-probability moved most, either way.
function renderCompareTable(answer) {
  const rows = answer.difference.map((d, i) => i + 1)
    .sort((a, b) => Math.abs(answer.difference[b - 1]) - Math.abs(answer.difference[a - 1]))
    .slice(0, COMPARE_TOP_TOKENS);
  fill($("compare-table"), [
    el("tr", {}, el("th", {}, "position"), el("th", {}, "token"), el("th", {}, "tuned"),
      el("th", {}, "base"), el("th", {}, "difference")),
    ...rows.map((p) => {
      const n = tokenNumbers(answer, p);
      return el("tr", { dataset: { position: p } }, el("td", { class: "num" }, `${p}`),
        el("td", {}, `'${visible(answer.tokens[p])}'`),
        el("td", { class: "num" }, n.tuned.toFixed(4)),
        el("td", { class: "num" }, n.base.toFixed(4)),
        el("td", { class: "num" }, signed(n.difference)));
    })]);
}

function renderCompareMaps(changes) {
  const maps = COMPARE_MAPS.map(([key, title]) => {
    const values = key === "outputs" ? changes.outputs : changes.weights[key];
    return changeMap(key, title, values);
  });
  fill($("compare-maps"), maps);
  const moved = changes.elsewhere.slice(0, 3).map((m) => `${m.name} ${m.change.toFixed(4)}`);
  $("compare-elsewhere").textContent = changes.elsewhere.length === 0
    ? "Nothing else moved (embeddings, norms, attention biases)."
    : `Elsewhere (relative change): ${moved.join(" · ")}` +
      (changes.elsewhere.length > 3 ? ` and ${changes.elsewhere.length - 3} more` : "");
}

// One layer x head (or layer x 1, the MLP) map of relative changes as an SVG grid: the
// darker, the larger the change, on the map's own scale (its largest value, written above).
function changeMap(key, title, values) {
  const L = values.length, H = values[0].length;
  const cell = Math.max(8, Math.min(24, Math.floor((COMPARE_MAP_WIDTH - COMPARE_LEFT) / H)));
  const width = COMPARE_LEFT + H * cell + 2, height = COMPARE_TOP + L * cell + 2;
  const most = maxAbs(values);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const add = svgAppender(svg);
  const headStep = Math.ceil(14 / cell); // thin the labels out, never shrink them
  for (let h = 0; h < H && key !== "mlp"; h += headStep) {
    add("text", { x: COMPARE_LEFT + (h + 0.5) * cell, y: COMPARE_TOP - 4,
      class: "compare-axis middle" }, `${h}`);
  }
  const layerStep = Math.ceil(12 / cell);
  values.forEach((row, layer) => {
    if (layer % layerStep === 0) {
      add("text", { x: COMPARE_LEFT - 4, y: COMPARE_TOP + (layer + 0.5) * cell + 4,
        class: "compare-axis end" }, `L${layer}`);
    }
    row.forEach((v, head) => {
      const rect = add("rect", { x: COMPARE_LEFT + head * cell, y: COMPARE_TOP + layer * cell,
        width: cell, height: cell, fill: shade(most > 0 ? v / most : 0),
        class: key === "mlp" ? "compare-cell" : "compare-cell head" });
      Object.assign(rect.dataset, { layer, head, value: v });
      const where = key === "mlp" ? `layer ${layer} MLP` : `L${layer}H${head}`;
      svgAppender(rect)("title", {}, `${where}: ${title} moved ${v.toFixed(4)} (relative)`);
      if (key !== "mlp") rect.addEventListener("click", () => openCompareHead(layer, head));
    });
  });
  return el("figure", { class: "compare-map", dataset: { map: key } },
    el("figcaption", {}, el("b", {}, title), ` · largest ${most.toFixed(4)}`), svg);
}

async function openCompareHead(layer, head) {
  for (const r of $("compare-maps").querySelectorAll(".compare-cell.chosen")) {
    r.classList.remove("chosen");
  }
  for (const r of $("compare-maps").querySelectorAll(
    `.compare-cell.head[data-layer="${layer}"][data-head="${head}"]`)) r.classList.add("chosen");
  const box = $("compare-attention");
  box.dataset.state = "loading";
  fill(box, [el("p", { class: "hint" }, `reading L${layer}H${head} in both models…`)]);
  let answer;
  try {
    answer = await api("compare/attention", { prompt: comparePanel.prompt, layer, head });
  } catch (error) {
    fill(box, [el("p", { class: "error" }, error.message)]);
    box.dataset.state = "error";
    return;
  }
  const labels = comparePanel.tokens.tokens.map(visible);
  fill(box, [el("h3", {}, `Layer ${answer.layer}, head ${answer.head}: attention before and ` +
    "after the tune"),
  el("p", { class: "readout", id: "compare-attention-change" },
    `largest change of a weight ${answer.largest_change.toFixed(4)}`),
  el("div", { class: "compare-patterns" }, patternMap("before (base)", answer.before, labels),
    patternMap("after (tuned)", answer.after, labels))]);
  Object.assign(box.dataset, { layer: answer.layer, head: answer.head, state: "shown" });
}

// One attention pattern as an SVG: queries down, keys across, the lower triangle only (a
// causal model sees no later key), shaded 0..1 like the Attention panel's maps.
function patternMap(title, rows, labels) {
  const T = rows.length;
  const cell = Math.max(3, Math.min(18, Math.floor(PATTERN_PX / T)));
  const left = cell >= 10 ? 44 : 8, top = 4;
  const width = left + T * cell + 2, height = top + T * cell + 2;
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.classList.add("compare-pattern");
  const add = svgAppender(svg);
  for (let q = 0; q < T; q++) {
    if (cell >= 10) {
      add("text", { x: left - 4, y: top + (q + 0.5) * cell + 4, class: "compare-axis end" },
        labels[q].slice(0, 5));
    }
    for (let k = 0; k <= q; k++) {
      const rect = add("rect", { x: left + k * cell, y: top + q * cell, width: cell,
        height: cell, fill: shade(rows[q][k]), class: "compare-weight" });
      svgAppender(rect)("title", {}, `'${labels[q]}' (${q}) → '${labels[k]}' (${k}): ` +
        `${rows[q][k].toFixed(4)}`);
    }
  }
  return el("figure", { class: "compare-map" }, el("figcaption", {}, title), svg);
}

document.addEventListener("DOMContentLoaded", () =>
  startCompare().catch((e) => showError("compare-error", e.message)));
