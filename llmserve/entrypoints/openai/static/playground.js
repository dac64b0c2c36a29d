// The playground: chat and completions against this server's OpenAI API, streamed.
// Model output only ever reaches the page through textContent, never parsed as HTML: a reply that
// contains markup shows as text. The conversation and settings live in localStorage.
"use strict";

const STORE = "llmserve.playground";
const $ = (id) => document.getElementById(id);
const state = loadState();
let model = null;
let running = null; // {controller, stop button} of the request in flight

function loadState() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    return { messages: Array.isArray(saved.messages) ? saved.messages : [], settings: saved.settings || {},
             apiKey: saved.apiKey || "", tab: saved.tab || "chat", prompt: saved.prompt || "" };
  } catch (error) {
    return { messages: [], settings: {}, apiKey: "", tab: "chat", prompt: "" };
  }
}

function saveState() {
  localStorage.setItem(STORE, JSON.stringify(state));
}

const SETTINGS = ["system-prompt", "temperature", "top-p", "max-tokens", "seed", "json-schema"];

function restoreSettings() {
  for (const id of SETTINGS) {
    if (state.settings[id] !== undefined) $(id).value = state.settings[id];
    $(id).addEventListener("input", () => { state.settings[id] = $(id).value; saveState(); });
  }
  $("api-key").value = state.apiKey;
  $("api-key").addEventListener("input", () => { state.apiKey = $("api-key").value.trim(); saveState(); });
  $("api-key").addEventListener("change", loadModel);
  $("prompt").value = state.prompt;
  $("prompt").addEventListener("input", () => { state.prompt = $("prompt").value; saveState(); });
}

function headers() {
  const result = { "Content-Type": "application/json" };
  if (state.apiKey) result.Authorization = "Bearer " + state.apiKey;
  return result;
}

// -- the model and its limits --------------------------------------------------------------------

async function loadModel() {
  try {
    const info = await (await fetch("/server_info")).json();
    $("model-info").textContent = `${info.model} · context ${info.max_model_len} tokens · KV block ${info.block_size}` +
      (info.prefix_caching ? " · prefix caching on" : "");
    $("max-tokens").max = String(info.max_model_len - 1);
    $("limits").textContent = `Prompt and reply together fit in ${info.max_model_len} tokens.`;
    model = info.model;
  } catch (error) {
    $("model-info").textContent = "could not read /server_info: " + error;
  }
  const config = await (await fetch("/playground/config")).json();
  $("api-key-box").classList.toggle("hidden", !config.api_key_required);
  if (config.api_key_required && !state.apiKey) {
    $("model-info").textContent += " · enter the API key";
    return; // /v1/models would answer 401
  }
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.ok) {
    const models = await response.json();
    if (models.data && models.data.length) model = models.data[0].id;
  } else {
    $("model-info").textContent += " · " + (await errorText(response));
  }
}

// -- requests ------------------------------------------------------------------------------------

function samplingBody(withSchema) {
  const body = {
    model: model,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const schema = withSchema ? $("json-schema").value.trim() : "";
  if (schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: JSON.parse(schema), strict: true } };
  }
  return body;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `HTTP ${response.status}: ${body.error ? body.error.message : JSON.stringify(body)}`;
  } catch (error) {
    return `HTTP ${response.status}`;
  }
}

// POST `body` to `path` and call onText(delta) per streamed piece; fills `timing` (start, first and
// last text, usage, finish reason) as it goes, so a stopped reply still has its TTFT.
async function stream(path, body, onText, controller, timing) {
  timing.start = performance.now();
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body),
                                       signal: controller.signal });
  if (!response.ok) throw new Error(await errorText(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) {
          const text = choice.delta ? choice.delta.content : choice.text;
          if (text) {
            const now = performance.now();
            if (timing.first === null) timing.first = now;
            timing.last = now;
            onText(text);
          }
          if (choice.finish_reason) timing.finish = choice.finish_reason;
        }
        if (chunk.usage) timing.usage = chunk.usage;
      }
    }
  }
  return timing;
}

function newTiming() {
  return { start: performance.now(), first: null, last: null, usage: null, finish: null };
}

function describe(timing) {
  const parts = [];
  if (timing.first !== null) parts.push(`TTFT ${(timing.first - timing.start).toFixed(0)} ms`);
  const tokens = timing.usage ? timing.usage.completion_tokens : null;
  if (tokens && timing.first !== null && timing.last > timing.first && tokens > 1) {
    parts.push(`${((tokens - 1) / ((timing.last - timing.first) / 1000)).toFixed(1)} tokens/s`);
  }
  if (tokens === null && timing.first !== null) parts.push("stopped"); // no usage: the stream was cut
  if (tokens !== null) parts.push(`${tokens} tokens`);
  if (timing.finish) parts.push(`finish: ${timing.finish}`);
  return parts.join(" · ");
}

