// The swarm map: polls the tracker's /v1/status (every model's coverage, aggregated by the
// tracker) and one page of /v1/status/nodes (filtered there), and redraws what changed.
import { ago, count, el, figure, shortId } from "./dom.js";

const LEVELS = 4; // shades of a served stretch, by its throughput against the model's best
const FILTERS = ["f-artifact", "f-layer", "f-q", "f-state", "f-sort"];
const PAGE = 25;

const key = takeKey();
let offset = 0;
let total = 0;
let pollSeconds = 2;
let timer = 0;
let typing = 0;
const drawn = new Map(); // artifact -> the JSON its card was last drawn from

/** The status key from ?key=, kept in this page's memory only and taken out of the address bar. */
function takeKey() {
  const url = new URL(window.location.href);
  const given = url.searchParams.get("key");
  if (given === null) return "";
  url.searchParams.delete("key");
  window.history.replaceState(null, "", url.pathname + url.search + url.hash);
  return given;
}

async function read(path) {
  const response = await fetch(path, {
    headers: key ? { authorization: `Bearer ${key}` } : {},
    cache: "no-store",
  });
  if (response.status === 401) throw new Error("the tracker refused the status key: open the map again with the right one");
  if (!response.ok) throw new Error(`the tracker answered ${response.status} to ${path.split("?")[0]}`);
  return response.json();
}

function nodeQuery() {
  const query = new URLSearchParams({ offset: String(offset), limit: String(PAGE) });
  const value = (id) => document.getElementById(id).value.trim();
  if (value("f-artifact")) query.set("artifact", value("f-artifact"));
  if (/^[0-9]+$/.test(value("f-layer"))) query.set("layer", value("f-layer"));
  if (value("f-q")) query.set("q", value("f-q"));
  if (value("f-state") !== "all") query.set("state", value("f-state"));
  if (value("f-sort") !== "layers") query.set("sort", value("f-sort"));
  return `v1/status/nodes?${query}`;
}

