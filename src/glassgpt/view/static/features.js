// glassgpt view: the Features panel (sparse dictionaries given with --sae). Loaded before
// app.js, whose helpers ($, el, api, state, fill, visible, shade, diverging, ...) it calls once
// the page has started. Every number comes from /api/features, /api/feature and /api/clamp.
"use strict";

const features = { list: [], feature: null }; // the dictionaries; the feature shown

async function loadDictionaries() {
  features.list = (await api("dictionaries")).dictionaries;
  const none = features.list.length === 0;
  $("features-none").hidden = !none;
  $("features-body").hidden = none;
  fill($("feature-sae"), features.list.map((d) => el("option", { value: d.name },
    `${d.name}: ${d.architecture}, ${integer(d.d_sae)} latents at ${d.hook}`)));
}

function chosenDictionary() { return $("feature-sae").value || null; }

// The top features under each token of the prompt; a chip opens that feature's page.
async function loadFeatures(generation) {
  if (features.list.length === 0) return;
  const answer = await api("features", { prompt: $("prompt").value, sae: chosenDictionary() });
  if (generation !== state.generation) return;
  fill($("features"), answer.positions.map((listed, i) => featureRow(answer, listed, i)));
}

function featureRow(answer, listed, i) {
  const chip = (f) => el("button", {
    type: "button", class: "feature-chip", dataset: { feature: f.id },
    title: `feature ${f.id}: ${f.value.toFixed(4)} (click: its page)`,
    onclick: () => openFeature(f.id) }, `#${f.id} ${f.value.toFixed(2)}`);
  return el("tr", { class: i === state.selected ? "selected" : "", dataset: { pos: i } },
    el("th", { class: "tok" }, visible(answer.tokens[i].text)),
    el("td", {}, listed.map(chip)));
}

// `sae`: the dictionary to open it in (the Graph panel names its transcoder); null: the chosen.
async function openFeature(id, sae = null) {
  if (sae !== null && sae !== chosenDictionary()) {
    $("feature-sae").value = sae;
    loadFeatures(state.generation).catch((e) => showError("feature-error", e.message));
  }
  showError("feature-error", "");
  const position = state.selected === null ? null : state.selected;
  let answer;
  try {
    answer = await api("feature", { sae: chosenDictionary(), feature: id,
      prompt: position === null ? null : $("prompt").value, position });
  } catch (error) {
    showError("feature-error", error.message);
    return;
  }
  features.feature = answer;
  $("feature-page").hidden = false;
  $("feature-page").dataset.feature = id;
  $("feature-title").textContent = `Feature ${id} of ${answer.sae} (${answer.hook})`;
  const d = answer.density;
  $("feature-density").textContent = d === null ? "density: no text to measure it on"
    : `fires on ${(100 * d.value).toFixed(3)}% of tokens (${d.source})`;
  // a cross-layer transcoder's feature: the MLP outputs its decoder writes into, and how hard
  $("feature-writes").hidden = !answer.writes_to;
  $("feature-writes").textContent = answer.writes_to
    ? "writes into " + answer.writes_to.map((w) => `MLP ${w.layer} (decoder norm ${w.norm.toFixed(3)})`).join(", ")
    : "";
  renderContexts(answer);
  renderLogits(answer.logits);
  renderWriters(answer);
  $("clamp-output").hidden = true;
}

// Each context: its tokens shaded by the feature's activation (the strongest context's peak = 1).
function renderContexts(answer) {
  const top = answer.contexts.length ? answer.contexts[0].max : 1;
  const note = answer.scanned === null ? "no validation text at hand: no contexts"
    : `strongest of ${answer.scanned.windows} windows (${integer(answer.scanned.tokens)} tokens)`;
  $("feature-contexts-note").textContent = note;
  fill($("feature-contexts"), answer.contexts.map((c) => el("li", { class: "context" },
    el("span", { class: "readout" }, `${c.max.toFixed(2)} `),
    c.tokens.map((t) => el("span", { class: "ctx-token", title: `${t.value.toFixed(4)}`,
      style: { background: shade(t.value / top), color: inkOn(t.value / top) } },
    visible(t.text))))));
}

function renderLogits(logits) {
  const rows = (list) => list.map((t) => el("tr", {},
    el("td", { class: "tok" }, visible(t.text)), el("td", { class: "num" }, t.value.toFixed(3))));
  fill($("feature-up"), logits ? rows(logits.up) : [el("tr", {}, el("td", {}, "—"))]);
  fill($("feature-down"), logits ? rows(logits.down) : [el("tr", {}, el("td", {}, "—"))]);
}

// Each head's and MLP's direct push on the feature's pre-activation at the selected token.
function renderWriters(answer) {
  const w = answer.writers;
  if (!w) {
    $("feature-writers-sum").textContent = answer.writers_note || "select a token for writers";
    fill($("feature-writers"), []);
    return;
  }
  $("feature-writers-sum").textContent = `at ${tokenName(w.position)}: parts + constant ` +
    `${w.constant.toFixed(3)} = ${w.sum.toFixed(4)} · pre-activation ${w.pre.toFixed(4)} · ` +
    `activation ${w.post.toFixed(4)}`;
  const scale = maxAbs(w.values, 1e-9);
  fill($("feature-writers"), w.order.map((i) => {
    const v = w.values[i];
    const bar = el("div", { class: `bar ${v < 0 ? "negative" : "positive"}`,
      style: { width: `${Math.max(0.5, (100 * Math.abs(v)) / scale)}%` } });
    return el("tr", { dataset: { label: w.labels[i], value: v } },
      el("td", { class: "tok" }, w.labels[i]), el("td", { class: "num" }, v.toFixed(4)),
      el("td", { class: "bar-cell split" },
        el("div", { class: "half left" }, v < 0 ? bar : ""),
        el("div", { class: "half right" }, v < 0 ? "" : bar)));
  }));
}

async function runClamp(event) {
  event.preventDefault();
  if (!features.feature) return;
  const how = $("clamp-how").value;
  const amount = Number($("clamp-amount").value);
  const body = { prompt: $("prompt").value, sae: features.feature.sae,
    feature: features.feature.feature, value: how === "value" ? amount : null,
    scale: how === "scale" ? amount : null, temperature: numberOrNull("temperature") ?? 0,
    max_new_tokens: numberOrNull("clamp-tokens") ?? 40, seed: numberOrNull("seed") };
  showError("feature-error", "");
  $("clamp-status").textContent = "sampling…";
  try {
    const answer = await api("clamp", body);
    $("clamp-untouched").textContent = answer.untouched.text;
    $("clamp-clamped").textContent = answer.clamped.text;
    $("clamp-output").hidden = false;
    $("clamp-status").textContent = `seed ${answer.seed}`;
  } catch (error) {
    $("clamp-status").textContent = "";
    showError("feature-error", error.message);
  }
}

function startFeatures() {
  $("feature-sae").addEventListener("change", () =>
    loadFeatures(state.generation).catch((e) => showError("feature-error", e.message)));
  $("clamp-form").addEventListener("submit", runClamp);
  return loadDictionaries();
}
