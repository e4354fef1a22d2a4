"use strict";
// The chat page: conversations kept in this browser's local storage, answers streamed from
// /v1/chat/completions, Markdown rendered by markdown.js (text nodes only).
(() => {
  const STORE = "crane-mp-conversations";
  const SETTINGS = "crane-mp-settings";
  const $ = (id) => document.getElementById(id);
  const ui = {
    model: $("model"), messages: $("messages"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
    attach: $("attach"), attachments: $("attachments"), notice: $("notice"), statusLine: $("status-line"),
    list: $("conversation-list"), settings: $("settings"), system: $("system"), temperature: $("temperature"),
    topP: $("top-p"), maxTokens: $("max-tokens"), apiKey: $("api-key"),
  };
  let conversations = load(STORE, []);
  let current = conversations.length ? conversations[0].id : null;
  let pending = [];  // attachments of the message being written: {kind, name, data}
  let running = null;  // the AbortController of the answer streaming now

  function load(key, fallback) {
    try {
      const value = JSON.parse(localStorage.getItem(key));
      return value === null ? fallback : value;
    } catch (err) {
      return fallback;
    }
  }

  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(conversations));
    } catch (err) {
      notice("This browser's storage is full: export and delete old conversations. " + err.message);
    }
  }

  function notice(text) {
    ui.notice.textContent = text || "";
    ui.notice.hidden = !text;
  }

  function conversation() {
    return conversations.find((c) => c.id === current) || null;
  }

  function newConversation() {
    const c = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 8), title: "New chat",
      created: new Date().toISOString(), messages: [] };
    conversations.unshift(c);
    current = c.id;
    save();
    return c;
  }

  // ---- settings ----
  const defaults = { system: "", temperature: 0.7, top_p: 1, max_tokens: 1024, model: "" };
  let settings = Object.assign({}, defaults, load(SETTINGS, {}));

  function showSettings() {
    ui.system.value = settings.system;
    ui.temperature.value = settings.temperature;
    ui.topP.value = settings.top_p;
    ui.maxTokens.value = settings.max_tokens;
    ui.apiKey.value = craneApi.apiKey();
  }

  function readSettings() {
    const number = (input, fallback) => (input.value === "" || isNaN(Number(input.value)) ? fallback : Number(input.value));
    settings.system = ui.system.value;
    settings.temperature = number(ui.temperature, defaults.temperature);
    settings.top_p = number(ui.topP, defaults.top_p);
    settings.max_tokens = Math.max(1, Math.round(number(ui.maxTokens, defaults.max_tokens)));
    craneApi.setApiKey(ui.apiKey.value.trim());
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
  }

  // ---- models ----
  async function loadModels() {
    try {
      const models = (await craneApi.json("/v1/models")).data || [];
      ui.model.replaceChildren(...models.map((m) => {
        const option = document.createElement("option");
        option.value = m.id;
        option.textContent = m.state && m.state !== "loaded" ? m.id + " (" + m.state + ")" : m.id;
        return option;
      }));
      if (models.some((m) => m.id === settings.model)) ui.model.value = settings.model;
      notice("");
    } catch (err) {
      notice("Models: " + err.message);
    }
  }

  // ---- rendering ----
  function renderList() {
    ui.list.replaceChildren(...conversations.map((c) => {
      const li = document.createElement("li");
      li.className = c.id === current ? "current" : "";
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open";
      open.textContent = c.title;
      open.addEventListener("click", () => { current = c.id; renderAll(); });
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "delete";
      remove.title = "Delete";
      remove.textContent = "\u00d7";
      remove.addEventListener("click", () => {
        conversations = conversations.filter((x) => x.id !== c.id);
        if (current === c.id) current = conversations.length ? conversations[0].id : null;
        save();
        renderAll();
      });
      li.append(open, remove);
      return li;
    }));
  }

  function messageNode(message, index) {
    const li = document.createElement("li");
    li.className = "message " + message.role;
    const body = document.createElement("div");
    body.className = "content";
    if (message.role === "assistant") {
      if (message.reasoning) {
        const details = document.createElement("details");
        details.className = "reasoning";
        const summary = document.createElement("summary");
        summary.textContent = "Thinking";
        const thought = document.createElement("div");
        thought.className = "thought";
        thought.textContent = message.reasoning;
        details.append(summary, thought);
        // Open while there is no answer besides it (a model still thinking, or one that only thought),
        // folded once the answer comes; a reader's own click decides from then on.
        details.open = message.reasoningOpen !== undefined ? message.reasoningOpen : !message.content;
        summary.addEventListener("click", () => { message.reasoningOpen = !details.open; });
        li.append(details);
      }
      body.append(craneMarkdown.render(message.content || ""));
    } else {
      body.textContent = message.content;
      for (const file of message.attachments || []) {
        if (file.kind === "image") {
          const img = document.createElement("img");
          img.src = file.data;
          img.alt = file.name;
          img.className = "thumb";
          body.append(img);
        } else {
          const tag = document.createElement("span");
          tag.className = "file";
          tag.textContent = "\ud83d\udcc4 " + file.name;
          body.append(tag);
        }
      }
    }
    li.append(body);
    if (message.error) {
      const error = document.createElement("div");
      error.className = "error";
      error.textContent = message.error;
      li.append(error);
    }
    const footer = document.createElement("div");
    footer.className = "meta";
    if (message.stats) {
      const stats = document.createElement("span");
      stats.className = "stats";
      stats.textContent = message.stats;
      footer.append(stats);
    }
    const last = index === conversation().messages.length - 1;
    if (message.role === "user") footer.append(button("Edit", "edit", () => edit(index)));
    if (message.role === "assistant" && last) footer.append(button("Regenerate", "regenerate", regenerate));
    li.append(footer);
    return li;
  }

  function button(label, className, onClick) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = className;
    b.textContent = label;
    b.addEventListener("click", () => { if (!running) onClick(); });
    return b;
  }

  function renderMessages() {
    const c = conversation();
    ui.messages.replaceChildren(...(c ? c.messages.map(messageNode) : []));
    ui.messages.lastElementChild?.scrollIntoView({ block: "end" });
  }

  function renderAttachments() {
    ui.attachments.replaceChildren(...pending.map((file, i) => {
      const chip = document.createElement("span");
      chip.className = "chip";
      chip.textContent = file.name;
      chip.append(button("\u00d7", "remove", () => { pending.splice(i, 1); renderAttachments(); }));
      return chip;
    }));
  }

  function renderAll() {
    renderList();
    renderMessages();
  }

  // ---- sending ----
  function apiMessages(c) {
    const out = settings.system ? [{ role: "system", content: settings.system }] : [];
    for (const m of c.messages) {
      if (m.role === "assistant") {
        if (m.content) out.push({ role: "assistant", content: m.content });
        continue;
      }
      const files = m.attachments || [];
      if (!files.length) {
        out.push({ role: "user", content: m.content });
        continue;
      }
      const parts = [];
      for (const f of files.filter((f) => f.kind === "text")) {
        parts.push({ type: "text", text: "File " + f.name + ":\n```\n" + f.data + "\n```" });
      }
      if (m.content) parts.push({ type: "text", text: m.content });
      for (const f of files.filter((f) => f.kind === "image")) parts.push({ type: "image_url", image_url: { url: f.data } });
      out.push({ role: "user", content: parts });
    }
    return out;
  }

  async function answer() {
    const c = conversation();
    const reply = { role: "assistant", content: "", reasoning: "" };
    c.messages.push(reply);
    renderMessages();
    const node = ui.messages.lastElementChild;
    running = new AbortController();
    ui.stop.hidden = false;
    ui.send.disabled = true;
    const started = performance.now();
    let first = null;
    let usage = null;
    let drawn = false;
    const redraw = () => {
      drawn = false;
      const fresh = messageNode(reply, c.messages.length - 1);
      node.replaceChildren(...fresh.childNodes);
      node.scrollIntoView({ block: "end" });
    };
    try {
      const body = { model: ui.model.value || undefined, messages: apiMessages({ messages: c.messages.slice(0, -1) }),
        stream: true, stream_options: { include_usage: true }, temperature: settings.temperature,
        top_p: settings.top_p, max_tokens: settings.max_tokens };
      await craneApi.stream("/v1/chat/completions", body, running.signal, (event) => {
        if (event.usage) usage = event.usage;
        const delta = event.choices && event.choices[0] && event.choices[0].delta;
        if (!delta) return;
        if (delta.content || delta.reasoning_content) first = first || performance.now();
        reply.content += delta.content || "";
        reply.reasoning += delta.reasoning_content || "";
        if (!drawn) {
          drawn = true;
          requestAnimationFrame(redraw);
        }
      });
    } catch (err) {
      if (err.name === "AbortError") reply.stopped = true;
      else reply.error = err.message;
    } finally {
      running = null;
      ui.stop.hidden = true;
      ui.send.disabled = false;
    }
    const ended = performance.now();
    const parts = [];
    if (usage) parts.push(usage.prompt_tokens + " prompt + " + usage.completion_tokens + " tokens");
    if (first) parts.push("first token " + ((first - started) / 1000).toFixed(2) + " s");
    if (usage && first && ended > first && usage.completion_tokens > 1) {
      parts.push(((usage.completion_tokens - 1) / ((ended - first) / 1000)).toFixed(1) + " tok/s");
    }
    if (reply.stopped) parts.push("stopped");
    reply.stats = parts.join(" \u00b7 ");
    if (!reply.reasoning) delete reply.reasoning;
    save();
    renderMessages();
  }

  async function send(event) {
    event.preventDefault();
    if (running) return;
    const text = ui.prompt.value.trim();
    if (!text && !pending.length) return;
    const c = conversation() || newConversation();
    c.messages.push({ role: "user", content: text, attachments: pending });
    if (c.title === "New chat") c.title = (text || pending[0].name).slice(0, 48);
    pending = [];
    ui.prompt.value = "";
    renderAttachments();
    save();
    renderList();
    await answer();
  }

  function regenerate() {
    const c = conversation();
    if (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
    save();
    answer();
  }

  function edit(index) {
    const c = conversation();
    const message = c.messages[index];
    ui.prompt.value = message.content;
    pending = message.attachments || [];
    c.messages = c.messages.slice(0, index);
    save();
    renderAttachments();
    renderMessages();
    ui.prompt.focus();
  }

  function attach() {
    for (const file of ui.attach.files) {
      const reader = new FileReader();
      const image = file.type.startsWith("image/");
      reader.onload = () => {
        pending.push({ kind: image ? "image" : "text", name: file.name, data: reader.result });
        renderAttachments();
      };
      reader.onerror = () => notice("Could not read " + file.name);
      if (image) reader.readAsDataURL(file);
      else reader.readAsText(file);
    }
    ui.attach.value = "";
  }

  function exportJson() {
    const blob = new Blob([JSON.stringify(conversations, null, 2)], { type: "application/json" });
    const link = document.createElement("a");
    link.href = URL.createObjectURL(blob);
    link.download = "crane-mp-conversations.json";
    link.click();
    URL.revokeObjectURL(link.href);
  }

  // ---- wiring ----
  $("composer").addEventListener("submit", send);
  ui.prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  ui.stop.addEventListener("click", () => running && running.abort());
  ui.attach.addEventListener("change", attach);
  ui.model.addEventListener("change", () => {
    settings.model = ui.model.value;
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
  });
  $("new-chat").addEventListener("click", () => { if (!running) { newConversation(); renderAll(); } });
  $("export").addEventListener("click", exportJson);
  $("toggle-list").addEventListener("click", () => document.body.classList.toggle("show-list"));
  $("open-settings").addEventListener("click", () => { showSettings(); ui.settings.showModal(); });
  ui.settings.addEventListener("close", () => { readSettings(); loadModels(); });
  renderAll();
  loadModels();
})();
