// The web page: generate and edit through the server's OpenAI API (streamed partial images), a gallery of the
// results (kept in the browser's storage; download, "edit this"), and a live panel of the engine
// (GET /v1/engine/live). Plain JS, no build step, no CDN.
"use strict";
const $ = (id) => document.getElementById(id);
const TAB = "tab-" + Math.random().toString(16).slice(2, 6);  // sent as `user`: the live panel names forwards by it
window.tabId = TAB;
window.partialsShown = 0;   // read by the browser tests: partial images this tab's last request displayed
window.completed = false;
window.completedCount = 0;
window.liveMaxUsers = 0;    // the most tabs / users seen in one forward
let mode = "generate";
let sizes = null;           // the model's size range from /v1/models (null: any size)
let defaultSize = "64x64";
const GALLERY_KEY = "stepbatch-gallery";
const GALLERY_MOST = 24;    // NOTE: data URLs in localStorage (about 5 MB): the newest only

function headers(extra = {}) {
  const h = { ...extra };
  if ($("apikey").value) h.Authorization = `Bearer ${$("apikey").value}`;
  return h;
}

// ------------------------------------------------------------------------------------------------ model
async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) return;
    const card = (await response.json()).data[0];
    defaultSize = card.default_size || defaultSize;
    sizes = card.sizes;
    const edits = Object.keys(card.edits || {});
    if (sizes && !sizes.sizes) sizes = null;  // a video model's size rule: the videos form reads it
    $("model-hint").textContent = (sizes ? `Sizes: ${sizes.min_side}-${sizes.max_side} px per side, multiples of ` +
      `${sizes.multiple}, 1:${sizes.max_aspect_ratio} to ${sizes.max_aspect_ratio}:1. ` : "") +
      (edits.length ? `Edits: ${edits.join(", ")}. ` : "No edits. ") +
      "Requests from every tab and user share the engine's denoising batches.";
    if (!edits.length) $("mode-edit").disabled = true;
    const takes = new Set(card.arguments || []);
    for (const element of document.querySelectorAll("[data-argument]")) element.hidden = !takes.has(element.dataset.argument);
    const defaults = card.call_defaults || {};
    if (defaults.num_inference_steps) $("steps").value = defaults.num_inference_steps;
    if (defaults.guidance_scale !== undefined) $("guidance").placeholder = `model default (${defaults.guidance_scale})`;
    if (defaults.true_cfg_scale !== undefined) $("true-cfg").placeholder = `model default (${defaults.true_cfg_scale})`;
    const adapters = (card.lora && card.lora.adapters) || [];
    for (const name of adapters) $("lora").add(new Option(name, name));
    for (const element of document.querySelectorAll(".lora-field")) element.hidden = !adapters.length;
    fillSizes();
  } catch (error) { /* the page still works with the defaults */ }
}

function fillSizes() {
  const select = $("size");
  const options = sizes ? sizes.sizes : [defaultSize, "512x512", "768x768", "1024x1024"];
  select.innerHTML = "";
  if (mode === "edit") select.add(new Option("auto (the image's)", "auto"));
  for (const size of options) select.add(new Option(size, size));
  select.value = mode === "edit" ? "auto" : defaultSize;
}

function setMode(next) {
  mode = next;
  $("mode-generate").setAttribute("aria-pressed", String(mode === "generate"));
  $("mode-edit").setAttribute("aria-pressed", String(mode === "edit"));
  $("edit-area").classList.toggle("on", mode === "edit");
  $("submit").textContent = mode === "edit" ? "Edit" : "Generate";
  for (const element of document.querySelectorAll(".edit-field")) element.hidden = mode !== "edit";
  fillSizes();
}

// ------------------------------------------------------------------------------------------- mask drawing
let sourceImage = null;     // the uploaded image (an ImageBitmap)
let uploadedMask = null;    // a mask file, if one was uploaded instead of drawn
const strokes = document.createElement("canvas");  // painted pixels, opaque white, at the image's size
let painted = false;

