// The web page: generate and edit through the server's OpenAI API (streamed partial images), a gallery of this
// tab's results, and a live panel of the engine (GET /v1/engine/live). Plain JS, no build step, no CDN.
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
    $("model-hint").textContent = (sizes ? `Sizes: ${sizes.min_side}-${sizes.max_side} px per side, multiples of ` +
      `${sizes.multiple}, 1:${sizes.max_aspect_ratio} to ${sizes.max_aspect_ratio}:1. ` : "") +
      (edits.length ? `Edits: ${edits.join(", ")}. ` : "No edits. ") +
      "Requests from every tab and user share the engine's denoising batches.";
    if (!edits.length) $("mode-edit").disabled = true;
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
  for (const [key, value] of Object.entries(params)) form.append(key, String(value));
  params.mask = uploadedMask ? "uploaded" : painted ? "drawn" : "none";
  return { url: "/v1/images/edits", params, init: { method: "POST", headers: headers(), body: form } };
}

function addCard(params) {
  const card = document.createElement("div");
  card.className = "card";
  const details = [mode, params.size, `${params.num_inference_steps} steps`, `seed ${params.seed ?? "random"}`];
  if (params.strength !== undefined) details.push(`strength ${params.strength}`);
  if (params.mask) details.push(`mask ${params.mask}`);
  card.innerHTML = `<img alt=""><progress max="1" value="0"></progress><div class="prompt"></div><div class="meta"></div>`;
  card.querySelector(".prompt").textContent = params.prompt;
  card.querySelector(".meta").textContent = details.join(" · ");
  $("gallery").prepend(card);
  return card;
}

async function submit(event) {
  event.preventDefault();
  $("status").className = "";
  window.partialsShown = 0;
  window.completed = false;
  let card = null;
  try {
    const request = await buildRequest();
    card = addCard(request.params);
    const started = performance.now();
    $("status").textContent = "queued...";
    const response = await fetch(request.url, request.init);
    if (!response.ok) {
      const error = await response.json().catch(() => ({ error: { message: response.statusText } }));
      throw new Error(`${response.status}: ${error.error.message}`);
    }
    const total = request.params.partial_images + 1;
    await readEvents(response, (data) => {
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
        window.completed = true;
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
setupDrawing();
loadModel();
pollLive();
