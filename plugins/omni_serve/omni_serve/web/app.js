// The page of `omni serve`: it calls the same public API as any client (/v1/models, /v1/chat/completions,
// /v1/videos, /v1/audio/speech, /v1/audio/transcriptions, /v1/audio/voices); a chat pipeline that speaks answers
// aloud (delta.audio, played as it arrives) and one that listens hears the microphone (input_audio). Everything a request or an answer holds is put in the page as text (textContent), never as HTML.
"use strict";

const POLL_MS = 100; // how often a running job is asked for its progress: shorter than one denoise step
const KEY_STORE = "omni-api-key"; // sessionStorage: the key stays in this browser tab
const LIVE = ["queued", "in_progress"];
const PCM_RATE = 24000; // the API's pcm: 16-bit little-endian mono at 24 kHz
const HEARD_RATE = 16000; // a recorded question's WAV: what Whisper hears
const KINDS = { videos: "video", "audio.speech": "speech", "audio.transcriptions": "transcription" };
const SAYS = { video: "renders a video", speech: "speaks a text", transcription: "transcribes speech",
  chat: "answers in a chat", spoken: "answers aloud in a chat", voice: "hears you and answers aloud" };

const state = { cards: new Map(), history: [], jobs: new Map(), polling: false, recorder: null };
const $ = (selector, root = document) => root.querySelector(selector);

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// --- the API ---------------------------------------------------------------------------------------------

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = sessionStorage.getItem(KEY_STORE);
  if (key) headers.set("Authorization", `Bearer ${key}`);
  let response;
  try {
    response = await fetch(path, { ...options, headers });
  } catch (error) {
    throw new ApiError(0, `the server did not answer (${error.message})`);
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || body.detail || message;
  } catch (error) {
    // not JSON: the status line says what happened
  }
  if (response.status === 401) $("#key-form").hidden = false;
  return new ApiError(response.status, message);
}

function showError(error) {
  $("#error").textContent = error ? error.message : "";
}

// Server-sent events: the `data:` payload of each event, as it arrives.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

// --- start: the served pipelines ---------------------------------------------------------------------------

async function start() {
  showError(null);
  try {
    const models = await (await api("/v1/models")).json();
    const cards = await Promise.all(models.data.map(async (m) =>
      (await api(`/v1/models/${encodeURIComponent(m.id)}`)).json()));
    state.cards = new Map(cards.map((card) => [card.id, card]));
  } catch (error) {
    showError(error);
    return;
  }
  fillPipelines();
  if ([...state.cards.values()].some(isVideo)) await loadJobs();
}

function kindOf(card) {
  const known = card.capabilities.find((c) => KINDS[c]);
  return known ? KINDS[known] : "chat";
}

function isVideo(card) {
  return kindOf(card) === "video";
}

function fillPipelines() {
  const select = $("#pipeline");
  const chosen = select.value;
  select.replaceChildren(...[...state.cards.values()].map((card) => {
    const option = document.createElement("option");
    option.value = card.id;
    option.textContent = `${card.id} (${kindOf(card)})`;
    return option;
  }));
  if (state.cards.has(chosen)) select.value = chosen;
  showPanel();
}

function showPanel() {
  const card = state.cards.get($("#pipeline").value);
  const panel = $("#panel");
  state.history = [];
  if (!card) {
    panel.replaceChildren();
    return;
  }
  const kind = kindOf(card);
  $("#pipeline-kind").textContent = SAYS[kind === "chat" ? chatKind(card) : kind];
  panel.replaceChildren($(`#${kind}-panel`).content.cloneNode(true));
  if (kind === "video") buildVideoForm(card);
  else if (kind === "speech") buildSpeechForm(card);
  else if (kind === "transcription") buildTranscriptionForm(card);
  else buildChat(card);
}

// A chat pipeline's card says whether it answers aloud (`modalities`) and hears the microphone (`input_audio`).
function chatKind(card) {
  if (card.input_audio) return "voice";
  return (card.modalities || []).includes("audio") ? "spoken" : "chat";
}

function buildChat(card) {
  $(".chat-form").addEventListener("submit", (event) => sendChat(event, card));
  if (!card.input_audio) return;
  $(".chat-form").hidden = true; // it hears one spoken question: no text goes with it
  $(".voice-row").hidden = false;
  $(".record").addEventListener("click", () => record((blob) => askAloud(card, blob)));
  $(".stop").addEventListener("click", () => state.recorder && state.recorder.stop());
}

