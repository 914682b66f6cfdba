// glassgpt view: the Timeline panel (the run's snapshots, `glassgpt train --snapshots N`).
// Loaded before app.js, whose helpers ($, el, api, svgAppender, largest, smallest, ticks,
// integer, HEAD_COLOURS, openHead, promptChanged, runPatching, state) it calls once the page
// has started. The slider's step travels with every request of the panels it moves (app.js's
// `api` adds it); the numbers of the charts come from GET /api/timeline and the model card.
"use strict";

const TIMELINE_W = 1100; // the charts' drawing width (SVG units; drawn at the panel's width)
const TIMELINE_PAD = { l: 56, r: 180, t: 12, b: 40 };
const MOST_LABELS = 12; // heads named at the end of their lines
const SPLIT_COLOURS = ["#1f5fa8", "#d9480f", "#2ca02c", "#9467bd"]; // a split's loss a colour
const SCORE_NAMES = { previous_token: "previous-token score", duplicate_token:
  "duplicate-token score", induction: "induction score",
  attribution: "push on the probe's answer (logit attribution)" };

const timeline = { steps: [], data: null, checkpoint: "best", index: 0, kind: null, log: true,
  moving: 0 };

// The step the slider's position `index` names: a snapshot's, or null for the run's own
// weights (the slider's last position).
function stepAt(index) { return index < timeline.steps.length ? timeline.steps[index] : null; }

// The iteration the run's own weights are from: its best evaluation's, its last, or the
// snapshot's the view was started at (`--checkpoint step:N`).
function ownIteration() {
  const t = state.card.training;
  if (timeline.checkpoint.startsWith("step:")) return Number(timeline.checkpoint.slice(5));
  return timeline.checkpoint === "best" && t.best_val_iter !== null ? t.best_val_iter
    : t.iterations;
}

function stepName(index) {
  const step = stepAt(index);
  if (step !== null) {
    return `step ${integer(step)} · snapshot ${index + 1} of ${timeline.steps.length}`;
  }
  const at = ownIteration();
  const own = timeline.checkpoint.startsWith("step:")
    ? `the weights the view started with (--checkpoint ${timeline.checkpoint})`
    : `the run's ${timeline.checkpoint} weights`;
  return own + (at === null ? "" : ` (iteration ${integer(at)})`);
}

async function startTimeline() {
  const answer = await api("timeline");
  Object.assign(timeline, { steps: answer.steps, data: answer.timeline,
    checkpoint: answer.checkpoint, index: answer.steps.length });
  const some = answer.steps.length > 0;
  $("timeline-none").hidden = some;
  $("timeline-body").hidden = !some;
  $("step-bar").hidden = !some;
  if (!some) return;
  const slider = $("step-slider");
  slider.max = String(answer.steps.length);
  slider.value = String(timeline.index);
  slider.addEventListener("input", () => {
    timeline.index = Number(slider.value);
    renderTimeline();
  });
  slider.addEventListener("change", () => goToStep(Number(slider.value)));
  $("timeline-note").textContent = answer.timeline_note || "";
  $("timeline-note").hidden = !answer.timeline_note;
  fillScoreKinds();
  $("timeline-log").addEventListener("change", () => {
    timeline.log = $("timeline-log").checked;
    renderTimeline();
  });
  renderTimeline();
}

function fillScoreKinds() {
  const kinds = timeline.data ? Object.keys(timeline.data.heads) : [];
  $("timeline-scores").hidden = kinds.length === 0;
  if (!kinds.length) return;
  timeline.kind = kinds.includes("induction") ? "induction" : kinds[0];
  $("timeline-score").replaceChildren(...kinds.map((k) =>
    el("option", { value: k }, SCORE_NAMES[k] || k.replace(/_/g, " "))));
  $("timeline-score").value = timeline.kind;
  $("timeline-score").addEventListener("change", () => {
    timeline.kind = $("timeline-score").value;
    renderTimeline();
  });
}

// Every panel that reads the model asked again at the slider's step: the prompt's panels, and
// patching when it was run (on the same prompts, at the new weights).
async function goToStep(index) {
  const moving = ++timeline.moving;
  timeline.index = index;
  $("step-slider").value = String(index);
  state.step = stepAt(index);
  renderTimeline();
  $("step-status").textContent = "loading…";
  markPanels(state.step);
  await promptChanged();
  if (state.patching && moving === timeline.moving) await runPatching();
  if (moving !== timeline.moving) return;
  $("step-status").textContent = "";
  $("step-bar").dataset.shown = state.step === null ? "run" : String(state.step);
}

