// glassgpt view: the panels that ask *why* (Patching, Attribution, Inside the MLP, the head
// scores' badges). Loaded before app.js, whose helpers ($, el, api, state, ...) these
// functions call once the page has started.
"use strict";

// --- inside the MLP --------------------------------------------------------------------------

async function loadMlp(generation) {
  if (state.selected === null) return;
  const position = state.selected;
  const layer = state.inside.layer;
  const answer = await api("mlp", { prompt: $("prompt").value, layer, position });
  if (generation !== state.generation || position !== state.selected) return;
  $("mlp-query").textContent = answer.note ||
    `${tokenName(position)} through the MLP of layer ${layer} · hidden width ${answer.hidden}` +
    (answer.gated ? ` (gated: ${state.card.model.activation === "geglu" ? "GeGLU" : "SwiGLU"})` : "");
  $("mlp").replaceChildren(...answer.steps.map((step) => stepItem(step, position)));
  Object.assign($("mlp").dataset, { layer, position });
}

// One step of a walk (a head's or the MLP's): title, shape, the line computing it, values.
// `first`: the first key a head's query sees (later than 0 on a local layer).
function stepItem(step, p, first = 0) {
  return el("li", { class: "step", dataset: { step: step.name } },
    el("div", { class: "step-head" },
      el("span", { class: "step-title" }, step.title),
      el("span", { class: "shape" }, `(${step.shape.join(", ")})`),
      el("code", { class: "where", title: step.source.text },
        `${step.source.file}:${step.source.line} ${step.source.function}`)),
    el("pre", { class: "code" }, step.source.text),
    stepBody(step, p, first));
}

// --- head scores as badges -------------------------------------------------------------------

const BADGE_STRONG = 0.4; // a score above this is drawn as a strong badge

// What the scores were measured on: the run's own text when the server has it (a model trained
// on text may copy only text that looks like its own), else random tokens.
function scoresSource(scores) {
  const each = `${scores.half} tokens, each followed by itself`;
  return scores.text === "validation"
    ? `${scores.sequences} windows of this run's validation text of ${each}`
    : `${scores.sequences} random sequences over the whole vocabulary of ${each} (this run's ` +
      "validation text is not at hand; a model trained on text may copy only text like its own)";
}

function badgesNote(scores) {
  if (!scores) return "";
  return "Badges: each head's previous-token (prev) and induction (ind) score, the attention " +
    "it puts on the token before, and on the token after the current token's earlier copy, " +
    `measured on ${scoresSource(scores)}.`;
}

function scoreBadges(scores, layer, head) {
  if (!scores) return [];
  const badge = (kind, label, value) => el("span", {
    class: `badge ${kind}` + (value >= BADGE_STRONG ? " strong" : ""),
    dataset: { kind, value },
    title: `${label} score ${value.toFixed(3)} (on ${scoresSource(scores)})` },
  `${label === "previous-token" ? "prev" : "ind"} ${value.toFixed(2)}`);
  return [el("div", { class: "badges" },
    badge("previous", "previous-token", scores.previous_token[layer][head]),
    badge("induction", "induction", scores.induction[layer][head]))];
}

// --- patching --------------------------------------------------------------------------------

const PATCH_MAPS = [["resid_pre", "residual stream entering each layer", "pos"],
  ["attn_out", "attention output", "pos"], ["mlp_out", "MLP output", "pos"],
  ["heads", "each head's output (every position)", "head"]];

function fillAnswers(select, candidates, chosen) {
  select.replaceChildren(...candidates.map((t) => el("option", { value: t.id },
    `${visible(t.text)} (id ${t.id})`)));
  select.value = String(chosen);
}