// --- chat ------------------------------------------------------------------------------------------------

function addMessage(role, text) {
  const message = document.createElement("p");
  message.className = `message ${role}`;
  message.textContent = text;
  $(".conversation").append(message);
  return message;
}

async function sendChat(event, card) {
  event.preventDefault();
  const prompt = $("#prompt");
  const messages = [...state.history, { role: "user", content: prompt.value }];
  addMessage("user", prompt.value);
  prompt.value = "";
  const answer = await chatAnswer(card, messages);
  if (answer !== null) state.history = [...messages, { role: "assistant", content: answer }];
}

// The answer streamed into the conversation; a pipeline that speaks also plays each `delta.audio` (pcm16) right
// after the one before and keeps the whole sound in the "Spoken answer" <audio>. The answer's text, or null.
async function chatAnswer(card, messages) {
  const log = $(".conversation");
  const status = $(".speech-status");
  const audio = $(".speech-audio");
  const answer = addMessage("assistant", "");
  const body = { model: card.id, messages, stream: true };
  const player = (card.modalities || []).includes("audio") ? new Player() : null;
  if (player) Object.assign(body, { modalities: ["text", "audio"], audio: { voice: "alloy", format: "pcm16" } });
  showError(null);
  audio.hidden = true;
  if (audio.src) URL.revokeObjectURL(audio.src);
  log.setAttribute("aria-busy", "true");
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    for await (const data of events(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(0, chunk.error.message);
      const delta = chunk.choices.length ? chunk.choices[0].delta : {};
      if (delta.content) answer.textContent += delta.content;
      if (player && delta.audio && delta.audio.data) {
        player.add(base64Bytes(delta.audio.data));
        status.textContent = `playing: ${(player.samples / PCM_RATE).toFixed(2)} s received`;
      }
    }
    if (player) {
      audio.src = URL.createObjectURL(player.wav());
      audio.hidden = false;
      status.textContent = `spoken: ${(player.samples / PCM_RATE).toFixed(2)} s`;
    }
    return answer.textContent;
  } catch (error) {
    answer.remove();
    status.textContent = "";
    showError(error);
    return null;
  } finally {
    log.setAttribute("aria-busy", "false");
  }
}

// A recorded question (the recorder's WebM) as a 16 kHz WAV, the one input_audio part of a voice chat.
async function askAloud(card, blob) {
  let wav;
  try {
    wav = await wavOf(blob);
  } catch (error) {
    showError(new ApiError(0, `the recording could not be decoded (${error.message})`));
    return;
  }
  const seconds = (wav.length - 44) / 2 / HEARD_RATE;
  addMessage("user", `(spoken question, ${seconds.toFixed(1)} s)`);
  const part = { type: "input_audio", input_audio: { data: bytesBase64(wav), format: "wav" } };
  await chatAnswer(card, [{ role: "user", content: [part] }]);
}

async function wavOf(blob) {
  const context = new AudioContext({ sampleRate: HEARD_RATE });
  try {
    const sound = await context.decodeAudioData(await blob.arrayBuffer());
    const samples = sound.getChannelData(0);
    const pcm = new DataView(new ArrayBuffer(samples.length * 2));
    samples.forEach((s, i) => pcm.setInt16(2 * i, Math.round(Math.max(-1, Math.min(1, s)) * 32767), true));
    return new Uint8Array(await wavFile([new Uint8Array(pcm.buffer)], HEARD_RATE).arrayBuffer());
  } finally {
    await context.close();
  }
}