// The title of each panel the slider moves says the step it shows (none: the run's weights).
const MOVED_PANELS = ["attention", "overview", "head", "mlp", "predictions", "ablation",
  "patching", "attribution", "sample"];

function markPanels(step) {
  for (const panel of MOVED_PANELS) {
    const title = document.querySelector(`#${panel}-section h2`);
    if (step === null) delete title.dataset.step;
    else title.dataset.step = `step ${integer(step)}`;
  }
}

function renderTimeline() {
  $("step-label").textContent = stepName(timeline.index);
  renderLossChart();
  renderLlcChart();
  renderHeadChart();
  renderTimelineReadout();
}

// The x axis both charts share: iterations, on a log scale (snapshots are log-spaced, the first
// steps dense) or a linear one.
function stepScale() {
  const own = ownIteration() || 0;
  const curve = state.card.training.train.map((p) => p[0]);
  const last = Math.max(largest(timeline.steps, 1), own, largest(curve, 1));
  const f = timeline.log ? (x) => Math.log10(x + 1) : (x) => x; // step 0 has a place too
  const W = TIMELINE_W - TIMELINE_PAD.l - TIMELINE_PAD.r;
  return { last, X: (x) => TIMELINE_PAD.l + (f(x) / (f(last) || 1)) * W };
}