async function runPatching() {
  const clean = $("patch-clean").value;
  const corrupted = $("patch-corrupted").value;
  const body = { clean, corrupted: corrupted || null, answer: null, wrong: null };
  // The chosen answers hold for the prompts they were chosen for.
  const same = state.patching && state.patching.clean.text === clean &&
    state.patching.corrupted.text === corrupted;
  if (same && $("patch-answer").value !== "") {
    body.answer = Number($("patch-answer").value);
    body.wrong = Number($("patch-wrong").value);
  }
  $("patch-status").textContent = "patching…";
  showError("patch-error", "");
  showError("patch-warning", "");
  const polling = pollProgress();
  let answer;
  try {
    answer = await api("patching", body);
  } catch (error) {
    $("patch-status").textContent = "";
    showError("patch-error", error.message);
    return;
  } finally {
    polling.stop();
  }
  state.patching = answer;
  $("patch-corrupted").value = answer.corrupted.text;
  fillAnswers($("patch-answer"), answer.candidates, answer.answer.id);
  fillAnswers($("patch-wrong"), answer.candidates, answer.wrong.id);
  const d = answer.logit_diff;
  $("patch-status").textContent = `logit('${visible(answer.answer.text)}') − ` +
    `logit('${visible(answer.wrong.text)}'): clean ${d.clean.toFixed(3)}, corrupted ` +
    `${d.corrupted.toFixed(3)} · ${integer(answer.passes)} forward passes`;
  showError("patch-warning", answer.warnings.join(" · "));
  renderPatching(answer);
}

// While a patching request runs (hundreds of forward passes: minutes on a large model), how
// far it is, from GET /api/progress, every PROGRESS_POLL_MS.
const PROGRESS_POLL_MS = 500;

function pollProgress() {
  let stopped = false;
  let timer = null;
  const tick = async () => {
    try {
      const p = await api("progress");
      if (!stopped && p.task === "patching" && p.running) {
        $("patch-status").textContent = progressText(p);
      }
    } catch (error) {
      // The patching answer itself says what went wrong.
    }
    if (!stopped) timer = setTimeout(tick, PROGRESS_POLL_MS);
  };
  timer = setTimeout(tick, PROGRESS_POLL_MS);
  return { stop() { stopped = true; clearTimeout(timer); } };
}

function progressText(p) {
  const left = p.seconds_left === null ? "" : `, about ${duration(p.seconds_left)} left`;
  return `patching… ${integer(p.done)} of ${integer(p.total)} forward passes ` +
    `(${duration(p.seconds)}${left})`;
}

function duration(seconds) {
  return seconds < 90 ? `${Math.round(seconds)} s` : `${Math.round(seconds / 60)} min`;
}

function renderPatching(answer) {
  const tokens = answer.clean.tokens.map((t, i) => {
    const other = answer.corrupted.tokens[i];
    return other.id === t.id ? visible(t.text) : `${visible(t.text)}/${visible(other.text)}`;
  });
  // An attention-only model has no MLP output map.
  const drawn = PATCH_MAPS.filter(([name]) => answer[name] !== undefined);
  $("patching").replaceChildren(...drawn.map(([name, title, across]) => {
    const values = answer[name];
    const columns = across === "pos" ? tokens : values[0].map((_, h) => `head ${h}`);
    const header = el("tr", {}, el("th", {}, ""), columns.map((c) => el("th", {}, c)));
    const rows = values.map((row, layer) => el("tr", {}, el("th", {}, `layer ${layer}`),
      row.map((v, i) => patchCell(name, layer, i, v, across))));
    return el("div", { class: "patch-map", dataset: { map: name } },
      el("h3", {}, title),
      el("div", { class: "patch-scroll" }, el("table", { class: "patch" }, header, ...rows)));
  }));
  // A long prompt's maps scroll: show their end, where the answer is read.
  for (const box of document.querySelectorAll("#patching .patch-scroll")) {
    box.scrollLeft = box.scrollWidth;
  }
}

// Two decimals, and never "-0.00" for a value that rounds to 0.
function twoPlaces(v) { return (Math.abs(v) < 0.005 ? 0 : v).toFixed(2); }

function patchCell(name, layer, i, v, across) {
  const where = across === "pos" ? `position ${i}` : `head ${i}`;
  const props = { dataset: { layer, [across]: i, value: v }, title:
      `${name}, layer ${layer}, ${where}: ${v.toFixed(3)}` +
      (across === "head" ? " (click: inside this head)" : ""),
    style: { background: diverging(v, 1), color: Math.abs(v) > 0.6 ? "#fff" : "#1d2430" } };
  if (across === "head") {
    props.class = "clickable";
    props.onclick = () => openInside(layer, i);
  }
  return el("td", props, twoPlaces(v));
}