function setRunning(controller, sendButton, stopButton) {
  running = controller ? { controller, stopButton } : null;
  sendButton.disabled = Boolean(controller);
  stopButton.disabled = !controller;
}

function stop() {
  if (running) running.controller.abort(); // closes the stream: the server aborts the request
}

// -- chat ----------------------------------------------------------------------------------------

function renderMessage(message) {
  const box = document.createElement("div");
  box.className = `message ${message.role}` + (message.error ? " error-message" : "");
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role;
  const content = document.createElement("div");
  content.className = "content" + (message.error ? " error" : "");
  content.textContent = message.error || message.content;
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = message.stats || "";
  box.append(role, content, stats);
  $("messages").append(box);
  $("messages").scrollTop = $("messages").scrollHeight;
  return { box, content, stats };
}

function renderConversation() {
  $("messages").replaceChildren();
  state.messages.forEach(renderMessage);
}

async function sendChat() {
  const text = $("chat-input").value;
  if (!text.trim() || running) return;
  $("chat-input").value = "";
  state.messages.push({ role: "user", content: text });
  renderMessage(state.messages[state.messages.length - 1]);
  const reply = { role: "assistant", content: "" };
  state.messages.push(reply);
  saveState();
  const view = renderMessage(reply);
  const history = state.messages.filter((m) => !m.error && m !== reply).map((m) => ({ role: m.role, content: m.content }));
  const system = $("system-prompt").value.trim();
  const controller = new AbortController();
  const timing = newTiming();
  setRunning(controller, $("send"), $("stop"));
  try {
    const body = { ...samplingBody(true), messages: system ? [{ role: "system", content: system }, ...history] : history };
    await stream("/v1/chat/completions", body, (piece) => {
      reply.content += piece;
      view.content.textContent = reply.content;
      $("messages").scrollTop = $("messages").scrollHeight;
    }, controller, timing);
    reply.stats = describe(timing);
  } catch (error) {
    if (error.name === "AbortError") {
      reply.stats = describe(timing) || "stopped";
    } else {
      reply.error = String(error.message || error);
      view.box.classList.add("error-message");
      view.content.classList.add("error");
      view.content.textContent = reply.error;
    }
  } finally {
    setRunning(null, $("send"), $("stop"));
    view.stats.textContent = reply.stats || "";
    saveState();
    $("chat-input").focus();
  }
}

// -- completions ---------------------------------------------------------------------------------

async function sendCompletion() {
  const prompt = $("prompt").value;
  if (!prompt || running) return;
  const output = $("completion-output");
  output.textContent = "";
  output.classList.remove("error");
  $("completion-stats").textContent = "";
  const controller = new AbortController();
  const timing = newTiming();
  setRunning(controller, $("complete"), $("stop-completion"));
  try {
    const body = { ...samplingBody(false), prompt }; // the schema box is the chat's
    await stream("/v1/completions", body, (piece) => { output.textContent += piece; }, controller, timing);
    $("completion-stats").textContent = describe(timing);
  } catch (error) {
    if (error.name === "AbortError") {
      $("completion-stats").textContent = describe(timing) || "stopped";
    } else {
      output.classList.add("error");
      output.textContent = String(error.message || error);
    }
  } finally {
    setRunning(null, $("complete"), $("stop-completion"));
  }
}

// -- tabs and keys -------------------------------------------------------------------------------

function selectTab(name) {
  state.tab = name;
  saveState();
  for (const tab of ["chat", "completions"]) {
    $(`tab-${tab}`).setAttribute("aria-selected", String(tab === name));
    $(`panel-${tab}`).classList.toggle("hidden", tab !== name);
  }
}

function bind() {
  $("send").addEventListener("click", sendChat);
  $("stop").addEventListener("click", stop);
  $("complete").addEventListener("click", sendCompletion);
  $("stop-completion").addEventListener("click", stop);
  $("clear").addEventListener("click", () => { state.messages = []; saveState(); renderConversation(); });
  $("tab-chat").addEventListener("click", () => selectTab("chat"));
  $("tab-completions").addEventListener("click", () => selectTab("completions"));
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); sendChat(); }
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) { event.preventDefault(); sendCompletion(); }
  });
  document.addEventListener("keydown", (event) => { if (event.key === "Escape") stop(); });
  document.querySelector(".tabs").addEventListener("keydown", (event) => {
    if (event.key === "ArrowRight" || event.key === "ArrowLeft") {
      const next = state.tab === "chat" ? "completions" : "chat";
      selectTab(next);
      $(`tab-${next}`).focus();
    }
  });
}

restoreSettings();
bind();
renderConversation();
selectTab(state.tab);
loadModel();
