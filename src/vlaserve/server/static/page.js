// The page at /: a view over the public routes (metadata, /stats, /v1/actions/generations), nothing else.
// Every URL is relative, so the page works behind a proxy that serves the server under a path.
"use strict";

const FAMILIES = { pi05: "Pi0.5", pi0: "Pi0" };
const SAMPLES = ["base.jpg", "left_wrist.jpg", "right_wrist.jpg"]; // one per camera, in order (cycled)
const STAGES = [["decode_ms", "decode"], ["preprocess_ms", "preprocess"], ["prefix_ms", "prefix"],
                ["denoise_ms", "denoise"]];
const COLORS = ["#4f46e5", "#0891b2", "#059669", "#d97706", "#dc2626", "#7c3aed", "#db2777",
                "#2563eb", "#0d9488", "#65a30d", "#ea580c", "#e11d48", "#9333ea", "#475569"];
const SVG = "http://www.w3.org/2000/svg";

const page = { apiKey: null, meta: null, images: {}, keyRequired: false };
const $ = (id) => document.getElementById(id);

// ---- the API -------------------------------------------------------------------------------------
function authHeaders(extra = {}) {
  return page.apiKey ? { ...extra, Authorization: `Bearer ${page.apiKey}` } : extra;
}

async function call(path, init = {}) {
  const response = await fetch(path, { ...init, headers: authHeaders(init.headers) });
  const text = await response.text();
  let body = text;
  try { body = JSON.parse(text); } catch (e) { /* not JSON: shown as it came */ }
  return { status: response.status, body };
}

async function loadMetadata() {
  const { status, body } = await call("v1/actions/metadata");
  if (status === 401) {
    page.keyRequired = true;
    showAuth(body.error.message);
    if (!page.meta) $("try-waiting").textContent = "Enter the API key above to load the model.";
    return;
  }
  if (status !== 200) {
    showAuth(`${status}: ${body.error ? body.error.message : body}`);
    return;
  }
  if (page.keyRequired) showAuth("", true);
  page.meta = body;
  showServer(body);
  buildForm(body);
}

// ---- status ----------------------------------------------------------------------------------------
function showAuth(message, accepted = false) {
  $("auth").hidden = false;
  $("auth").classList.toggle("accepted", accepted);
  $("auth-message").textContent = accepted ? "key accepted" : message;
  if (!accepted) $("api-key").focus();
}

function parameterCount(meta) {
  const total = Object.values(meta.parameter_counts || {}).reduce((a, b) => a + b, 0);
  if (!total) return "";
  for (const [unit, size] of [["B", 1e9], ["M", 1e6], ["K", 1e3]]) {
    if (total >= size) return ` · ${(total / size).toFixed(total >= 10 * size ? 0 : 1)}${unit} parameters`;
  }
  return ` · ${total} parameters`;
}

function showServer(meta) {
  const family = FAMILIES[meta.policy_family] || meta.policy_family;
  $("served-name").textContent = meta.model;
  $("demo-badge").hidden = !meta.is_demo;
  $("info-model").textContent = `${family}${parameterCount(meta)}`;
  $("info-family").textContent = meta.policy_family;
  $("info-served").textContent = meta.model;
  $("info-checkpoint").textContent = meta.checkpoint;
  $("info-checkpoint").title = meta.checkpoint;
  $("info-device").textContent = meta.device;
  const precision = meta.precision && meta.precision.precision;
  $("info-precision").textContent = precision && precision !== "bf16" ? `${meta.dtype} · ${precision}` : meta.dtype;
  $("info-cameras").textContent = meta.cameras.join(", ");
  $("info-state").textContent = meta.input.state_dim;
  $("info-actions").textContent = `${meta.output.action_horizon} steps × ${meta.output.action_dim} dims`;
  document.title = `${meta.model} · vlaserve`;
}

function duration(seconds) {
  const s = Math.floor(seconds);
  const [d, h, m] = [Math.floor(s / 86400), Math.floor(s / 3600) % 24, Math.floor(s / 60) % 60];
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  return m ? `${m}m ${s % 60}s` : `${s % 60}s`;
}

const ms = (value) => (value === null || value === undefined ? "–" : value < 10 ? `${value.toFixed(1)} ms`
                                                                             : `${Math.round(value)} ms`);