async function loadImage(file) {
  sourceImage = await createImageBitmap(file);
  for (const canvas of [$("image-canvas"), $("mask-canvas"), strokes]) {
    canvas.width = sourceImage.width;
    canvas.height = sourceImage.height;
  }
  $("image-canvas").getContext("2d").drawImage(sourceImage, 0, 0);
  clearMask();
}

function clearMask() {
  for (const canvas of [$("mask-canvas"), strokes]) canvas.getContext("2d").clearRect(0, 0, canvas.width, canvas.height);
  painted = false;
}

function paintAt(event) {
  const canvas = $("mask-canvas");
  const box = canvas.getBoundingClientRect();
  const x = (event.clientX - box.left) * canvas.width / box.width;
  const y = (event.clientY - box.top) * canvas.height / box.height;
  const radius = Number($("brush").value) * canvas.width / box.width / 2;
  for (const [target, colour] of [[canvas, "rgba(224, 30, 30, 0.55)"], [strokes, "#fff"]]) {
    const ctx = target.getContext("2d");
    ctx.fillStyle = colour;
    ctx.beginPath();
    ctx.arc(x, y, radius, 0, 2 * Math.PI);
    ctx.fill();
  }
  painted = true;
}

function setupDrawing() {
  const canvas = $("mask-canvas");
  let down = false;
  canvas.addEventListener("pointerdown", (e) => { if (sourceImage) { down = true; canvas.setPointerCapture(e.pointerId); paintAt(e); } });
  canvas.addEventListener("pointermove", (e) => { if (down) paintAt(e); });
  canvas.addEventListener("pointerup", () => { down = false; });
  $("clear-mask").addEventListener("click", clearMask);
  $("edit-image").addEventListener("change", (e) => e.target.files[0] && loadImage(e.target.files[0]));
  $("mask-file").addEventListener("change", (e) => { uploadedMask = e.target.files[0] || null; });
}

// OpenAI's mask: the image's size, opaque, transparent where the image should change.
function maskBlob() {
  const mask = document.createElement("canvas");
  mask.width = strokes.width;
  mask.height = strokes.height;
  const ctx = mask.getContext("2d");
  ctx.fillStyle = "#000";
  ctx.fillRect(0, 0, mask.width, mask.height);
  ctx.globalCompositeOperation = "destination-out";
  ctx.drawImage(strokes, 0, 0);
  return new Promise((resolve) => mask.toBlob(resolve, "image/png"));
}

// ------------------------------------------------------------------------------------------------ requests
function field(id) { return $(id).value.trim(); }

async function buildRequest() {
  const params = { prompt: $("prompt").value, size: $("size").value, num_inference_steps: Number(field("steps")),
                   stream: true, partial_images: Number(field("partials")), user: TAB, model: $("model").textContent };
  if (field("seed") !== "") params.seed = Number(field("seed"));
  const shown = (id) => !$(id).hidden && field(id) !== "";
  if (shown("negative")) params.negative_prompt = field("negative");
  if (shown("guidance")) params.guidance_scale = Number(field("guidance"));
  if (shown("true-cfg")) params.true_cfg_scale = Number(field("true-cfg"));
  if (shown("n") && Number(field("n")) > 1) params.n = Number(field("n"));
  if (!$("lora-row").hidden && $("lora").value) params.lora = { [$("lora").value]: Number(field("lora-weight")) };
  if (mode === "generate") {
    return { url: "/v1/images/generations", params,
             init: { method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(params) } };
  }
  if (!$("edit-image").files[0]) throw new Error("choose an image to edit");
  if (field("strength") !== "") params.strength = Number(field("strength"));
  const form = new FormData();
  form.append("image", $("edit-image").files[0]);
  if (uploadedMask) form.append("mask", uploadedMask);
  else if (painted) form.append("mask", await maskBlob(), "mask.png");
  for (const [key, value] of Object.entries(params)) {
    form.append(key, typeof value === "object" ? JSON.stringify(value) : String(value));
  }
  params.mask = uploadedMask ? "uploaded" : painted ? "drawn" : "none";
  return { url: "/v1/images/edits", params, init: { method: "POST", headers: headers(), body: form } };
}

