// rlstream console: polls the console's JSON (/api/...) and draws the page. Every text from the topics is set with
// textContent (never parsed as HTML): trajectories are untrusted input.
"use strict";

const KEY_STORE = "rlstream-console-key";
let chart = null;
let last = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function fmt(x, digits = 3) { return x === null || x === undefined ? "–" : Number(x).toFixed(digits); }
function when(ts) { return ts ? new Date(ts * 1000).toLocaleTimeString() : ""; }

async function api(path) {
  const key = sessionStorage.getItem(KEY_STORE);
  const response = await fetch(path, key ? { headers: { Authorization: "Bearer " + key } } : {});
  if (response.status === 401 || response.status === 403) {
    document.getElementById("key-form").hidden = false;
    throw new Error("an admin key is needed (" + response.status + ")");
  }
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

function drawSummary(s) {
  const serving = s.serving && s.serving.version !== undefined ? "v" + s.serving.version : "–";
  const canary = s.serving && s.serving.canary_version != null
    ? `, canary v${s.serving.canary_version} on ${Math.round(s.serving.canary_share * 100)}%` : "";
  document.getElementById("summary").textContent =
    `policy ${s.policy} · run ${s.run_id} · serving ${serving}${canary} · newest candidate ` +
    `${s.latest != null && s.latest >= 0 ? "v" + s.latest : "–"} · updated ${when(s.now)}`;
}

function drawChart(c) {
  const box = document.getElementById("chart");
  const data = [c.version, c.heldout_reward, c.training_reward, c.tool_call_parse_rate, c.answer_parse_rate];
  if (chart && chart.data[0].length === c.version.length) { chart.setData(data); return; }
  if (chart) chart.destroy();
  const width = Math.max(400, box.clientWidth || 900);
  chart = new uPlot({
    width, height: 260,
    scales: { x: { time: false }, y: { range: [0, 1.05] } },
    axes: [{ label: "policy version", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000] }, { label: "mean / rate" }],
    series: [
      { label: "version" },
      { label: "held-out reward", stroke: "#2563eb", width: 2, points: { size: 6 } },
      { label: "training reward", stroke: "#9333ea", dash: [6, 4], points: { size: 5 } },
      { label: "tool-call parse rate", stroke: "#16a34a", points: { size: 5 } },
      { label: "answer parse rate", stroke: "#ca8a04", points: { size: 4 } },
    ],
  }, data, box);
}

function badge(status) {
  return el("span", { class: "badge " + status.replace(/[^a-z]+/g, "-").replace(/-+$/, ""), text: status });
}

function testsLine(tests) {
  if (!tests || !tests.length) return null;
  return el("div", { class: "tests" }, tests.map(t =>
    `${t.reference} v${t.reference_version ?? "?"} ${t.figure}: diff ${fmt(t.mean_difference)}, lower bound ` +
    `${fmt(t.lower_bound)} vs −${t.margin}, n ${t.n ?? "?"}, p ${fmt(t.p_value)} ${t.passed ? "passed" : "FAILED"}`)
    .join("; "));
}

function drawVersions(rows) {
  const body = document.querySelector("#versions tbody");
  body.replaceChildren(...rows.slice().reverse().map(r => {
    const stages = el("td", { class: "stages" }, ...r.stages.map(s => el("div",
      { class: "stage stage-" + s.stage.replace(/[^a-z]+/g, "-") },
      badge(s.stage), " ", el("span", { class: "when", text: when(s.at) }), " ",
      el("span", { class: "reason", text: s.reason || "" }), testsLine(s.tests))));
    return el("tr", { "data-version": String(r.version), "data-status": r.status },
      el("td", { text: "v" + r.version }), el("td", {}, badge(r.status)),
      el("td", { text: fmt(r.heldout.reward_mean) }), el("td", { text: fmt(r.training_reward) }),
      el("td", { text: fmt(r.heldout.tool_call_parse_rate, 2) }),
      el("td", { text: r.heldout.samples != null ? String(r.heldout.samples) : String(r.groups) + " groups" }),
      stages);
  }));
}

function drawRates(s) {
  const f = s.feedback;
  document.getElementById("feedback").replaceChildren(
    el("div", { text: `${f.total} rewards (${fmt(f.per_min, 1)}/min over the last 10 min), ${f.corrections} corrections` }),
    el("div", { text: `feedback to serving: p50 ${fmt(f.to_serving_p50_s, 1)} s, p90 ${fmt(f.to_serving_p90_s, 1)} s` +
      (f.trained_not_serving != null ? `; ${f.trained_not_serving} trained, not serving yet` : "") }));
  document.getElementById("dlq").textContent = `${s.dlq.total} dead letters (${fmt(s.dlq.per_min, 1)}/min)`;
  document.querySelector("#dlq-reasons tbody").replaceChildren(...s.dlq.reasons.map(r => el("tr", {},
    el("td", { text: r.topic }), el("td", { text: r.error_type }), el("td", { text: String(r.count) }),
    el("td", { text: r.last_message || "" }))));
  document.getElementById("errors").textContent = (s.errors || []).join(" · ");
}