function bytesBase64(bytes) {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

// --- speech: the text spoken, played as it arrives ------------------------------------------------------------

async function buildSpeechForm(card) {
  $(".speech-form").addEventListener("submit", (event) => speak(event, card));
  try {
    const voices = await (await api("/v1/audio/voices")).json();
    const mine = voices.data.filter((voice) => voice.model === card.id);
    $("#voice").replaceChildren(...mine.map((voice) => new Option(voice.id, voice.id, voice.default, voice.default)));
  } catch (error) {
    showError(error);
  }
}

function base64Bytes(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i += 1) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

// Plays the whole 16-bit samples of `bytes` (an odd byte waits for the next chunk) right after what is queued.
class Player {
  constructor() {
    this.context = new AudioContext({ sampleRate: PCM_RATE });
    this.at = 0;
    this.rest = new Uint8Array(0);
    this.samples = 0;
    this.parts = [];
  }

  add(bytes) {
    this.parts.push(bytes);
    const joined = new Uint8Array(this.rest.length + bytes.length);
    joined.set(this.rest);
    joined.set(bytes, this.rest.length);
    const whole = joined.length - (joined.length % 2);
    this.rest = joined.slice(whole);
    const view = new DataView(joined.buffer, 0, whole);
    const count = whole / 2;
    if (!count) return;
    const buffer = this.context.createBuffer(1, count, PCM_RATE);
    const channel = buffer.getChannelData(0);
    for (let i = 0; i < count; i += 1) channel[i] = view.getInt16(2 * i, true) / 32768;
    const source = this.context.createBufferSource();
    source.buffer = buffer;
    source.connect(this.context.destination);
    this.at = Math.max(this.at, this.context.currentTime);
    source.start(this.at);
    this.at += buffer.duration;
    this.samples += count;
  }

  // The whole sound as a WAV file, for the page's <audio> (replay, download).
  wav() {
    return wavFile(this.parts, PCM_RATE);
  }
}

// 16-bit mono PCM parts as one WAV file.
function wavFile(parts, rate) {
  const size = parts.reduce((sum, part) => sum + part.length, 0);
  const header = new DataView(new ArrayBuffer(44));
  const text = (at, value) => [...value].forEach((c, i) => header.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF");
  header.setUint32(4, 36 + size, true);
  text(8, "WAVEfmt ");
  header.setUint32(16, 16, true);
  header.setUint16(20, 1, true);
  header.setUint16(22, 1, true);
  header.setUint32(24, rate, true);
  header.setUint32(28, rate * 2, true);
  header.setUint16(32, 2, true);
  header.setUint16(34, 16, true);
  text(36, "data");
  header.setUint32(40, size, true);
  return new Blob([header, ...parts], { type: "audio/wav" });
}

async function speak(event, card) {
  event.preventDefault();
  const status = $(".speech-status");
  const audio = $(".speech-audio");
  const body = { model: card.id, input: $("#speech-text").value, voice: $("#voice").value || "alloy",
    response_format: "pcm", stream_format: "sse" };
  if ($("#speed").value !== "") body.speed = Number($("#speed").value);
  showError(null);
  audio.hidden = true;
  if (audio.src) URL.revokeObjectURL(audio.src);
  const player = new Player();
  status.textContent = "speaking";
  try {
    const response = await api("/v1/audio/speech", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    for await (const data of events(response)) {
      const message = JSON.parse(data);
      if (message.type === "error") throw new ApiError(0, message.error.message);
      if (message.type !== "speech.audio.delta") continue;
      player.add(base64Bytes(message.audio));
      status.textContent = `playing: ${(player.samples / PCM_RATE).toFixed(2)} s received`;
    }
    audio.src = URL.createObjectURL(player.wav());
    audio.hidden = false;
    status.textContent = `spoken: ${(player.samples / PCM_RATE).toFixed(2)} s`;
  } catch (error) {
    status.textContent = "";
    showError(error);
  }
}

// --- transcription: a file, or a recording from the microphone --------------------------------------------------

function buildTranscriptionForm(card) {
  $(".transcription-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const file = $("#audio-file").files[0];
    if (file) transcribe(card, file, file.name);
    else showError(new ApiError(0, "choose an audio file, or record one"));
  });
  $(".record").addEventListener("click", () => record((blob) => transcribe(card, blob, "recording.webm")));
  $(".stop").addEventListener("click", () => state.recorder && state.recorder.stop());
}

async function transcribe(card, blob, filename) {
  const out = $(".transcript");
  const body = new FormData();
  body.append("model", card.id);
  body.append("stream", "true");
  body.append("file", blob, filename);
  showError(null);
  out.textContent = "";
  out.setAttribute("aria-busy", "true");
  try {
    const response = await api("/v1/audio/transcriptions", { method: "POST", body });
    for await (const data of events(response)) {
      const message = JSON.parse(data);
      if (message.type === "error") throw new ApiError(0, message.error.message);
      if (message.type === "transcript.text.delta") out.textContent += message.delta;
      if (message.type === "transcript.text.done") out.textContent = message.text;
    }
  } catch (error) {
    showError(error);
  } finally {
    out.setAttribute("aria-busy", "false");
  }
}

// Records the microphone until "Stop"; `recorded(blob)` gets the recording.
async function record(recorded) {
  showError(null);
  let stream;
  try {
    // The sound as the microphone hears it: a call's noise suppression and gain control reshape speech that
    // Whisper was trained to hear raw.
    stream = await navigator.mediaDevices.getUserMedia({
      audio: { noiseSuppression: false, autoGainControl: false },
    });
  } catch (error) {
    showError(new ApiError(0, `the microphone is not available (${error.message})`));
    return;
  }
  const recorder = new MediaRecorder(stream);
  const parts = [];
  recorder.addEventListener("dataavailable", (event) => {
    if (event.data.size) parts.push(event.data);
  });
  recorder.addEventListener("stop", () => {
    stream.getTracks().forEach((track) => track.stop());
    state.recorder = null;
    $(".record").disabled = false;
    $(".stop").disabled = true;
    const blob = new Blob(parts, { type: recorder.mimeType || "audio/webm" });
    $(".recording-status").textContent = `recorded ${(blob.size / 1024).toFixed(0)} KB`;
    recorded(blob);
  });
  state.recorder = recorder;
  recorder.start(250);
  $(".record").disabled = true;
  $(".stop").disabled = false;
  $(".recording-status").textContent = "recording";
}

// --- the video form, from the model card's declared options ------------------------------------------------

function buildVideoForm(card) {
  const form = $(".video-form");
  const image = card.input_reference;
  $(".image-field").hidden = image === "none";
  $(".image-note").textContent = image === "required" ? "required by this pipeline" : "optional";
  const fieldset = $(".options", form);
  for (const option of card.options) fieldset.append(optionField(option));
  form.addEventListener("submit", (event) => generate(event, card));
}

function optionField(option) {
  const id = `option-${option.name}`;
  const field = document.createElement("div");
  field.className = "field";
  const label = document.createElement("label");
  label.htmlFor = id;
  label.textContent = option.name;
  const control = optionControl(option);
  control.id = id;
  control.name = option.name;
  const help = document.createElement("small");
  help.id = `${id}-help`;
  help.textContent = option.help + (option.default === null ? "" : ` (default ${option.default})`);
  control.setAttribute("aria-describedby", help.id);
  field.append(label, control, help);
  return field;
}

function optionControl(option) {
  const choices = option.type === "bool" ? ["true", "false"] : option.choices;
  if (choices) {
    const select = document.createElement("select");
    select.append(new Option("(default)", ""), ...choices.map((c) => new Option(c, c)));
    return select;
  }
  const input = document.createElement("input");
  if (option.type === "int" || option.type === "float") {
    // The range is a hint only (the form is novalidate): the API checks every value and says what is wrong.
    input.type = "number";
    input.step = option.type === "int" ? "1" : "any";
    const low = option.minimum ?? option.exclusive_minimum;
    if (low !== null && low !== undefined) input.min = String(low);
    if (option.maximum !== null && option.maximum !== undefined) input.max = String(option.maximum);
  } else {
    input.type = "text";
  }
  if (option.default !== null && !Array.isArray(option.default)) input.placeholder = String(option.default);
  return input;
}

async function generate(event, card) {
  event.preventDefault();
  const form = event.target;
  const body = new FormData();
  body.append("model", card.id);
  body.append("prompt", $("#prompt", form).value);
  const image = $("#image", form).files[0];
  if (image && card.input_reference !== "none") body.append("input_reference", image);
  for (const control of $(".options", form).elements) {
    if (control.value !== "") body.append(control.name, control.value);
  }
  showError(null);
  try {
    const job = await (await api("/v1/videos", { method: "POST", body })).json();
    showJob(job);
    poll();
  } catch (error) {
    showError(error);
  }
}

// --- video jobs: the store's list, each job's progress, the finished video -----------------------------------

async function loadJobs() {
  $("#jobs-section").hidden = false;
  try {
    const list = await (await api("/v1/videos?limit=100")).json();
    for (const job of list.data.reverse()) showJob(job);
  } catch (error) {
    showError(error);
  }
  poll();
}

function showJob(job) {
  let view = state.jobs.get(job.id);
  if (!view) {
    view = jobView(job);
    state.jobs.set(job.id, view);
    $("#jobs").prepend(view.item);
  }
  view.job = job;
  view.status.textContent = job.status;
  if (LIVE.includes(job.status)) {
    view.bar.setAttribute("aria-valuenow", String(job.progress));
    view.fill.style.width = `${job.progress}%`;
    view.percent.textContent = `${job.progress}%`;
  } else {
    view.progress.remove();
  }
  if (job.status === "failed" && job.error) view.error.textContent = job.error.message;
  if (job.status === "completed" && !view.video) showVideo(view);
}

function jobView(job) {
  const item = document.createElement("li");
  item.className = "job";
  const head = document.createElement("p");
  const name = document.createElement("code");
  name.textContent = job.id;
  const status = document.createElement("span");
  status.className = "status";
  const remove = document.createElement("button");
  remove.type = "button";
  remove.textContent = "Delete";
  remove.setAttribute("aria-label", `Delete ${job.id}`);
  remove.addEventListener("click", () => deleteJob(job.id));
  head.append(name, ` ${job.model} `, status, " ", remove);
  const prompt = document.createElement("p");
  prompt.className = "job-prompt";
  prompt.textContent = job.prompt;
  const progress = document.createElement("div");
  progress.className = "progress";
  const bar = document.createElement("div");
  bar.setAttribute("role", "progressbar");
  bar.setAttribute("aria-label", `Progress of ${job.id}`);
  bar.setAttribute("aria-valuemin", "0");
  bar.setAttribute("aria-valuemax", "100");
  const fill = document.createElement("div");
  bar.append(fill);
  const percent = document.createElement("span");
  progress.append(bar, percent);
  const error = document.createElement("p");
  error.className = "job-error";
  item.append(head, prompt, progress, error);
  return { item, status, progress, bar, fill, percent, error, video: null, url: null };
}

async function showVideo(view) {
  const id = view.job.id;
  view.video = document.createElement("video"); // one per finished job: set before the download, so only once
  try {
    // Through fetch, not <video src>: a request from the page carries the API key, a media element's cannot.
    const blob = await (await api(`/v1/videos/${encodeURIComponent(id)}/content`)).blob();
    view.url = URL.createObjectURL(blob);
  } catch (error) {
    view.video = null;
    view.error.textContent = error.message;
    return;
  }
  view.video.controls = true;
  view.video.loop = true; // not muted: a narrated pipeline's video carries its narration
  view.video.src = view.url;
  view.video.setAttribute("aria-label", `Video ${id}`);
  const link = document.createElement("a");
  link.href = view.url;
  link.download = `${id}.mp4`;
  link.textContent = `Download ${id}.mp4`;
  view.item.append(view.video, link);
}

async function deleteJob(id) {
  showError(null);
  try {
    await api(`/v1/videos/${encodeURIComponent(id)}`, { method: "DELETE" });
    forget(id);
  } catch (error) {
    showError(error);
  }
}

function forget(id) {
  const view = state.jobs.get(id);
  if (!view) return;
  if (view.url) URL.revokeObjectURL(view.url);
  view.item.remove();
  state.jobs.delete(id);
}

// One loop asks each queued or running job for its state until none is left.
async function poll() {
  if (state.polling) return;
  state.polling = true;
  try {
    for (;;) {
      const live = [...state.jobs.values()].filter((view) => LIVE.includes(view.job.status));
      if (!live.length) return;
      await Promise.all(live.map(refresh));
      await new Promise((resolve) => setTimeout(resolve, POLL_MS));
    }
  } finally {
    state.polling = false;
  }
}

async function refresh(view) {
  try {
    showJob(await (await api(`/v1/videos/${encodeURIComponent(view.job.id)}`)).json());
  } catch (error) {
    if (error.status === 404) forget(view.job.id);
    else showError(error);
  }
}

// --- wiring ----------------------------------------------------------------------------------------------

$("#pipeline").addEventListener("change", showPanel);
$("#key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("#api-key").value);
  $("#api-key").value = "";
  start();
});
start();