function describe(params) {
  const details = [mode, params.size, `${params.num_inference_steps} steps`, `seed ${params.seed ?? "random"}`];
  if (params.negative_prompt) details.push(`not "${params.negative_prompt}"`);
  if (params.guidance_scale !== undefined) details.push(`guidance ${params.guidance_scale}`);
  if (params.true_cfg_scale !== undefined) details.push(`true CFG ${params.true_cfg_scale}`);
  if (params.lora) details.push(`LoRA ${Object.entries(params.lora).map(([k, v]) => `${k} ${v}`).join(", ")}`);
  if (params.strength !== undefined) details.push(`strength ${params.strength}`);
  if (params.mask) details.push(`mask ${params.mask}`);
  return details.join(" · ");
}

function addCard(prompt, meta) {
  const card = document.createElement("div");
  card.className = "card";
  card.innerHTML = `<img alt=""><progress max="1" value="0"></progress><div class="prompt"></div><div class="meta"></div>` +
    `<div class="actions" hidden><a class="download">download</a><button type="button" class="edit-this">edit this</button></div>`;
  card.querySelector(".prompt").textContent = prompt;
  card.querySelector(".meta").textContent = meta;
  card.querySelector(".edit-this").addEventListener("click", () => editFrom(card.querySelector("img").src));
  $("gallery").prepend(card);
  return card;
}

// A finished card: its download link and "edit this" action, and its place in the stored gallery.
function finishCard(card, store = true) {
  const source = card.querySelector("img").src;
  const link = card.querySelector(".download");
  link.href = source;
  link.download = `stepbatch-${Date.now()}.${source.slice(11, source.indexOf(";"))}`;
  card.querySelector(".actions").hidden = false;
  card.querySelector("progress").hidden = true;
  if (store) storeCard({ src: source, prompt: card.querySelector(".prompt").textContent,
                         meta: card.querySelector(".meta").textContent, ratio: card.style.getPropertyValue("--ratio") });
}

function storedCards() {
  try { return JSON.parse(localStorage.getItem(GALLERY_KEY)) || []; } catch (error) { return []; }
}

function storeCard(entry) {
  const cards = [...storedCards(), entry].slice(-GALLERY_MOST);
  while (cards.length) {
    try { localStorage.setItem(GALLERY_KEY, JSON.stringify(cards)); return; }
    catch (error) { cards.shift(); }  // NOTE: over the browser's quota: drop the oldest
  }
}

function restoreGallery() {
  for (const entry of storedCards()) {
    const card = addCard(entry.prompt, entry.meta);
    card.querySelector("img").src = entry.src;
    if (entry.ratio) card.style.setProperty("--ratio", entry.ratio);
    finishCard(card, false);
  }
}

// "edit this": a gallery image becomes the edit's input image.
async function editFrom(source) {
  const blob = await (await fetch(source)).blob();
  const file = new File([blob], "gallery.png", { type: blob.type });
  const files = new DataTransfer();
  files.items.add(file);
  $("edit-image").files = files.files;
  setMode("edit");
  await loadImage(file);
  $("prompt").focus();
}