function fillSelect(id, values, label) {
  const select = document.getElementById(id);
  const before = select.value;
  const wanted = values.map(String);
  if ([...select.options].map(o => o.value).join() !== wanted.join()) {
    select.replaceChildren(...values.map(v => el("option", { value: String(v), text: label(v) })));
    if (wanted.includes(before)) select.value = before;
    return true;
  }
  return false;
}

function tokens(turn) {
  if (!turn.token_ids.length) return null;
  return el("div", { class: "tokens" }, ...turn.token_ids.map((id, i) => {
    const lp = turn.logprobs[i];
    const p = lp == null ? 1 : Math.exp(lp);
    const tok = el("span", { class: "tok", text: String(id),
      title: lp == null ? "no logprob" : `token ${id}: logprob ${lp.toFixed(3)} (p ${p.toFixed(2)})` });
    tok.style.background = `rgba(220, 38, 38, ${(1 - p) * 0.85 + 0.05})`;
    return tok;
  }));
}

function trajectory(t) {
  const comps = Object.entries(t.reward_components).map(([k, v]) => `${k} ${fmt(v, 2)}`).join(", ");
  const node = el("div", { class: "trajectory", "data-trajectory": t.trajectory_id },
    el("div", { class: "head", text: `v${t.policy_version} · ${t.source} · example ${t.example_id} · reward ` +
      `${fmt(t.reward)} · advantage ${fmt(t.advantage)}` }),
    comps ? el("div", { class: "components", text: "components: " + comps }) : null);
  for (const m of t.messages) {
    const msg = el("div", { class: "msg " + m.role }, el("span", { class: "role", text: m.role +
      (m.tool_call_id ? ` (result of ${m.tool_call_id})` : "") }), m.content || "");
    for (const c of m.tool_calls) msg.append(el("span", { class: "tool-call", text: `${c.name}(${c.arguments})` }));
    node.append(msg);
  }
  for (const turn of t.turns) {
    const shaded = tokens(turn);
    if (shaded) node.append(el("div", { class: "note", text: "completion tokens (ids), shaded by improbability:" }), shaded);
  }
  return node;
}

async function drawSamples(force) {
  const version = document.getElementById("sample-version").value;
  if (version === "") return;
  const data = await api(`/api/versions/${encodeURIComponent(version)}/samples`);
  const box = document.getElementById("samples");
  if (!force && box.dataset.version === version && box.dataset.count === String(data.trajectories.length)) return;
  box.dataset.version = version; box.dataset.count = String(data.trajectories.length);
  box.replaceChildren(...data.trajectories.map(trajectory));
}

async function drawCompare() {
  const example = document.getElementById("compare-example").value;
  const a = document.getElementById("compare-a").value, b = document.getElementById("compare-b").value;
  if (!example || a === "" || b === "") return;
  const data = await api(`/api/compare?example=${encodeURIComponent(example)}&a=${a}&b=${b}`);
  const column = side => el("div", {}, el("h3", { text: `v${side.version}` + (data.heldout ? " (held-out)" : "") }),
    ...(side.answers.length ? side.answers.map(trajectory) : [el("p", { class: "note", text: "no answer kept" })]));
  document.getElementById("compare").replaceChildren(column(data.a), column(data.b));
}

function compareChoices(s) {
  const examples = s.compare_examples;
  fillSelect("compare-example", examples.map(e => e.example_id),
    id => id + (examples.find(e => e.example_id === id).heldout ? " (held-out)" : ""));
  const chosen = examples.find(e => e.example_id === document.getElementById("compare-example").value);
  const versions = chosen ? chosen.versions : [];
  const changedA = fillSelect("compare-a", versions, v => "v" + v);
  const changedB = fillSelect("compare-b", versions, v => "v" + v);
  if ((changedA || changedB) && versions.length >= 2) {
    document.getElementById("compare-a").value = String(versions[versions.length - 2]);
    document.getElementById("compare-b").value = String(versions[versions.length - 1]);
  }
}

async function refresh() {
  try {
    const s = await api("/api/state");
    last = s;
    document.getElementById("key-form").hidden = true;
    drawSummary(s); drawChart(s.curves); drawVersions(s.versions); drawRates(s);
    const newSample = fillSelect("sample-version", s.sampled_versions.slice().reverse(), v => "v" + v);
    await drawSamples(newSample);
    compareChoices(s);
    await drawCompare();
    document.body.dataset.loaded = "true";
  } catch (err) {
    document.getElementById("summary").textContent = String(err.message || err);
  }
}

document.getElementById("key-form").addEventListener("submit", ev => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_STORE, document.getElementById("key").value);
  refresh();
});
document.getElementById("sample-version").addEventListener("change", () => drawSamples(true));
document.getElementById("compare-example").addEventListener("change", () => { compareChoices(last); drawCompare(); });
document.getElementById("compare-a").addEventListener("change", drawCompare);
document.getElementById("compare-b").addEventListener("change", drawCompare);
refresh();
setInterval(refresh, 2000);
