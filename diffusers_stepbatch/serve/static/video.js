// The web page's video mode: POST /v1/videos (multipart, as OpenAI's client sends it), the job's progress and
// previews from GET /v1/videos/{id}/events, the MP4 in a <video>, and the server's job list. Uses app.js's
// `$`, `headers`, `readEvents` and `TAB`. Plain JS, no build step, no CDN.
"use strict";
window.videosCompleted = 0;   // read by browser tests: videos this tab showed
window.videoPreviews = 0;     // previews this tab showed
let videoModel = null;        // the model card's `video` part (null: an image model)

function showVideoMode(on) {
  $("mode-video").setAttribute("aria-pressed", String(on));
  if (on) {
    $("mode-generate").setAttribute("aria-pressed", "false");
    $("mode-edit").setAttribute("aria-pressed", "false");
  }
  $("form").hidden = on;
  $("video-form").hidden = !on;
  $("video-jobs-section").hidden = !on;
}

async function loadVideoModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) return;
    const card = (await response.json()).data[0];
    if (card.kind !== "video") {
      $("mode-video").disabled = true;
      return;
    }
    videoModel = card.video;
    $("mode-generate").disabled = true;
    $("mode-edit").disabled = true;
    $("video-size").value = card.default_size;
    $("video-frames").value = videoModel.default_frames;
    $("video-frames").step = videoModel.frame_multiple;
    $("video-image").hidden = $("video-image-label").hidden = !videoModel.image_to_video;
    $("model-hint").textContent = `A video model: sides in multiples of ${videoModel.size_multiple} px, ` +
      `k * ${videoModel.frame_multiple} + 1 frames` + (videoModel.image_to_video ? ", from a first frame. " : ". ") +
      "Jobs from every tab share the engine's denoising batches.";
    showVideoMode(true);
    pollJobs();
  } catch (error) { /* the page still works for images */ }
}

function videoCard(video) {
  const card = document.createElement("div");
  card.className = "card";
  card.dataset.videoId = video.id;
  card.innerHTML = `<img alt="preview"><progress max="100" value="0"></progress><div class="prompt"></div>` +
    `<div class="meta"></div>`;
  card.querySelector(".prompt").textContent = video.prompt;
  card.querySelector(".meta").textContent =
    `video · ${video.size} · ${video.num_frames} frames · ${video.num_inference_steps} steps · seed ${video.seed}`;
  const [w, h] = video.size.split("x").map(Number);
  card.style.setProperty("--ratio", `${w} / ${h}`);
  $("gallery").prepend(card);
  return card;
}

async function showVideo(card, video) {
  // NOTE: fetched with the API key header (a <video src> could not send it), then played from a blob URL
  const response = await fetch(`/v1/videos/${video.id}/content`, { headers: headers() });
  if (!response.ok) throw new Error(`content: ${response.status}`);
  const player = document.createElement("video");
  player.controls = player.loop = player.autoplay = player.muted = true;
  player.src = URL.createObjectURL(await response.blob());
  card.querySelector("img").replaceWith(player);
  card.querySelector("progress").value = 100;
  window.videosCompleted += 1;
}

async function submitVideo(event) {
  event.preventDefault();
  $("status").className = "";
  let card = null;
  try {
    const form = new FormData();
    form.append("prompt", $("video-prompt").value);
    form.append("model", $("model").textContent);
    form.append("size", $("video-size").value.trim());
    form.append("num_frames", $("video-frames").value);
    form.append("num_inference_steps", $("video-steps").value);
    form.append("user", TAB);
    if ($("video-seed").value.trim() !== "") form.append("seed", $("video-seed").value.trim());
    if (videoModel && videoModel.image_to_video) {
      if (!$("video-image").files[0]) throw new Error("choose the first frame (an image)");
      form.append("input_reference", $("video-image").files[0]);
    }
    const response = await fetch("/v1/videos", { method: "POST", headers: headers(), body: form });
    const video = await response.json();
    if (!response.ok) throw new Error(`${response.status}: ${video.error.message}`);
    card = videoCard(video);
    $("status").textContent = `${video.id}: ${video.status}`;
    const events = await fetch(`/v1/videos/${video.id}/events`, { headers: headers() });
    let final = null;
    await readEvents(events, (data) => {
      if (data.type === "video.progress") {
        card.querySelector("progress").value = data.progress;
        $("status").textContent = `${video.id}: step ${data.step} of ${data.num_steps} (${data.progress} %)`;
      } else if (data.type === "video.preview") {
        card.querySelector("img").src = `data:image/gif;base64,${data.b64_json}`;
        window.videoPreviews += 1;
      } else {
        final = data;
      }
    });
    if (final === null) throw new Error(`${video.id}: the event stream ended early; see the job list`);
    if (final.type === "video.failed") throw new Error(`${video.id}: ${final.video.error.message}`);
    await showVideo(card, final.video);
    $("status").textContent = `${video.id}: done, ${final.video.seconds} s`;
  } catch (error) {
    $("status").className = "error";
    $("status").textContent = String(error.message || error);
    if (card) card.querySelector(".meta").classList.add("error");
  }
}

async function pollJobs() {
  try {
    const response = await fetch("/v1/videos?limit=20", { headers: headers() });
    if (response.ok) drawJobs((await response.json()).data);
  } catch (error) { /* try again */ }
  setTimeout(pollJobs, 1500);
}

function drawJobs(videos) {
  const list = $("video-jobs");
  list.innerHTML = "";
  for (const video of videos) {
    const row = document.createElement("div");
    row.className = "job";
    row.dataset.status = video.status;
    const text = document.createElement("span");
    text.innerHTML = `<span class="id"></span> `;
    text.querySelector(".id").textContent = video.id.slice(0, 14);
    text.append(`${video.status} ${video.progress} % · ${video.size} · ${video.num_frames} frames`);
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = video.status === "completed" || video.status === "failed" ? "delete" : "cancel";
    button.addEventListener("click", () => fetch(`/v1/videos/${video.id}`, { method: "DELETE", headers: headers() }));
    row.append(text, button);
    list.append(row);
  }
}

$("mode-video").addEventListener("click", () => showVideoMode(true));
$("mode-generate").addEventListener("click", () => showVideoMode(false));
$("mode-edit").addEventListener("click", () => showVideoMode(false));
$("video-form").addEventListener("submit", submitVideo);
loadVideoModel();