async function submit(event) {
  event.preventDefault();
  $("status").className = "";
  window.partialsShown = 0;
  window.completed = false;
  let card = null;
  try {
    const request = await buildRequest();
    const meta = describe(request.params);
    const cards = [addCard(request.params.prompt, meta)];
    card = cards[0];
    let done = 0;
    const started = performance.now();
    $("status").textContent = "queued...";
    const response = await fetch(request.url, request.init);
    if (!response.ok) {
      const error = await response.json().catch(() => ({ error: { message: response.statusText } }));
      throw new Error(`${response.status}: ${error.error.message}`);
    }
    const total = request.params.partial_images + 1;
    await readEvents(response, (data) => {
      const index = data.image_index || 0;
      while (cards.length <= index) cards.push(addCard(request.params.prompt, meta));
      card = cards[index];
      const image = card.querySelector("img");
      if (data.type.endsWith(".partial_image") || data.type.endsWith(".completed")) {
        image.src = `data:image/${data.output_format};base64,${data.b64_json}`;
        const [w, h] = data.size.split("x").map(Number);
        card.style.setProperty("--ratio", `${w} / ${h}`);
      }
      if (data.type.endsWith(".partial_image")) {
        window.partialsShown += 1;
        card.querySelector("progress").value = window.partialsShown / total;
        $("status").textContent = `partial image ${data.partial_image_index + 1} of ${request.params.partial_images}`;
      } else if (data.type.endsWith(".completed")) {
        const seconds = ((performance.now() - started) / 1000).toFixed(1);
        card.querySelector("progress").value = 1;
        card.querySelector(".meta").textContent += ` · ${data.size} · ${seconds} s`;
        finishCard(card);
        done += 1;
        window.completed = done === (request.params.n || 1);
        window.completedCount += 1;
        $("status").textContent = `done: ${data.size}, ${data.usage.output_tokens} image tokens`;
      } else if (data.type === "error") {
        throw new Error(data.error.message);
      }
    });
  } catch (error) {
    $("status").className = "error";
    $("status").textContent = String(error.message || error);
    if (card) card.querySelector(".meta").classList.add("error");
  }
}

// Server-sent events from a fetch() body: `data: {...}` blocks separated by blank lines.
async function readEvents(response, onEvent) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) onEvent(JSON.parse(data));
    }
  }
}

// ---------------------------------------------------------------------------------------------- live panel
async function pollLive() {
  try {
    const response = await fetch("/v1/engine/live?seconds=10", { headers: headers() });
    if (response.ok) drawLive(await response.json());
  } catch (error) { /* the server restarts or is gone: try again */ }
  setTimeout(pollLive, 500);
}

function drawLive(live) {
  $("live-running").textContent = live.running;
  $("live-waiting").textContent = live.waiting;
  $("live-forwards").textContent = live.forwards.length;
  const rows = live.forwards.map((f) => f.rows);
  $("live-rows").textContent = rows.length ? (rows.reduce((a, b) => a + b, 0) / rows.length).toFixed(1) : "0";
  const canvas = $("live-chart");
  const ctx = canvas.getContext("2d");
  const style = getComputedStyle(document.documentElement);
  const top = Math.max(8, ...rows);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.fillStyle = "#e4e8ec";
  for (let r = 1; r <= top; r++) ctx.fillRect(0, canvas.height - r * canvas.height / top, canvas.width, 1);
  for (const forward of live.forwards) {
    const x = canvas.width * (1 - forward.ago_s / live.seconds);
    const height = forward.rows * canvas.height / top;
    ctx.fillStyle = style.getPropertyValue(forward.users.length > 1 ? "--shared" : "--accent");
    ctx.fillRect(x - 2, canvas.height - height, 3, height);
  }
  const shared = live.forwards.filter((f) => f.users.length > 1);
  for (const f of shared) window.liveMaxUsers = Math.max(window.liveMaxUsers, f.users.length);
  const list = $("live-shared");
  list.innerHTML = "";
  for (const f of shared.slice(-5).reverse()) {
    const item = document.createElement("div");
    item.className = "shared-forward";
    item.dataset.rows = f.rows;
    item.dataset.users = f.users.join(" ");
    item.textContent = `${f.ago_s.toFixed(1)} s ago: one forward, ${f.rows} rows from ` +
      f.users.map((u) => (u === TAB ? "this tab" : u)).join(" + ");
    list.append(item);
  }
}

$("mode-generate").addEventListener("click", () => setMode("generate"));
$("mode-edit").addEventListener("click", () => setMode("edit"));
$("form").addEventListener("submit", submit);
for (const element of document.querySelectorAll(".edit-field")) element.hidden = true;
restoreGallery();
setupDrawing();
loadModel();
pollLive();