async function refresh() {
  window.clearTimeout(timer);
  if (document.hidden) {
    // nobody looks: ask again once the page is shown (visibilitychange)
    return;
  }
  try {
    const [status, page] = await Promise.all([read("v1/status"), read(nodeQuery())]);
    // with the nodes, but a large swarm's interval (a minute) is too slow for a page
    pollSeconds = Math.min(5, Math.max(1, status.heartbeat_seconds || 2));
    drawStatus(status);
    drawNodes(page);
    document.getElementById("problem").hidden = true;
    document.getElementById("freshness").textContent = `Updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    const problem = document.getElementById("problem");
    problem.textContent = `${error.message}; trying again.`;
    problem.hidden = false;
  }
  timer = window.setTimeout(refresh, pollSeconds * 1000);
}

function drawStatus(status) {
  const routable = status.models.filter((m) => m.routable).length;
  const summary = `${count(status.nodes, "node")}, ${count(status.models.length, "model")}` +
    (status.models.length ? `, ${routable} of them with a complete route` : "") +
    `; ${count(status.routes_issued, "route")} issued.`;
  const line = document.getElementById("summary");
  if (line.textContent !== summary) line.textContent = summary; // spoken only when it changes
  drawModels(status.models);
  drawModelChoice(status.models);
  drawDeparted(status.departed);
}

function drawModels(models) {
  const container = document.getElementById("models");
  for (const child of [...container.children]) if (!child.matches("article.model")) child.remove();
  if (!models.length) {
    container.replaceChildren(el("p", { class: "muted" }, "No node has registered with this tracker yet."));
    drawn.clear();
    return;
  }
  const cards = new Map([...container.children].map((card) => [card.dataset.artifact, card]));
  const ordered = models.map((model) => {
    const json = JSON.stringify(model);
    const card = cards.get(model.artifact);
    if (card && drawn.get(model.artifact) === json) return card; // unchanged: left as it is
    const fresh = el("article", { class: "model", dataset: { artifact: model.artifact } }, modelCard(model));
    if (card) {
      // a keyboard user on a stretch of the strip stays on it across the redraw
      const active = document.activeElement;
      const focusKey = active && card.contains(active) ? active.dataset.focusKey : undefined;
      card.replaceWith(fresh);
      if (focusKey !== undefined) {
        [...fresh.querySelectorAll("[data-focus-key]")].find((node) => node.dataset.focusKey === focusKey)?.focus();
      }
    }
    drawn.set(model.artifact, json);
    return fresh;
  });
  for (const [artifact, card] of cards) {
    if (!models.some((m) => m.artifact === artifact)) {
      card.remove();
      drawn.delete(artifact);
    }
  }
  ordered.forEach((card, i) => {
    if (container.children[i] !== card) container.insertBefore(card, container.children[i] || null);
  });
}

function modelCard(model) {
  const best = Math.max(0, ...model.segments.map((s) => s.tokens_per_s));
  const heading = el(
    "header",
    { class: "model-head" },
    el("h3", { class: "model-name" }, model.name || "(unnamed model)"),
    model.routable
      ? el("span", { class: "badge good" }, "complete route")
      : el("span", { class: "badge bad" }, "no complete route"),
    el(
      "span",
      { class: "muted" },
      `${count(model.n_layer, "layer")} · ${count(model.nodes, "node")} (${model.admitted} in routes) · ` +
        `${count(model.active_sessions, "session")} · artifact ${shortId(model.artifact)}`,
    ),
  );
  return [heading, strip(model, best), stripNote(model), bands(model), tallies(model), routes(model)];
}

function level(segment, best) {
  if (!segment.admitted) return 0;
  return best > 0 ? Math.max(1, Math.ceil((segment.tokens_per_s / best) * LEVELS)) : 1;
}

function span(start, end) {
  return end - start === 1 ? `layer ${start}` : `layers ${start}–${end - 1}`;
}

function strip(model, best) {
  const items = model.segments.map((segment) => {
    const state = !segment.nodes ? "nobody holds them" : !segment.admitted ? "no node in routes" : "";
    const label =
      `${span(segment.start, segment.end)}: ${count(segment.nodes, "node")}, ${segment.admitted} in routes, ` +
      `${figure(segment.tokens_per_s)} tokens/s` + (state ? `, ${state}` : "") + (segment.thin ? ", the thinnest" : "");
    const button = el(
      "button",
      {
        type: "button",
        class: "segment-button",
        title: label,
        "aria-label": `${label}. Show the nodes holding them.`,
        dataset: { focusKey: `${model.artifact}:${segment.start}` },
        on: { click: () => showLayer(model.artifact, segment.start) },
      },
      el("span", { class: "segment-layers" }, `${segment.start}–${segment.end - 1}`),
      el("span", { class: "segment-nodes" }, segment.admitted ? `${segment.admitted}×` : "none"),
    );
    return el(
      "li",
      {
        class: `segment level-${level(segment, best)}${segment.thin ? " thin" : ""}`,
        style: { "flex-grow": String(segment.end - segment.start) },
        dataset: {
          start: segment.start,
          end: segment.end,
          nodes: segment.nodes,
          admitted: segment.admitted,
          tokensPerS: segment.tokens_per_s,
        },
      },
      button,
    );
  });
  return el(
    "div",
    { class: "strip-wrap" },
    el("ol", { class: "strip", "aria-label": `The ${model.n_layer} layers, by the nodes that serve them` }, items),
    el("div", { class: "axis", "aria-hidden": "true" }, el("span", {}, "0"), el("span", {}, String(model.n_layer))),
  );
}

function stripNote(model) {
  const bare = model.segments.filter((s) => !s.admitted);
  const thin = model.segments.filter((s) => s.thin && s.admitted);
  const parts = [];
  if (bare.length) parts.push(`Not served by any node in routes: ${bare.map((s) => span(s.start, s.end)).join(", ")}.`);
  if (thin.length) {
    const s = thin[0];
    parts.push(
      `Thinnest: ${thin.map((t) => span(t.start, t.end)).join(", ")} (${count(s.admitted, "node")}, ` +
        `${figure(s.tokens_per_s)} tokens/s).`,
    );
  }
  if (!parts.length) parts.push("Every layer is served alike.");
  return el("p", { class: bare.length ? "strip-note bad" : "strip-note" }, parts.join(" "));
}

function bands(model) {
  const rows = model.bands.map((band) =>
    el(
      "li",
      { class: "band", dataset: { start: band.start, end: band.end, nodes: band.nodes } },
      el(
        "span",
        {
          class: `band-bar${band.admitted ? "" : " out"}`,
          style: {
            "margin-left": `${(100 * band.start) / model.n_layer}%`,
            width: `${(100 * (band.end - band.start)) / model.n_layer}%`,
          },
        },
        el(
          "span",
          { class: "band-label" },
          `${band.start}:${band.end} · ${count(band.nodes, "node")} · ${figure(band.tokens_per_s)} tok/s`,
        ),
      ),
    ),
  );
  const more = model.bands_not_shown
    ? el("p", { class: "muted" }, `and ${count(model.bands_not_shown, "other range")}, held by fewer nodes`)
    : null;
  return el("div", { class: "bands-wrap" }, el("h4", {}, "Ranges held"), el("ol", { class: "bands" }, rows), more);
}

function tally(title, counts) {
  const entries = Object.entries(counts);
  return el(
    "div",
    { class: "tally" },
    el("dt", {}, title),
    el("dd", {}, entries.length ? entries.map(([name, n]) => `${name} ${n}`).join(", ") : "–"),
  );
}

function tallies(model) {
  return el(
    "dl",
    { class: "tallies" },
    tally("Devices", model.devices),
    tally("Drift classes", model.drift_classes),
    tally("Reach", model.reachability),
    tally("Probes", model.probes),
    tally("Slow", { nodes: model.slow }),
    tally("Not heard from lately", { nodes: model.stale }),
  );
}

function routes(model) {
  const title = el("h4", {}, "Routes the tracker would pick now");
  if (!model.routes.length) {
    const why = model.routable ? "Every route is full." : "None: the nodes in routes do not chain across every layer.";
    return el("div", { class: "routes-wrap" }, title, el("p", { class: "bad" }, why));
  }
  const spread = model.routes.filter((route) => route.near_equal).length;
  const list = model.routes.map((route) =>
    el(
      "li",
      { class: "route", dataset: { nodes: route.hops.map((h) => h.node_id).join(" ") } },
      route.hops.flatMap((hop, i) => [
        i ? el("span", { class: "arrow", "aria-label": "then" }, " → ") : null,
        el(
          "span",
          { class: "hop", title: hop.node_id },
          el("code", {}, shortId(hop.node_id)),
          ` [${hop.layers[0]}:${hop.layers[1]}] ${hop.device}, ${reach(hop.reachability)}`,
        ),
      ]),
      el("span", { class: "muted" }, ` · about ${figure(route.cost_ms)} ms a step`),
      spread > 1 && route.near_equal ? el("span", { class: "badge" }, `one of ${spread} about as cheap`) : null,
    ),
  );
  const others = model.route_count - model.routes.length;
  const more = others
    ? el("p", { class: "muted" }, `and ${count(others, "costlier route")}${model.routes_capped ? " or more" : ""}`)
    : null;
  return el("div", { class: "routes-wrap" }, title, el("ol", { class: "routes" }, list), more);
}

function reach(reachability) {
  return { "relay-only": "relay", "direct+relay": "direct + relay" }[reachability] || reachability;
}

function drawModelChoice(models) {
  const select = document.getElementById("f-artifact");
  const chosen = select.value;
  const options = [el("option", { value: "" }, "all")].concat(
    models.map((m) => el("option", { value: m.artifact }, `${m.name || "(unnamed)"} · ${shortId(m.artifact)}`)),
  );
  const same =
    select.options.length === options.length &&
    options.every((o, i) => select.options[i].value === o.value && select.options[i].text === o.text);
  if (same) return;
  select.replaceChildren(...options);
  select.value = models.some((m) => m.artifact === chosen) ? chosen : "";
}

function drawNodes(page) {
  total = page.total;
  const body = document.querySelector("#nodes tbody");
  if (!page.nodes.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: "11", class: "muted" }, "No node matches.")));
  } else {
    body.replaceChildren(...page.nodes.map(nodeRow));
  }
  const last = Math.min(page.total, page.offset + page.nodes.length);
  document.getElementById("page-info").textContent = page.total
    ? `${page.offset + 1}–${last} of ${count(page.total, "node")}`
    : "";
  document.getElementById("prev").disabled = page.offset === 0;
  document.getElementById("next").disabled = last >= page.total;
}

function nodeRow(node) {
  const [start, end] = node.layers;
  const probe = { passed: "passed", failed: "FAILED", pending: "pending", none: "–" }[node.probe];
  return el(
    "tr",
    {
      class: `${node.admitted ? "" : "out"}${node.stale ? " stale" : ""}`,
      dataset: { nodeId: node.node_id, artifact: node.artifact, layers: `${start}:${end}` },
    },
    el("td", {}, el("code", { title: node.node_id }, shortId(node.node_id))),
    el("td", { class: "model-cell" }, node.model_name || "–"),
    el(
      "td",
      { class: "layers-cell" },
      el("span", { class: "layers-text" }, `${start}:${end}`),
      el(
        "span",
        { class: "range", "aria-hidden": "true" },
        el("span", {
          class: "range-fill",
          style: { left: `${(100 * start) / node.n_layer}%`, width: `${(100 * (end - start)) / node.n_layer}%` },
        }),
      ),
    ),
    el("td", {}, node.device),
    el("td", { class: "drift" }, node.drift_class || "–"),
    el("td", {}, reach(node.reachability)),
    el("td", {}, `${node.active_sessions}/${node.slots}` + (node.queue_depth ? ` (+${node.queue_depth} queued)` : "")),
    el(
      "td",
      {},
      `${figure(node.estimated_step_ms)} ms`,
      node.slow ? el("span", { class: "badge bad" }, "slow") : null,
    ),
    el("td", {}, `${figure(node.tokens_per_s)} tok/s`),
    el(
      "td",
      { class: `probe-${node.probe}`, title: node.probe_detail || null },
      probe,
      // the reason is data from the tracker: a title and a text node, never markup
      node.audit_failed ? el("span", { class: "badge bad", title: node.audit_failed }, "excluded by audits") : null,
    ),
    el("td", {}, ago(node.seconds_since_heartbeat), node.stale ? el("span", { class: "badge bad" }, "late") : null),
  );
}

function drawDeparted(departed) {
  const list = document.getElementById("departed");
  if (!departed.length) {
    list.replaceChildren(el("li", { class: "muted" }, "None lately."));
    return;
  }
  list.replaceChildren(
    ...departed.map((gone) =>
      el(
        "li",
        { dataset: { nodeId: gone.node_id, why: gone.why } },
        el("code", { title: gone.node_id }, shortId(gone.node_id)),
        ` ${gone.model_name || "(unnamed model)"}, layers ${gone.layers[0]}:${gone.layers[1]}: `,
        gone.why === "left" ? "left" : "fell silent",
        ` ${ago(gone.seconds_ago)}`,
      ),
    ),
  );
}

function showLayer(artifact, layer) {
  document.getElementById("f-artifact").value = artifact;
  document.getElementById("f-layer").value = String(layer);
  offset = 0;
  refresh();
}

function filtersChanged(event) {
  offset = 0;
  window.clearTimeout(typing);
  // a search box asks at most every quarter second while typed into
  typing = window.setTimeout(refresh, event && event.type === "input" ? 250 : 0);
}

function start() {
  for (const id of FILTERS) {
    const control = document.getElementById(id);
    control.addEventListener("change", filtersChanged);
    if (control.tagName === "INPUT") control.addEventListener("input", filtersChanged);
  }
  const form = document.getElementById("filters");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    filtersChanged();
  });
  form.addEventListener("reset", () => window.setTimeout(filtersChanged, 0));
  document.getElementById("prev").addEventListener("click", () => {
    offset = Math.max(0, offset - PAGE);
    refresh();
  });
  document.getElementById("next").addEventListener("click", () => {
    if (offset + PAGE < total) offset += PAGE;
    refresh();
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden) refresh();
  });
  refresh();
}

start();
