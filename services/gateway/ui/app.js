// Shoal's dashboard: polls /ui/api/state every POLL_MS, follows /ui/api/events (SSE over
// fetch, events.js), draws its charts with charts.js. No library, no build step.
"use strict";
/* global ShoalCharts, ShoalEvents */

(() => {
  const POLL_MS = 2000;
  const KEY_STORAGE = "shoal.apiKey";
  const MAX_EVENTS = 200;
  const GIB = 2 ** 30;
  const STATE_ORDER = ["serving", "loading", "draining", "reserved", "sleeping"];

  const $ = (selector) => document.querySelector(selector);
  const view = {
    key: sessionStorage.getItem(KEY_STORAGE) || "",
    admin: false,
    points: [], // history points {at, models: {key: [rps, tps, ttft_s, queue]}}
    windowS: 600,
    lastAt: null,
    latest: null,
    reconnectEvents: null,
  };

  // ------------------------------------------------------------------ helpers

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function setText(node, text) {
    if (node.textContent !== text) node.textContent = text;
  }

  function gib(bytes) {
    return (bytes / GIB).toFixed(bytes >= 10 * GIB ? 0 : 1) + " GiB";
  }

  function rate(value) {
    if (value === null || value === undefined) return "–";
    if (value >= 100) return value.toFixed(0);
    if (value >= 10) return value.toFixed(1);
    return value.toFixed(2);
  }

  function percent(fraction) {
    const value = 100 * fraction;
    return (value > 0 && value < 10 ? value.toFixed(1) : value.toFixed(0)) + "%";
  }

  function millis(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    return seconds >= 10 ? seconds.toFixed(0) + " s" : (seconds * 1000).toFixed(0) + " ms";
  }

  function ago(unixSeconds, now) {
    if (!unixSeconds) return "never";
    const s = Math.max(0, now - unixSeconds);
    if (s < 60) return s.toFixed(0) + " s ago";
    if (s < 3600) return (s / 60).toFixed(0) + " min ago";
    if (s < 86400) return (s / 3600).toFixed(1) + " h ago";
    return (s / 86400).toFixed(1) + " d ago";
  }

  function clock(unixSeconds) {
    return new Date(unixSeconds * 1000).toLocaleTimeString([], { hour12: false });
  }

  function headers(extra) {
    const all = Object.assign({}, extra || {});
    if (view.key) all.Authorization = "Bearer " + view.key;
    return all;
  }

  function modelPath(model) {
    return model.split("/").map(encodeURIComponent).join("/");
  }

  let toastTimer = null;
  function toast(message, isError) {
    const node = $("#toast");
    node.textContent = message;
    node.classList.toggle("error", Boolean(isError));
    node.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { node.hidden = true; }, isError ? 8000 : 4000);
  }

  function setStatus(state, text) {
    const node = $("#status");
    node.dataset.state = state;
    setText(node, text);
  }

  function showBanner(text) {
    const node = $("#banner");
    node.hidden = !text;
    setText(node, text || "");
  }

  // ------------------------------------------------------------------ charts (charts.js)

  function drawThroughput(now) {
    const times = view.points.map((p) => p.at);
    const sum = (index) => view.points.map((p) => Object.values(p.models).reduce((a, m) => a + (m[index] || 0), 0));
    ShoalCharts.timeChart($("#throughput"), times, { values: sum(1), color: "#2563eb" },
      { values: sum(0), color: "#db7706" }, now - view.windowS, now, rate);
  }

  // ------------------------------------------------------------------ keyed rendering

  // Keeps one DOM node per key in `container`, in the order of `items`; `make` creates a
  // node for a new key, `update` refreshes it. Inputs inside rows survive refreshes.
  function reconcile(container, items, keyOf, make, update) {
    const existing = new Map();
    for (const child of Array.from(container.children)) existing.set(child.dataset.key, child);
    let previous = null;
    for (const item of items) {
      const key = keyOf(item);
      let node = existing.get(key);
      if (node) {
        existing.delete(key);
      } else {
        node = make(item);
        node.dataset.key = key;
      }
      update(node, item);
      const expected = previous ? previous.nextSibling : container.firstChild;
      if (node !== expected) container.insertBefore(node, expected);
      previous = node;
    }
    for (const node of existing.values()) node.remove();
  }

  // ------------------------------------------------------------------ summary

  function renderSummary(data) {
    let total = 0;
    let held = 0;
    let numGpus = 0;
    for (const node of data.nodes) {
      for (const gpu of node.gpus) {
        numGpus += 1;
        total += gpu.total_bytes;
        for (const o of gpu.occupants) held += o.held_bytes;
      }
    }
    const count = (state) => data.replicas.filter((r) => r.state === state).length;
    const latest = view.points.length ? view.points[view.points.length - 1] : null;
    const totals = [0, 0, 0];
    if (latest) {
      for (const m of Object.values(latest.models)) {
        totals[0] += m[0];
        totals[1] += m[1];
        totals[2] += m[3];
      }
    }
    const tiles = [
      ["nodes", String(data.nodes.filter((n) => n.alive).length)],
      ["GPUs", String(numGpus)],
      ["GPU memory held", total ? percent(held / total) : "–"],
      ["replicas serving", String(count("ready"))],
      ["loading", String(data.replicas.filter((r) => r.phase).length)],
      ["sleeping", String(data.replicas.filter((r) => r.level === "WARM").length)],
      ["models", String(data.models.length)],
      ["requests/s", rate(totals[0])],
      ["tokens/s", rate(totals[1])],
      ["queued", String(totals[2])],
    ];
    reconcile($("#summary"), tiles, (t) => t[0], (t) => {
      const tile = el("div", "tile");
      tile.append(el("div", "value"), el("div", "label", t[0]));
      return tile;
    }, (tile, t) => setText(tile.firstChild, t[1]));
    setText($("#gpu-summary"), numGpus ? `${gib(held)} of ${gib(total)} held on ${numGpus} GPUs` : "no GPU registered");
  }

  // ------------------------------------------------------------------ nodes and GPUs

  function renderNodes(data) {
    reconcile($("#nodes"), data.nodes, (n) => n.node_id, () => {
      const node = el("div", "node");
      const head = el("div", "node-head");
      head.append(el("span", "name"), el("span", "muted info"));
      node.append(head, el("div", "gpus"));
      return node;
    }, (node, n) => {
      node.classList.toggle("down", !n.alive);
      setText(node.querySelector(".name"), n.node_id);
      const info = n.alive
        ? `${n.hostname} · ${n.virtual ? "virtual GPUs" : "NVML"} · RAM ${gib(n.cpu_ram_bytes)} · ` +
          `${n.num_workers} worker${n.num_workers === 1 ? "" : "s"} · heartbeat ${n.heartbeat_age_s.toFixed(0)} s ago`
        : "no heartbeat: node agent gone";
      setText(node.querySelector(".info"), info);
      reconcile(node.querySelector(".gpus"), n.gpus, (g) => g.key, makeGpu, updateGpu);
    });
  }

  function makeGpu() {
    const card = el("div", "gpu");
    const head = el("div", "gpu-head");
    head.append(el("span", "gpu-name"), el("span", "muted gpu-total"));
    const bar = el("div", "bar");
    bar.setAttribute("role", "img");
    card.append(head, bar, el("div", "gpu-foot"));
    return card;
  }

  function updateGpu(card, gpu) {
    const byState = {};
    let held = 0;
    let sleeping = 0;
    for (const o of gpu.occupants) {
      if (o.state === "sleeping") sleeping += 1;
      // held_bytes says what each occupant holds now (a sleeping one: nothing, as Shoal parks it today).
      const state = STATE_ORDER.includes(o.state) ? o.state : "reserved";
      byState[state] = (byState[state] || 0) + o.held_bytes;
      held += o.held_bytes;
    }
    card.dataset.heldBytes = String(held);
    card.classList.toggle("over", held > gpu.total_bytes);
    setText(card.querySelector(".gpu-name"), `GPU ${gpu.index}` + (gpu.name ? " · " + gpu.name : ""));
    setText(card.querySelector(".gpu-total"), gib(gpu.total_bytes));
    const bar = card.querySelector(".bar");
    const segments = STATE_ORDER.filter((s) => byState[s]);
    while (bar.children.length > segments.length) bar.lastChild.remove();
    while (bar.children.length < segments.length) bar.append(el("div", "seg"));
    segments.forEach((state, i) => {
      const seg = bar.children[i];
      seg.className = "seg " + state;
      seg.dataset.state = state;
      seg.style.width = Math.min(100, (100 * byState[state]) / gpu.total_bytes) + "%";
      seg.title = `${state}: ${gib(byState[state])}`;
    });
    const label = `${gpu.key}: ${gib(held)} of ${gib(gpu.total_bytes)} held`;
    bar.setAttribute("aria-label", label);
    const names = gpu.occupants.map((o) => `${o.model} ${o.replica_id.slice(0, 8)} (${o.state}, ${gib(o.num_bytes)})`);
    card.title = [label, ...names].join("\n");
    const active = gpu.occupants.length - sleeping;
    let foot = `${gib(held)} · ${active} replica${active === 1 ? "" : "s"}`;
    if (sleeping) foot += ` · ${sleeping} asleep`;
    setText(card.querySelector(".gpu-foot"), foot);
  }

  // ------------------------------------------------------------------ models

  // A model missing from a point was idle in it (the gateway leaves idle models out).
  const IDLE = [0, 0, null, 0];

  function seriesOf(model, index) {
    return view.points.map((p) => (p.models[model] || IDLE)[index]);
  }

  function metricCell(klass) {
    const td = el("td");
    const box = el("div", "metric " + klass);
    const canvas = el("canvas", "spark");
    canvas.width = 64;
    canvas.height = 20;
    box.append(el("span", "v"), canvas);
    td.append(box);
    return td;
  }

  function makeModelRow(model) {
    const tr = el("tr");
    const name = el("td");
    name.append(el("span", "model-key mono"), el("div", "failing"));
    tr.append(name, el("td", "replicas"), metricCell("queue"), metricCell("rps"), metricCell("ttft"),
      metricCell("tps"));
    const actions = el("td", "admin-only");
    actions.hidden = !view.admin;
    const box = el("div", "actions");
    const replicas = el("input");
    replicas.type = "number";
    replicas.min = "0";
    replicas.title = "desired replicas";
    const scale = el("button", "", "Scale");
    scale.addEventListener("click", () => adminScale(model.key, replicas.value));
    const evict = el("button", "danger", "Evict");
    evict.title = "evict every replica (parked WARM where RAM allows)";
    confirming(evict, () => adminEvict(model.key, null));
    box.append(replicas, scale, evict);
    actions.append(box);
    tr.append(actions);
    return tr;
  }

  function updateModelRow(tr, model, now) {
    tr.dataset.model = model.key;
    const key = tr.querySelector(".model-key");
    setText(key, model.key);
    key.title = model.key;
    const failing = tr.querySelector(".failing");
    setText(failing, model.failing ? "failing: " + model.failing : "");
    let replicas = `${model.num_serving} / ${model.desired_replicas}`;
    if (model.num_loading) replicas += ` +${model.num_loading} loading`;
    if (model.num_sleeping) replicas += ` +${model.num_sleeping} asleep`;
    const cell = tr.querySelector(".replicas");
    setText(cell, replicas);
    cell.title = `${model.num_serving} serving, ${model.num_loading} loading, ${model.num_sleeping} sleeping; ` +
      `${model.desired_replicas} desired`;
    cell.dataset.serving = String(model.num_serving);
    const input = tr.querySelector("input");
    if (document.activeElement !== input) input.value = String(model.desired_replicas);
    const times = view.points.map((p) => p.at);
    const last = (values) => {
      for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null) return values[i];
      return null;
    };
    const series = [
      [".queue", seriesOf(model.key, 3), "#6b7280", (v) => (v === null ? "–" : String(v))],
      [".rps", seriesOf(model.key, 0), "#db7706", rate],
      [".ttft", seriesOf(model.key, 2), "#7c3aed", millis],
      [".tps", seriesOf(model.key, 1), "#2563eb", rate],
    ];
    for (const [klass, values, color, format] of series) {
      const box = tr.querySelector(".metric" + klass);
      const latest = klass === ".ttft" ? last(values) : values.length ? values[values.length - 1] : null;
      setText(box.querySelector(".v"), format(latest));
      ShoalCharts.sparkline(box.querySelector("canvas"), times, values, color, now - view.windowS, now,
        klass !== ".ttft");
    }
  }

  function renderModels(data, now) {
    const filter = $("#model-filter").value.trim().toLowerCase();
    const shown = data.models.filter((m) => !filter || m.key.toLowerCase().includes(filter));
    setText($("#model-count"), `${shown.length} of ${data.models.length}`);
    reconcile($("#models tbody"), shown, (m) => m.key, makeModelRow, (tr, m) => updateModelRow(tr, m, now));
  }

  // ------------------------------------------------------------------ replicas

  function makeReplicaRow(replica) {
    const tr = el("tr");
    tr.append(el("td", "mono model"), el("td", "mono id"), el("td", "mono gpu-list"), el("td", "num bytes"),
      el("td", "level"));
    const state = el("td");
    state.append(el("span", "badge state"), el("span", "phase"));
    const kv = el("td");
    const kvBar = el("span", "kv");
    kvBar.append(el("div"));
    kv.append(kvBar, el("span", "muted kv-text"));
    tr.append(state, el("td", "num load"), kv, el("td", "last"));
    const actions = el("td", "admin-only");
    actions.hidden = !view.admin;
    const evict = el("button", "danger", "Evict");
    confirming(evict, () => adminEvict(replica.model, replica.replica_id));
    actions.append(evict);
    tr.append(actions);
    return tr;
  }

  function updateReplicaRow(tr, r, now) {
    tr.dataset.model = r.model;
    tr.dataset.state = r.state;
    setText(tr.querySelector(".model"), r.model);
    const id = tr.querySelector(".id");
    setText(id, r.replica_id.slice(0, 12));
    id.title = r.replica_id;
    setText(tr.querySelector(".gpu-list"), r.gpus.join(", ") || "–");
    setText(tr.querySelector(".bytes"), r.gpu_bytes ? gib(r.gpu_bytes) : "–");
    setText(tr.querySelector(".level"), r.level);
    const badge = tr.querySelector(".state");
    badge.className = "badge state state-" + r.state;
    setText(badge, r.state);
    setText(tr.querySelector(".phase"), r.phase ? r.phase.replace(/_/g, " ") : "");
    badge.title = r.error || "";
    setText(tr.querySelector(".load"),
      r.requests_running === null ? "–" : `${r.requests_running} / ${r.requests_waiting}`);
    const usage = r.kv_usage;
    tr.querySelector(".kv").hidden = usage === null;
    tr.querySelector(".kv > div").style.width = usage === null ? "0" : Math.round(usage * 100) + "%";
    setText(tr.querySelector(".kv-text"), usage === null ? "–" : " " + Math.round(usage * 100) + "%");
    setText(tr.querySelector(".last"), ago(r.last_access, now));
  }

  function renderReplicas(data, now) {
    const filter = $("#replica-filter").value.trim().toLowerCase();
    const shown = data.replicas.filter((r) => !filter || (r.model + " " + r.replica_id + " " + r.state + " " +
      r.node_id).toLowerCase().includes(filter));
    setText($("#replica-count"), `${shown.length} of ${data.replicas.length}`);
    reconcile($("#replicas tbody"), shown, (r) => r.replica_id, makeReplicaRow, (tr, r) => updateReplicaRow(tr, r, now));
  }

  // ------------------------------------------------------------------ admin actions

  // A destructive button asks for a second click within 3 s instead of a dialog.
  function confirming(button, action) {
    let timer = null;
    const label = button.textContent;
    button.addEventListener("click", () => {
      if (!button.classList.contains("confirming")) {
        button.classList.add("confirming");
        button.textContent = "Sure?";
        timer = setTimeout(() => {
          button.classList.remove("confirming");
          button.textContent = label;
        }, 3000);
        return;
      }
      clearTimeout(timer);
      button.classList.remove("confirming");
      button.textContent = label;
      action();
    });
  }

  async function admin(method, path, body) {
    try {
      const response = await fetch(path, {
        method,
        headers: headers({ "Content-Type": "application/json" }),
        body: body === undefined ? undefined : JSON.stringify(body),
      });
      const payload = await response.json().catch(() => ({}));
      if (!response.ok || payload.ok === false) {
        const message = (payload.error && payload.error.message) || payload.message || response.statusText;
        toast(`${method} ${path}: ${message}`, true);
        return false;
      }
      toast(`${method} ${path}: ${payload.status || "ok"}${payload.message ? " — " + payload.message : ""}`);
      schedulePoll(0);
      return true;
    } catch (error) {
      toast(`${method} ${path}: ${error}`, true);
      return false;
    }
  }

  function adminScale(model, replicas) {
    const count = Number(replicas);
    if (!Number.isInteger(count) || count < 0) {
      toast("replicas must be a whole number, 0 or more", true);
      return;
    }
    admin("POST", `/admin/models/${modelPath(model)}/scale`, { replicas: count });
  }

  function adminEvict(model, replicaId) {
    admin("POST", `/admin/models/${modelPath(model)}/evict`, replicaId ? { replica_id: replicaId } : {});
  }

  async function adminRegister(form) {
    const body = { key: form.key.value.trim(), path: form.path.value.trim() };
    if (form.extra.value.trim()) {
      let extra;
      try {
        extra = JSON.parse(form.extra.value);
      } catch (error) {
        toast("more settings must be a JSON object: " + error.message, true);
        return;
      }
      if (typeof extra !== "object" || extra === null || Array.isArray(extra)) {
        toast("more settings must be a JSON object", true);
        return;
      }
      Object.assign(body, extra);
    }
    if (await admin("POST", "/admin/models", body)) form.reset();
  }

  function setAdmin(isAdmin) {
    view.admin = isAdmin;
    $("#admin-badge").hidden = !isAdmin;
    for (const node of document.querySelectorAll(".admin-only")) node.hidden = !isAdmin;
  }

  // ------------------------------------------------------------------ polling

  function mergeHistory(points, windowS, now) {
    view.windowS = windowS;
    for (const p of points) {
      if (view.lastAt === null || p.at > view.lastAt) {
        view.points.push(p);
        view.lastAt = p.at;
      }
    }
    const cutoff = now - windowS;
    let drop = 0;
    while (drop < view.points.length && view.points[drop].at < cutoff) drop++;
    if (drop) view.points.splice(0, drop);
  }

  function render(data) {
    const now = data.at;
    for (const node of document.querySelectorAll(".window-min")) setText(node, String(Math.round(view.windowS / 60)));
    setText($("#gateway"), "gateway " + data.gateway_id);
    renderSummary(data);
    drawThroughput(now);
    renderNodes(data);
    renderModels(data, now);
    renderReplicas(data, now);
    document.body.dataset.renderedAt = String(now);
  }

  let pollTimer = null;
  function schedulePoll(delayMs) {
    clearTimeout(pollTimer);
    pollTimer = setTimeout(poll, delayMs);
  }

  async function poll() {
    try {
      const query = view.lastAt === null ? "" : "?since=" + view.lastAt;
      const response = await fetch("/ui/api/state" + query, { headers: headers(), cache: "no-store" });
      if (response.status === 401 || response.status === 403) {
        setStatus("locked", "needs a key");
        showBanner(view.key
          ? "This key is not accepted here. Paste an API key of this gateway above (kept in this tab only)."
          : "This gateway wants an API key: paste one above (kept in this tab only, sent as a Bearer header).");
        return;
      }
      if (!response.ok) throw new Error(response.status + " " + response.statusText);
      const data = await response.json();
      showBanner("");
      if (data.admin !== view.admin) setAdmin(data.admin);
      mergeHistory(data.history, data.history_window_s, data.at);
      view.latest = data;
      render(data);
      setStatus("live", "live · " + clock(data.at));
    } catch (error) {
      setStatus("offline", "offline: " + error.message);
    } finally {
      schedulePoll(POLL_MS);
    }
  }

  // ------------------------------------------------------------------ events

  function describeEvent(event) {
    const parts = [];
    if (event.model) parts.push(event.model);
    if (event.replica_id) parts.push(event.replica_id.slice(0, 8));
    if (event.node_id) parts.push("on " + event.node_id);
    if (event.message) parts.push("— " + event.message);
    return parts.join(" ");
  }

  function addEvent(event) {
    const list = $("#events");
    const item = el("li");
    item.dataset.kind = event.kind;
    item.append(el("span", "when", clock(event.at)), el("span", "badge ev-" + event.kind, event.kind.replace(/_/g, " ")),
      el("span", "what", describeEvent(event)));
    list.insertBefore(item, list.firstChild);
    while (list.children.length > MAX_EVENTS) list.lastChild.remove();
  }

  // ------------------------------------------------------------------ start

  function useKey(key) {
    view.key = key;
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    $("#key").value = "";
    $("#key").placeholder = key ? "key set (kept in this tab)" : "Bearer key (kept in this tab)";
    if (view.reconnectEvents) view.reconnectEvents();
    schedulePoll(0);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("#key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      useKey($("#key").value.trim());
    });
    $("#forget-key").addEventListener("click", () => useKey(""));
    $("#register").addEventListener("submit", (e) => {
      e.preventDefault();
      adminRegister(e.target);
    });
    for (const id of ["#model-filter", "#replica-filter"]) {
      $(id).addEventListener("input", () => view.latest && render(view.latest));
    }
    window.addEventListener("resize", () => view.latest && render(view.latest));
    $("#key").placeholder = view.key ? "key set (kept in this tab)" : "Bearer key (kept in this tab)";
    poll();
    view.reconnectEvents = ShoalEvents.follow({
      headers,
      onEvent: (_, event) => addEvent(event),
      onStatus: (text) => setText($("#events-status"), text),
    });
  });
})();
