// The chat page: streams each answer from /v1/chat/completions and shows, per turn, the prompt tokens, the
// tokens served from the context cache and the time to the first token, so reuse can be seen happening.
// Answers render as markdown (markdown.js: DOM nodes, no HTML); Stop aborts the stream (the server then cancels
// the request), New chat starts over; Attach shows only where the server takes media (its model card says so).
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // the conversation so far: {role, content} (content: a string, or parts with media)
const AUDIO_FORMATS = { "audio/wav": "wav", "audio/x-wav": "wav", "audio/mpeg": "mp3", "audio/flac": "flac" };
let model = null;
let streaming = null;  // the AbortController of the answer being streamed, while one is
let chat = 0;  // which conversation this is: New chat starts another, and a stopped answer of the old one stays out

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    const body = await response.json();
    if (!response.ok) throw new Error(body.error ? body.error.message : response.statusText);
    model = body.data[0].id;
    $("model").textContent = model;
    showAttach(body.data[0].input_modalities || ["text"]);
  } catch (error) {
    $("model").textContent = `not connected: ${error.message}`;
  }
}

// Attach only where the server has an encoder: a text-only server would refuse every attached file.
const ACCEPT = { image: ["image/png", "image/jpeg"], audio: Object.keys(AUDIO_FORMATS) };
function showAttach(modalities) {
  const kinds = modalities.filter((kind) => ACCEPT[kind]);
  $("attach-label").hidden = kinds.length === 0;
  $("attach").accept = kinds.flatMap((kind) => ACCEPT[kind]).join(",");
  $("attach-label").title = `Attach ${kinds.join(" or ")} (this server's model takes ${modalities.join(", ")})`;
  document.body.dataset.modalities = modalities.join(",");
}