function chart(height, y0, y1, yName, scale) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${TIMELINE_W} ${height}`);
  svg.setAttribute("width", "100%");
  const add = svgAppender(svg);
  const span = y1 - y0 || 1;
  const Y = (y) => TIMELINE_PAD.t + (1 - (y - y0 + 0.05 * span) / (1.1 * span)) *
    (height - TIMELINE_PAD.t - TIMELINE_PAD.b);
  for (const t of ticks(y0, y1, 4)) {
    add("line", { x1: TIMELINE_PAD.l, x2: TIMELINE_W - TIMELINE_PAD.r, y1: Y(t), y2: Y(t),
      stroke: "#e6e9ee" });
    add("text", { x: TIMELINE_PAD.l - 6, y: Y(t) + 4, "text-anchor": "end" }, t.toFixed(2));
  }
  const xTicks = timeline.log ? logTicks(scale.last, scale.X) : ticks(0, scale.last, 6);
  for (const t of xTicks) {
    add("text", { x: scale.X(t), y: height - TIMELINE_PAD.b + 16, "text-anchor": "middle" },
      integer(t));
  }
  add("text", { x: (TIMELINE_PAD.l + TIMELINE_W - TIMELINE_PAD.r) / 2, y: height - 6,
    "text-anchor": "middle" }, timeline.log ? "step (log scale)" : "step");
  add("text", { x: 14, y: height / 2, transform: `rotate(-90 14 ${height / 2})`,
    "text-anchor": "middle" }, yName);
  return { svg, add, Y };
}

// 0, 1, 2, 5, 10, 20, 50, ... up to `last`, leaving out those too close to the one before.
function logTicks(last, X) {
  const out = [0];
  for (let decade = 1; decade <= last; decade *= 10) {
    for (const m of [1, 2, 5]) {
      const t = m * decade;
      if (t <= last && X(t) - X(out[out.length - 1]) >= 40) out.push(t);
    }
  }
  return out;
}

// The cursor at the slider's step, and a tick for every snapshot (click one to go there).
function cursorAndSnapshots(add, scale, height) {
  const bottom = height - TIMELINE_PAD.b;
  timeline.steps.forEach((s, i) => {
    const tick = add("line", { x1: scale.X(s), x2: scale.X(s), y1: bottom, y2: bottom + 6,
      stroke: "#5c6675", "stroke-width": 2, class: "snapshot-tick", "data-step": s });
    tick.addEventListener("click", () => goToStep(i));
  });
  const step = stepAt(timeline.index);
  const x = scale.X(step === null ? (ownIteration() || 0) : step);
  add("line", { x1: x, x2: x, y1: TIMELINE_PAD.t, y2: bottom, stroke: "#d9480f",
    "stroke-width": 2, class: "step-cursor", "data-step": step === null ? "run" : step });
}

// The run's loss: each logged batch (metrics.jsonl), and the train and val loss at each
// snapshot when timeline.json has them.
function renderLossChart() {
  const scale = stepScale();
  const batches = state.card.training.train;
  const D = timeline.data;
  const splits = D ? Object.keys(D.losses) : [];
  const at = (split) => D.steps.map((s, i) => [s, D.losses[split][i]])
    .filter((p) => p[1] !== null);
  const series = [["train (batch)", "#9dbbe0", batches, false],
    ...splits.map((split, i) => [`${split} (snapshot)`, SPLIT_COLOURS[i % SPLIT_COLOURS.length],
      at(split), true])].filter((s) => s[2].length);
  if (!series.length) {
    $("timeline-loss").replaceChildren(el("p", { class: "hint" }, "this run logged no loss"));
    return;
  }
  const ys = series.flatMap((s) => s[2].map((p) => p[1]));
  const H = 240;
  const { svg, add, Y } = chart(H, smallest(ys), largest(ys), "cross-entropy loss", scale);
  series.forEach(([name, colour, pts, dots], i) => {
    add("polyline", { points: pts.map(([x, y]) => `${scale.X(x)},${Y(y)}`).join(" "),
      fill: "none", stroke: colour, "stroke-width": dots ? 2 : 1.2, "data-series": name });
    for (const [x, y] of dots ? pts : []) {
      add("circle", { cx: scale.X(x), cy: Y(y), r: 3, fill: colour });
    }
    const ly = 22 + 20 * i, lx = TIMELINE_W - TIMELINE_PAD.r + 16;
    add("line", { x1: lx, x2: lx + 24, y1: ly, y2: ly, stroke: colour, "stroke-width": 3 });
    add("text", { x: lx + 30, y: ly + 4 }, name);
  });
  if (D && D.phase_change !== null) phaseChange(add, scale, H, D);
  cursorAndSnapshots(add, scale, H);
  $("timeline-loss").replaceChildren(svg);
}

// The LLC at each snapshot where timeline.json has it (`glassgpt timeline --llc`), with its
// spread over the chains.
function renderLlcChart() {
  const D = timeline.data;
  const pts = D ? D.steps.map((s, i) => [s, D.llc[i], D.llc_std[i] || 0])
    .filter((p) => p[1] !== null) : [];
  $("timeline-llc-box").hidden = pts.length === 0;
  if (!pts.length) return;
  const scale = stepScale();
  const H = 200;
  const { svg, add, Y } = chart(H, smallest(pts.map((p) => p[1] - p[2])),
    largest(pts.map((p) => p[1] + p[2])), "LLC", scale);
  for (const [x, y, sd] of pts) {
    add("line", { x1: scale.X(x), x2: scale.X(x), y1: Y(y - sd), y2: Y(y + sd),
      stroke: "#9467bd", "stroke-width": 1 });
  }
  add("polyline", { points: pts.map(([x, y]) => `${scale.X(x)},${Y(y)}`).join(" "),
    fill: "none", stroke: "#9467bd", "stroke-width": 2, "data-series": "llc" });
  for (const [x, y] of pts) add("circle", { cx: scale.X(x), cy: Y(y), r: 3, fill: "#9467bd" });
  if (D.phase_change !== null) phaseChange(add, scale, H, D);
  cursorAndSnapshots(add, scale, H);
  $("timeline-llc").replaceChildren(svg);
}

// Where timeline.json puts the phase change (the best head's induction score half way up).
function phaseChange(add, scale, height, D) {
  const x = scale.X(D.phase_change);
  const mark = add("line", { x1: x, x2: x, y1: TIMELINE_PAD.t, y2: height - TIMELINE_PAD.b,
    stroke: "#2ca02c", "stroke-width": 1.5, "stroke-dasharray": "5 4", class: "phase-change",
    "data-step": D.phase_change });
  mark.append(document.createElementNS(mark.namespaceURI, "title"));
  mark.firstChild.textContent = `phase change at step ${D.phase_change}: ${D.phase_definition}`;
  add("text", { x: x + 4, y: TIMELINE_PAD.t + 12, fill: "#2ca02c" }, "phase change");
}

// Each head's score at every snapshot, a line a head; click a line to open that head in the
// attention and "Inside one head" panels at the snapshot nearest the click.
function renderHeadChart() {
  const D = timeline.data;
  if (!D || !timeline.kind) {
    $("timeline-heads").replaceChildren();
    return;
  }
  const scale = stepScale();
  const per = D.heads[timeline.kind]; // [snapshot][layer][head]
  const all = per.flatMap((layers) => layers.flat());
  const H = 260;
  const { svg, add, Y } = chart(H, Math.min(0, smallest(all)), Math.max(1, largest(all)),
    timeline.kind === "attribution" ? "direct logit attribution" : "score", scale);
  const L = per[0].length, heads = per[0][0].length;
  const labels = []; // each line's name at its last value, moved apart where they would overlap
  for (let layer = 0; layer < L; layer++) {
    for (let head = 0; head < heads; head++) {
      const pts = D.steps.map((s, i) => `${scale.X(s)},${Y(per[i][layer][head])}`).join(" ");
      const colour = HEAD_COLOURS[(layer * heads + head) % HEAD_COLOURS.length];
      const line = add("polyline", { points: pts, fill: "none", stroke: colour,
        "stroke-width": 2, "stroke-dasharray": layer % 2 ? "6 3" : "none", class: "head-line",
        "data-layer": layer, "data-head": head });
      line.append(document.createElementNS(svg.namespaceURI, "title"));
      line.firstChild.textContent = `L${layer}H${head}: click to open this head`;
      line.addEventListener("click", (event) => clickHeadLine(event, svg, scale, layer, head));
      labels.push({ y: Y(per[per.length - 1][layer][head]), colour, text: `L${layer}H${head}` });
    }
  }
  // Past a dozen heads, only the dozen highest at the last snapshot are named (hover any line).
  const named = labels.sort((a, b) => a.y - b.y).slice(0, MOST_LABELS);
  spreadApart(named, 13, H - TIMELINE_PAD.b).forEach((label) => add("text", {
    x: TIMELINE_W - TIMELINE_PAD.r + 8, y: label.y + 4, fill: label.colour, class: "head-label",
  }, label.text));
  cursorAndSnapshots(add, scale, H);
  $("timeline-heads").replaceChildren(svg);
}

// `labels` ({y}) in order of y, each at least `gap` below the one before, and none below
// `bottom` (those pushed past it move back up).
function spreadApart(labels, gap, bottom) {
  labels.sort((a, b) => a.y - b.y);
  for (let i = 1; i < labels.length; i++) {
    labels[i].y = Math.max(labels[i].y, labels[i - 1].y + gap);
  }
  for (let i = labels.length - 1; i >= 0; i--) {
    const floor = i === labels.length - 1 ? bottom : labels[i + 1].y - gap;
    labels[i].y = Math.min(labels[i].y, floor);
  }
  return labels;
}

function clickHeadLine(event, svg, scale, layer, head) {
  const box = svg.getBoundingClientRect();
  const x = (event.clientX - box.left) * (TIMELINE_W / box.width);
  let nearest = 0;
  timeline.steps.forEach((s, i) => {
    if (Math.abs(scale.X(s) - x) < Math.abs(scale.X(timeline.steps[nearest]) - x)) nearest = i;
  });
  openHead(layer, head);
  if (nearest !== timeline.index) goToStep(nearest);
}

// The numbers at the slider's step, from timeline.json: the losses and the ICL score.
function renderTimelineReadout() {
  const D = timeline.data, step = stepAt(timeline.index);
  const i = D && step !== null ? D.steps.indexOf(step) : -1;
  if (i < 0) {
    $("timeline-readout").textContent = "";
    return;
  }
  const part = (name, value) => value === null ? [] : [`${name} ${value.toFixed(3)}`];
  const spread = D.llc_std[i] === null ? "" : ` ± ${D.llc_std[i].toFixed(2)}`;
  const llc = D.llc[i] === null ? [] : [`LLC ${D.llc[i].toFixed(2)}${spread}`];
  const losses = Object.entries(D.losses).flatMap(([split, v]) => part(`${split} loss`, v[i]));
  const parts = [...losses,
    ...part("ICL score", D.icl_score[i]), ...llc];
  $("timeline-readout").textContent = parts.length ? [`step ${integer(step)}:`, ...parts]
    .join(" ") : "";
  $("timeline-readout").title = D.icl_definition ? `ICL score: ${D.icl_definition}` : "";
}