async function refreshStats() {
  try {
    const { status, body } = await call("stats");
    if (status !== 200) throw new Error(body.error ? body.error.message : String(status));
    const labels = { ok: "serving", starting: "starting", failed: "failed" };
    $("health").textContent = labels[body.status] || body.status;
    $("health").className = `pill ${body.status}`;
    const graphs = body.graphs;
    $("info-graphs").textContent = graphs.total ? `${graphs.captured} / ${graphs.total} captured` : "none (no fast path)";
    $("info-uptime").textContent = duration(body.uptime_s);
    $("stat-requests").textContent = body.requests;
    $("stat-p50").textContent = ms(body.latency_ms && body.latency_ms.p50);
    $("stat-p99").textContent = ms(body.latency_ms && body.latency_ms.p99);
    $("stat-robots").textContent = body.connections;
    $("stat-note").textContent = `${body.errors} failed · ${body.websocket_sessions} websocket session` +
                                 `${body.websocket_sessions === 1 ? "" : "s"} open`;
  } catch (error) {
    $("health").textContent = "unreachable";
    $("health").className = "pill failed";
  }
}

// ---- Try it ----------------------------------------------------------------------------------------
function buildForm(meta) {
  const cameras = $("cameras");
  cameras.replaceChildren();
  for (const camera of meta.cameras) {
    const tile = document.createElement("label");
    tile.className = "camera";
    tile.dataset.camera = camera;
    tile.innerHTML = '<div class="frame"><span>choose a PNG or JPEG</span></div><div class="camera-name"></div>' +
                     '<input type="file" accept="image/png,image/jpeg">';
    tile.querySelector(".camera-name").textContent = camera;
    tile.querySelector("input").addEventListener("change", (event) => {
      if (event.target.files.length) setImage(camera, event.target.files[0], event.target.files[0].name);
    });
    cameras.append(tile);
  }
  const size = meta.input.state_dim;
  $("state").value = Array(size).fill(0).join(", ");
  $("state-size").textContent = `${size} numbers`;
  $("steps").value = meta.defaults.num_inference_steps;
  $("try-waiting").hidden = true;
  $("try-form").hidden = false;
  $("use-samples").hidden = false;
  if (meta.is_demo) useSamples();
}

function setImage(camera, blob, name) {
  page.images[camera] = blob;
  const frame = document.querySelector(`.camera[data-camera="${camera}"] .frame`);
  const img = document.createElement("img");
  img.src = URL.createObjectURL(blob);
  img.alt = name;
  frame.replaceChildren(img);
}

async function useSamples() {
  await Promise.all(page.meta.cameras.map(async (camera, i) => {
    const name = SAMPLES[i % SAMPLES.length];
    const response = await fetch(`page-assets/samples/${name}`);
    setImage(camera, await response.blob(), name);
  }));
}

