// The chat page: the gateway's own OpenAI API (/v1/models, /v1/chat/completions, streamed), with
// the key typed on the page when the gateway needs one. Stop aborts the request: the gateway sees
// its client leave and cancels the route session on every node of the route.
import { count, el, figure, shortId } from "./dom.js";

const $ = (id) => document.getElementById(id);

let key = ""; // in this page's memory only: never stored, sent to this gateway alone
let history = []; // the conversation the model has seen: {role, content}
let controller = null; // the reply being streamed, while one is

class ReplyError extends Error {}

function headers(json) {
  const fields = json ? { "content-type": "application/json" } : {};
  if (key) fields.authorization = `Bearer ${key}`;
  return fields;
}

function notice(text, problem = false) {
  const line = $("notice");
  line.textContent = text;
  line.classList.toggle("bad", problem);
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body?.error?.message) return String(body.error.message);
  } catch {
    // not JSON: the status says what there is to say
  }
  return `the gateway answered ${response.status}`;
}

async function loadModels() {
  const select = $("model");
  let response;
  try {
    response = await fetch("v1/models", { headers: headers(false), cache: "no-store" });
  } catch (error) {
    notice(`The gateway cannot be reached: ${error.message}`, true);
    return;
  }
  if (response.status === 401) {
    select.replaceChildren();
    notice(key ? "The gateway refused this API key." : "This gateway needs an API key: enter it above.", true);
    $("key").focus();
    return;
  }
  if (!response.ok) {
    notice(`The models could not be listed: ${await errorMessage(response)}`, true);
    return;
  }
  const listed = await response.json();
  const chosen = select.value;
  const ids = (listed.data || []).map((model) => String(model.id));
  select.replaceChildren(...ids.map((id) => el("option", { value: id }, id)));
  if (ids.includes(chosen)) select.value = chosen;
  notice(ids.length ? `${count(ids.length, "model")} served here.` : "This gateway serves no model.", !ids.length);
}

/** The request's fields from the settings; throws with a message a reader can act on. */
function settings() {
  const fields = {};
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens) {
    const n = Number(maxTokens);
    if (!Number.isInteger(n) || n < 1) throw new Error("Max tokens must be a whole number, 1 or more.");
    fields.max_tokens = n;
  }
  const temperature = $("temperature").value.trim();
  if (temperature) {
    const t = Number(temperature);
    if (!(t >= 0 && t <= 2)) throw new Error("Temperature must lie between 0 and 2.");
    fields.temperature = t;
  }
  const more = $("extra").value.trim();
  if (more) {
    let extra;
    try {
      extra = JSON.parse(more);
    } catch (error) {
      throw new Error(`More request fields: this is not JSON (${error.message}).`);
    }
    if (extra === null || typeof extra !== "object" || Array.isArray(extra)) {
      throw new Error('More request fields: give a JSON object, such as {"seed": 1}.');
    }
    Object.assign(fields, extra);
  }
  return { fields, system: $("system").value.trim() };
}

function userItem(text) {
  return el("li", { class: "message user" }, el("p", { class: "who" }, "You"), el("div", { class: "text" }, text));
}

/** A reply's place in the conversation, filled in as its chunks come. */
function replyItem(model) {
  const text = document.createTextNode("");
  const thought = document.createTextNode("");
  const thinking = el("details", { class: "thinking", hidden: true }, el("summary", {}, "Thinking"), el("div", { class: "thought" }, thought));
  const meta = el("p", { class: "meta" }, "Waiting for the route…");
  const item = el(
    "li",
    { class: "message assistant", dataset: { state: "streaming" }, "aria-busy": "true" },
    el("p", { class: "who" }, model),
    thinking,
    el("div", { class: "text" }, text),
    meta,
  );
  const settle = (state, ...parts) => {
    item.dataset.state = state;
    item.setAttribute("aria-busy", "false");
    meta.replaceChildren(...parts);
  };
  return {
    item,
    text: () => text.data,
    add(piece) {
      if (!text.length) meta.textContent = "Streaming…";
      text.appendData(piece);
      item.scrollIntoView({ block: "nearest" });
    },
    think(piece) {
      thinking.hidden = false;
      thought.appendData(piece);
    },
    done(end) {
      settle("done", ...served(end));
    },
    stopped(seconds) {
      settle("stopped", `Stopped after ${figure(seconds)} s: the gateway cancels the route session.`);
    },
    failed(message) {
      item.classList.add("failed");
      settle("error", el("span", { class: "bad" }, `The reply failed: ${message}`), " It is left out of the conversation.");
    },
  };
}