// A head of the patching map clicked: the clean prompt in the page, that head inside, its
// query the last token (where patching reads the answer), not a position chosen before.
async function openInside(layer, head) {
  const clean = state.patching.clean.text;
  state.inside = { layer, head };
  $("inside-layer").value = String(layer);
  $("inside-head").value = String(head);
  if ($("prompt").value !== clean) {
    $("prompt").value = clean;
    await promptChanged(); // a new prompt: every panel loads at its last token
  } else if (state.selected !== state.tokens.length - 1) {
    select(state.tokens.length - 1); // loads "Inside one head" too
  } else {
    await Promise.all([loadInside(state.generation), loadMlp(state.generation)]);
  }
  $("head-section").scrollIntoView();
}

// --- attribution -----------------------------------------------------------------------------

async function loadAttribution(generation, token = null, against = null) {
  if (state.selected === null) return;
  const position = state.selected;
  let answer;
  try {
    answer = await api("attribution", { prompt: $("prompt").value, position, token, against });
  } catch (error) {
    if (generation !== state.generation) return;
    // A Post-LN model, or a token against itself: said in the panel, the prompt is fine.
    if (!/Pre-LN|against/.test(error.message)) throw error;
    showError("attribution-error", error.message);
    $("attribution").replaceChildren();
    return;
  }
  if (generation !== state.generation || position !== state.selected) return;
  showError("attribution-error", "");
  fillAnswers($("attribution-token"), answer.candidates, answer.token.id);
  fillAgainst(answer);
  state.attribution = { answer, all: false };
  renderAttribution();
}

// The tokens to subtract: none (the logit itself), or another candidate.
function fillAgainst(answer) {
  const others = answer.candidates.filter((t) => t.id !== answer.token.id);
  fill($("attribution-against"), [el("option", { value: "" }, "nothing (the logit itself)"),
    ...others.map((t) => el("option", { value: t.id }, `${visible(t.text)} (id ${t.id})`))]);
  $("attribution-against").value = answer.against === null ? "" : String(answer.against.id);
}

function chosenAttribution() {
  const against = $("attribution-against").value;
  return [Number($("attribution-token").value), against === "" ? null : Number(against)];
}

// The parts, largest push (either sign) first; the first `answer.shown` until "show all".
function renderAttribution() {
  const { answer, all } = state.attribution;
  const scale = maxAbs(answer.values, 1e-9);
  const capped = answer.softcap ? " (before the soft-cap)" : "";
  const what = answer.against === null ? `'${visible(answer.token.text)}'`
    : `'${visible(answer.token.text)}' − '${visible(answer.against.text)}'`;
  $("attribution-sum").replaceChildren(
    `${what} after ${tokenName(answer.position)}: sum of the parts `,
    el("b", { id: "attribution-total" }, answer.sum.toFixed(4)),
    answer.against === null ? " · the model's logit " : " · the model's logit difference ",
    el("b", { id: "attribution-logit" }, answer.logit.toFixed(4)), capped);
  const rows = all ? answer.order : answer.order.slice(0, answer.shown);
  const more = answer.order.length - answer.shown;
  const button = $("attribution-all");
  button.hidden = more <= 0;
  button.textContent = all ? `show the largest ${answer.shown}` : `show all ${answer.order.length}`;
  fill($("attribution"), rows.map((i) => {
    const label = answer.labels[i];
    const v = answer.values[i];
    // Negative pushes grow left of the middle, positive ones right of it.
    const width = `${Math.max(0.5, (100 * Math.abs(v)) / scale)}%`;
    const bar = el("div", { class: `bar ${v < 0 ? "negative" : "positive"}`, style: { width } });
    return el("tr", { dataset: { label, value: v } },
      el("td", { class: "tok" }, label),
      el("td", { class: "num" }, v.toFixed(4)),
      el("td", { class: "bar-cell split" },
        el("div", { class: "half left" }, v < 0 ? bar : ""),
        el("div", { class: "half right" }, v < 0 ? "" : bar)));
  }));
}
