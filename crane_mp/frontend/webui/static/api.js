"use strict";
// The server's API as the pages call it: the key (if any) from this tab's session storage, sent as a
// bearer token; an answer that is not 2xx becomes an Error carrying the server's own message.
const craneApi = (() => {
  const KEY = "crane-mp-api-key";

  function apiKey() {
    return sessionStorage.getItem(KEY) || "";
  }

  function setApiKey(value) {
    if (value) sessionStorage.setItem(KEY, value);
    else sessionStorage.removeItem(KEY);
  }

  function headers(json) {
    const out = {};
    if (json) out["Content-Type"] = "application/json";
    const key = apiKey();
    if (key) out["Authorization"] = "Bearer " + key;
    return out;
  }

  async function failure(response) {
    let message = response.status + " " + response.statusText;
    try {
      const body = await response.json();
      if (body && body.error) message = body.error.message || String(body.error);
      else if (body && body.message) message = body.message;
    } catch (err) {
      // not JSON: the status line says enough
    }
    const error = new Error(response.status === 401
      ? "401: the server wants an API key (Settings), or this one is wrong: " + message
      : message);
    error.status = response.status;
    return error;
  }

  async function request(method, path, body, signal) {
    const response = await fetch(path, {
      method, signal, headers: headers(body !== undefined),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (!response.ok) throw await failure(response);
    return response;
  }

  async function json(path) {
    return (await request("GET", path)).json();
  }

  async function text(path) {
    return (await request("GET", path)).text();
  }

  // Server-sent events of a streaming POST: onEvent(parsed JSON) per `data:` line until [DONE].
  async function stream(path, body, signal, onEvent) {
    const response = await request("POST", path, body, signal);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffered.indexOf("\n")) >= 0) {
        const line = buffered.slice(0, cut).trim();
        buffered = buffered.slice(cut + 1);
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }

  return { apiKey, setApiKey, json, text, stream };
})();