/** Which nodes served a finished reply, and how fast. */
function served(end) {
  const parts = [];
  if (end.route?.length) {
    parts.push("Served by ");
    end.route.forEach((hop, i) => {
      if (i) parts.push(" → ");
      parts.push(
        el(
          "span",
          { class: "hop", dataset: { nodeId: String(hop.node_id) }, title: String(hop.node_id) },
          el("code", {}, shortId(hop.node_id)),
          ` layers ${hop.layers[0]}:${hop.layers[1]} (${hop.via})`,
        ),
      );
    });
    parts.push(". ");
  }
  const tokens = end.usage?.completion_tokens;
  if (Number.isFinite(tokens)) {
    // as the demo counts it: the tokens after the first, over the time after the first
    const streaming = (end.lastAt - end.firstAt) / 1000;
    const rate = tokens > 1 && streaming > 0 ? (tokens - 1) / streaming : tokens / ((end.lastAt - end.started) / 1000);
    parts.push(
      el("span", { class: "rate", dataset: { tokens, tokensPerS: rate.toFixed(2) } }, `${count(tokens, "token")}, ${figure(rate)} tokens/s`),
    );
    if (end.firstAt) parts.push(`, first after ${Math.round(end.firstAt - end.started)} ms`);
    parts.push(".");
  }
  if (end.finish === "length") parts.push(" It stopped at the token limit.");
  if (end.repairs?.length) parts.push(` A node left mid-reply; the route was repaired ${count(end.repairs.length, "time")}.`);
  return parts;
}

async function send(text) {
  let options;
  try {
    options = settings();
  } catch (error) {
    notice(error.message, true);
    return;
  }
  const model = $("model").value;
  if (!model) {
    notice("Choose a model first (an API key may be needed to list them).", true);
    return;
  }
  const user = { role: "user", content: text };
  const reply = replyItem(model);
  $("conversation").append(userItem(text), reply.item);
  reply.item.scrollIntoView({ block: "nearest" });
  const messages = [...(options.system ? [{ role: "system", content: options.system }] : []), ...history, user];
  const body = { ...options.fields, model, messages, stream: true, stream_options: { include_usage: true } };
  controller = new AbortController();
  busy(true);
  const end = { started: performance.now(), firstAt: 0, lastAt: 0, usage: null, route: null, finish: null, repairs: null };
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: headers(true),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) throw new ReplyError(await errorMessage(response));
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith("data:")) take(line.slice(5).trim(), reply, end);
        }
      }
    }
    end.lastAt = end.lastAt || performance.now();
    reply.done(end);
    history.push(user, { role: "assistant", content: reply.text() });
  } catch (error) {
    if (error.name === "AbortError") {
      reply.stopped((performance.now() - end.started) / 1000);
      // what was shown stays in the conversation: the model sees its own words next turn
      history.push(user, { role: "assistant", content: reply.text() });
    } else {
      controller.abort(); // whatever is left of the stream is not read: let the gateway know
      reply.failed(error instanceof ReplyError ? error.message : `the stream broke off (${error.message})`);
    }
  } finally {
    controller = null;
    busy(false);
  }
}

/** One `data:` line of the stream. */
function take(data, reply, end) {
  if (data === "[DONE]") return;
  const chunk = JSON.parse(data);
  if (chunk.error) throw new ReplyError(String(chunk.error.message || "the route failed"));
  if (chunk.usage) end.usage = chunk.usage;
  if (chunk.route) end.route = chunk.route;
  if (chunk.repairs) end.repairs = chunk.repairs;
  for (const choice of chunk.choices || []) {
    if (choice.index) continue; // the page asks for one choice
    const delta = choice.delta || {};
    if (delta.reasoning_content) reply.think(String(delta.reasoning_content));
    if (delta.content) {
      end.lastAt = performance.now();
      end.firstAt = end.firstAt || end.lastAt;
      reply.add(String(delta.content));
    }
    if (choice.finish_reason) end.finish = choice.finish_reason;
  }
}

function busy(streaming) {
  $("send").disabled = streaming;
  $("stop").disabled = !streaming;
}

function stop() {
  if (controller) controller.abort();
}

function start() {
  $("setup").addEventListener("submit", (event) => {
    event.preventDefault();
    key = $("key").value.trim();
    loadModels();
  });
  $("key").addEventListener("change", () => {
    key = $("key").value.trim();
    loadModels();
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("message").value.trim();
    if (!text || controller) return;
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") stop();
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => {
    stop();
    history = [];
    $("conversation").replaceChildren();
    notice("");
    $("message").focus();
  });
  loadModels();
}

start();