function dataUrl(blob) { // the API takes a PNG or JPEG in JSON as a data: URL
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

function integerField(id) {
  const text = $(id).value.trim();
  return text === "" ? undefined : Number(text); // the API checks the value; its message is shown
}

async function generate(event) {
  event.preventDefault();
  const images = {};
  for (const camera of page.meta.cameras) {
    if (page.images[camera]) images[camera] = await dataUrl(page.images[camera]);
  }
  let state;
  try {
    state = JSON.parse(`[${$("state").value}]`);
  } catch (error) {
    return showError("state", "the state must be numbers separated by commas");
  }
  const body = { input: { task: $("task").value, observation: { images, state } },
                 parameters: { seed: integerField("seed"), num_inference_steps: integerField("steps") } };
  $("generate").disabled = true;
  $("request-note").textContent = "running…";
  try {
    const { status, body: reply } = await call("v1/actions/generations", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    if (status === 200) showChunk(reply, body.parameters);
    else if (reply.error) showError(`${status} ${reply.error.type}${reply.error.field ? ` · ${reply.error.field}` : ""}`,
                                    reply.error.message);
    else showError(String(status), typeof reply === "string" ? reply : JSON.stringify(reply));
    if (status === 401) showAuth(reply.error.message);
  } catch (error) {
    showError("request failed", String(error));
  } finally {
    $("generate").disabled = false;
    $("request-note").textContent = "POST /v1/actions/generations";
    refreshStats();
  }
}

function showError(head, message) {
  $("result").hidden = false;
  $("output").hidden = true;
  $("error").hidden = false;
  $("error-head").textContent = head;
  $("error-message").textContent = message;
  $("chunk-summary").textContent = "";
}

// ---- the chunk ---------------------------------------------------------------------------------------
function showChunk(reply, parameters) {
  const actions = reply.data[0].action.values; // [horizon][dim]
  $("result").hidden = false;
  $("error").hidden = true;
  $("output").hidden = false;
  const seed = parameters.seed === undefined ? "random noise" : `seed ${parameters.seed}`;
  $("chunk-summary").textContent =
    `${actions.length} steps × ${actions[0].length} dims · ${reply.usage.denoise_steps} denoising steps · ${seed}`;
  drawTimings(reply.timings || {});
  drawPlot(actions);
}

function drawTimings(timings) {
  const box = $("timings");
  box.replaceChildren();
  const total = STAGES.reduce((sum, [key]) => sum + (timings[key] || 0), 0) || 1;
  const bar = document.createElement("div");
  bar.className = "bar";
  const legend = document.createElement("div");
  legend.className = "legend";
  STAGES.forEach(([key, name], i) => {
    const value = timings[key] || 0;
    const part = document.createElement("span");
    part.style.width = `${(100 * value) / total}%`;
    part.style.background = COLORS[i];
    part.title = `${name} ${ms(value)}`;
    bar.append(part);
    const item = document.createElement("span");
    item.innerHTML = `<i style="background:${COLORS[i]}"></i>${name} <b></b>`;
    item.querySelector("b").textContent = ms(timings[key]);
    item.dataset.stage = key;
    legend.append(item);
  });
  const whole = document.createElement("span");
  whole.className = "total";
  whole.textContent = `total ${ms(timings.total_ms)}`;
  legend.append(whole);
  box.append(bar, legend);
}

function drawPlot(actions) {
  const plot = $("plot");
  plot.replaceChildren();
  plot.dataset.actions = JSON.stringify(actions); // exactly what was plotted: the reply's values
  const [width, height, left, top] = [220, 96, 34, 8];
  const horizon = actions.length;
  for (let dim = 0; dim < actions[0].length; dim++) {
    const values = actions.map((row) => row[dim]);
    let [low, high] = [Math.min(...values), Math.max(...values)];
    if (high - low < 1e-9) { low -= 1; high += 1; }
    const pad = (high - low) * 0.08;
    [low, high] = [low - pad, high + pad];
    const x = (t) => left + ((width - left - 4) * t) / Math.max(horizon - 1, 1);
    const y = (v) => top + ((height - top - 16) * (high - v)) / (high - low);

    const cell = document.createElement("figure");
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
    const add = (tag, attributes, text) => {
      const node = document.createElementNS(SVG, tag);
      for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
      if (text !== undefined) node.textContent = text;
      svg.append(node);
      return node;
    };
    add("rect", { x: left, y: top, width: width - left - 4, height: height - top - 16, class: "plot-area" });
    if (low < 0 && high > 0) add("line", { x1: left, x2: width - 4, y1: y(0), y2: y(0), class: "zero" });
    add("text", { x: left - 4, y: top + 8, class: "tick end" }, (high - pad).toFixed(2));
    add("text", { x: left - 4, y: height - 18, class: "tick end" }, (low + pad).toFixed(2));
    add("text", { x: left, y: height - 4, class: "tick" }, "0");
    add("text", { x: width - 4, y: height - 4, class: "tick end" }, String(horizon - 1));
    const line = add("polyline", {
      points: values.map((v, t) => `${x(t).toFixed(2)},${y(v).toFixed(2)}`).join(" "),
      stroke: COLORS[dim % COLORS.length], class: "series" });
    line.dataset.dim = dim;
    line.dataset.values = JSON.stringify(values);
    const caption = document.createElement("figcaption");
    caption.textContent = `dim ${dim}`;
    cell.append(caption, svg);
    plot.append(cell);
  }
}

// ---- start ---------------------------------------------------------------------------------------------
document.addEventListener("DOMContentLoaded", () => {
  $("auth-form").addEventListener("submit", (event) => {
    event.preventDefault();
    page.apiKey = $("api-key").value || null;
    $("auth-message").textContent = "checking the key…";
    loadMetadata();
  });
  $("try-form").addEventListener("submit", generate);
  $("use-samples").addEventListener("click", () => page.meta && useSamples());
  loadMetadata();
  refreshStats();
  setInterval(refreshStats, 2000);
});