function addTurn(role, text, media = null) {
  const turn = document.createElement("div");
  turn.className = `turn ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  turn.appendChild(body);
  if (media) {
    const shown = document.createElement(media.kind === "image" ? "img" : "span");
    if (media.kind === "image") shown.src = media.url; else shown.textContent = `audio: ${media.name}`;
    shown.className = "media";
    turn.appendChild(shown);
  }
  $("log").appendChild(turn);
  turn.scrollIntoView({ block: "end" });
  return turn;
}

// The attached file as an OpenAI content part: an image_url data URL, or input_audio with base64 data.
function readAttachment() {
  const file = $("attach").files[0];
  if (!file) return Promise.resolve(null);
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onerror = () => reject(new Error(`cannot read ${file.name}`));
    reader.onload = () => {
      const url = reader.result;
      if (file.type.startsWith("image/")) {
        resolve({ kind: "image", name: file.name, url, part: { type: "image_url", image_url: { url } } });
      } else {
        const format = AUDIO_FORMATS[file.type];
        if (!format) reject(new Error(`${file.name}: send PNG, JPEG, WAV, MP3 or FLAC`));
        const data = url.slice(url.indexOf(",") + 1);
        resolve({ kind: "audio", name: file.name, url, part: { type: "input_audio", input_audio: { data, format } } });
      }
    };
    reader.readAsDataURL(file);
  });
}

function clearAttachment() {
  $("attach").value = "";
  $("attached").textContent = "Attach";
}

function showStats(turn, usage, ttftMs) {
  const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.dataset.promptTokens = usage.prompt_tokens;
  stats.dataset.cachedTokens = cached;
  stats.dataset.ttftMs = ttftMs.toFixed(1);
  stats.innerHTML = `prompt <b>${usage.prompt_tokens}</b> tokens · ` +
    `<span class="${cached > 0 ? "hit" : ""}">cached <b>${cached}</b></span> · ` +
    `TTFT <b>${ttftMs.toFixed(0)}</b> ms · generated <b>${usage.completion_tokens}</b>`;
  turn.appendChild(stats);
}

// Server-sent events arrive in arbitrary pieces: yield each complete `data:` payload.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ") && line !== "data: [DONE]") yield JSON.parse(line.slice(6));
      }
    }
  }
}

// Markdown is rendered at most once a frame while an answer streams (each render rebuilds the turn).
function renderAnswer(turn, answer) {
  if (turn.pending) return;
  turn.pending = requestAnimationFrame(() => {
    turn.pending = 0;
    renderMarkdown(turn.answer, turn.firstChild);
  });
  turn.answer = answer;
}

function finishAnswer(turn, answer) {
  if (turn.pending) cancelAnimationFrame(turn.pending);
  turn.pending = 0;
  renderMarkdown(answer, turn.firstChild);
}

function setStreaming(controller) {
  streaming = controller;
  $("send").hidden = controller !== null;
  $("stop").hidden = controller === null;
}

async function send(text, media) {
  // A turn with media keeps its parts in the conversation: later turns send the same bytes again, which the
  // server's encoder cache and page keys recognise (the media identity is a digest of the decoded item).
  const thisChat = chat;
  conversation.push({ role: "user", content: media ? [{ type: "text", text }, media.part] : text });
  addTurn("user", text, media);
  const turn = addTurn("assistant", "");
  turn.firstChild.classList.add("md");
  const system = $("system").value.trim();
  const request = {
    model, stream: true, stream_options: { include_usage: true },
    messages: system ? [{ role: "system", content: system }, ...conversation] : conversation,
    max_tokens: Number($("max-tokens").value) || 128,
    temperature: Number($("temperature").value) || 0,
  };
  const started = performance.now();
  let ttftMs = null, answer = "", usage = null;
  const controller = new AbortController();
  setStreaming(controller);
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(request),
                                                           signal: controller.signal });
    if (!response.ok) throw new Error((await response.json()).error.message);
    for await (const chunk of events(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices) {
        const delta = choice.delta && choice.delta.content;
        if (!delta) continue;
        if (ttftMs === null) ttftMs = performance.now() - started;
        answer += delta;
        renderAnswer(turn, answer);
      }
    }
    finishAnswer(turn, answer);
    conversation.push({ role: "assistant", content: answer });
    if (usage) showStats(turn, usage, ttftMs === null ? performance.now() - started : ttftMs);
  } catch (error) {
    if (controller.signal.aborted) {  // Stop or New chat: keep what came (the next turn builds on it)
      if (thisChat !== chat) return;  // New chat: the turn and its conversation are gone
      finishAnswer(turn, answer);
      if (answer) conversation.push({ role: "assistant", content: answer });
      else conversation.pop();  // nothing came: the question is left out of the next request
      turn.classList.add("stopped");
      const note = document.createElement("div");
      note.className = "stats";
      note.textContent = answer ? "stopped" : "stopped before the first token";
      turn.appendChild(note);
      return;
    }
    conversation.pop();  // the user's turn had no answer: leave it out of the next request
    turn.className = "turn error";
    turn.firstChild.textContent = `error: ${error.message}`;
  } finally {
    if (streaming === controller) setStreaming(null);
  }
}

// A fresh conversation: the answer in flight is stopped, the turns are cleared (settings are kept).
function newChat() {
  chat += 1;
  if (streaming) streaming.abort();
  conversation.length = 0;
  $("log").replaceChildren();
  clearAttachment();
  $("prompt").focus();
}

$("composer").addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || $("send").disabled || streaming) return;
  $("prompt").value = "";
  $("send").disabled = true;
  try {
    if (model === null) await loadModel();
    let media = null;
    try {
      media = await readAttachment();
    } catch (error) {
      addTurn("error", `error: ${error.message}`).className = "turn error";
      return;
    }
    clearAttachment();
    await send(text, media);
  } finally {
    $("send").disabled = false;
    $("prompt").focus();
  }
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("api-key").addEventListener("change", loadModel);
$("stop").addEventListener("click", () => { if (streaming) streaming.abort(); });
$("new-chat").addEventListener("click", newChat);
$("attach").addEventListener("change", () => {
  const file = $("attach").files[0];
  $("attached").textContent = file ? file.name : "Attach";
});
loadModel();
