// tidegate console: reads /console/api/* with the admin key from sessionStorage.
// Every value from the server goes into the page as text (textContent), never as
// HTML: tenant and user names are other people's input.
"use strict";
(() => {
  const KEY = "tidegate-console-key";
  const COLORS = ["#0b6e99", "#d9480f", "#2f9e44", "#7048e8", "#c2255c", "#e67700", "#1098ad"];
  const $ = (id) => document.getElementById(id);
  let live = null, usage = null;

  class ApiError extends Error {
    constructor(status, message) { super(message); this.status = status; }
  }

  async function api(path, body) {
    const init = {headers: {"Authorization": "Bearer " + sessionStorage.getItem(KEY)}};
    if (body !== undefined) {
      init.method = "POST";
      init.headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const resp = await fetch("/console/api/" + path, init);
    const data = await resp.json();
    if (!resp.ok) throw new ApiError(resp.status, (data.error && data.error.message) || resp.statusText);
    return data;
  }

  function cell(row, value, cls, field) {
    const td = document.createElement("td");
    td.textContent = value === null || value === undefined ? "-" : String(value);
    if (cls) td.className = cls;
    if (field) td.dataset.field = field;
    row.appendChild(td);
    return td;
  }

  function fill(id, rows, empty) {
    const body = $(id).tBodies[0];
    body.replaceChildren();
    if (!rows.length) {
      const tr = body.insertRow();
      const td = cell(tr, empty || "none", "empty");
      td.colSpan = $(id).tHead.rows[0].cells.length;
      return;
    }
    for (const build of rows) {
      const tr = body.insertRow();
      build(tr);
    }
  }

  const ms = (v) => v === null || v === undefined ? "-" : `${Math.round(v)} ms`;
  const age = (s) => s < 120 ? `${Math.round(s)}s` : s < 7200 ? `${Math.round(s / 60)}m` : `${(s / 3600).toFixed(1)}h`;
  // As `tidegate status` (fleet.run.status_view.held): "5 (i3 bg2)".
  const held = (qm) => {
    if (!qm) return "-";
    const short = { interactive: "i", background: "bg", batch: "b" };
    const parts = Object.entries(qm.queued_by_class || {}).filter(([, n]) => n > 0);
    if (!qm.queued || parts.every(([k]) => k === "interactive")) return String(qm.queued);
    return `${qm.queued} (${parts.map(([k, n]) => `${short[k] || k}${n}`).join(" ")})`;
  };
  const when = (t) => t ? new Date(t * 1000).toISOString().replace(".000", "").replace("T", " ") : "never";

  function button(row, label, action) {
    const td = document.createElement("td");
    const b = document.createElement("button");
    b.type = "button"; b.className = "small"; b.textContent = label;
    b.addEventListener("click", action);
    td.appendChild(b); row.appendChild(td);
    return b;
  }

  // ---- live ---------------------------------------------------------------

  function renderLive(view) {
    const doc = view.status;
    $("banner").hidden = !view.stale;
    $("banner").textContent = view.stale ? `Live numbers are stale: ${view.error}` : "";
    if (!doc) { $("taken").textContent = "waiting for the first sample"; return; }
    $("taken").textContent = `taken ${new Date(doc.taken * 1000).toLocaleTimeString()}, every ${view.interval}s`;
    $("requests-rate").textContent = doc.requests_per_s ?? "-";
    $("backlog").textContent = doc.dispatch_backlog;
    $("worker-count").textContent = doc.workers.length;
    const edges = doc.edges && doc.edges.edges ? doc.edges.edges : [];
    $("edge-count").textContent = edges.length;
    $("batch-count").textContent = doc.batches.length;
    fill("models", doc.models.map((m) => (tr) => {
      tr.dataset.model = m.model;
      const qm = m.queue_mode;
      cell(tr, m.model, "", "model");
      cell(tr, qm ? qm.mode : "?", qm && qm.mode === "queue" ? "mode-queue" : "", "mode");
      // As `tidegate status`: the queue-mode limit only while queueing; the
      // adaptive limit is the slots of workers with max_streams = "auto".
      cell(tr, qm && qm.mode === "queue" ? qm.limit : "-", "num", "queue_limit");
      cell(tr, m.adaptive ? m.slots.total : "-", "num", "adaptive_limit");
      cell(tr, m.workers, "num", "workers");
      cell(tr, m.slots.total, "num", "slots");
      cell(tr, m.slots.used, "num", "in_flight");
      cell(tr, m.queue.depth, "num", "depth");
      cell(tr, m.queue.waiting, "num", "waiting");
      // Queue mode's held requests, per class that has any (tidegate.wire.classes).
      cell(tr, held(qm), "", "held");
      cell(tr, age(m.queue.oldest_age_s), "num", "oldest");
      cell(tr, ms(m.live.ttft_p50_ms), "num", "ttft_p50");
      cell(tr, ms(m.live.ttft_p99_ms), "num", "ttft_p99");
      cell(tr, m.live.tokens_per_s, "num", "tokens_per_s");
      cell(tr, m.rates ? m.rates.started_per_s : "-", "num", "started");
      cell(tr, m.rates ? m.rates.finished_per_s : "-", "num", "finished");
    }), "no models");
    fill("workers", doc.workers.map((w) => (tr) => {
      tr.dataset.worker = w.worker_id;
      cell(tr, w.worker_id, "", "worker_id");
      cell(tr, w.host); cell(tr, w.pid, "num");
      cell(tr, Object.entries(w.models).map(([m, s]) => `${m} ${s.in_flight}/${s.slots}`).join(", "), "", "load");
      cell(tr, age(w.uptime_s), "num"); cell(tr, age(w.heartbeat_age_s) + " ago", "num");
      cell(tr, w.draining ? "draining" : "serving");
    }), "no live workers");
    fill("edges", edges.map((e) => (tr) => {
      tr.dataset.edge = e.edge_id;
      cell(tr, e.edge_id, "", "edge_id"); cell(tr, e.host); cell(tr, e.pid, "num");
      cell(tr, e.streams, "num", "streams"); cell(tr, e.ws_connections, "num", "ws");
      cell(tr, age(e.heartbeat_age_s) + " ago", "num"); cell(tr, e.draining ? "draining" : "serving");
    }), "no edges registered");
    const replicas = [];
    for (const m of doc.models) for (const r of m.replicas) replicas.push([m.model, r]);
    fill("replicas", replicas.map(([model, r]) => (tr) => {
      cell(tr, model); cell(tr, r.replica); cell(tr, r.workers, "num"); cell(tr, r.in_flight, "num");
      cell(tr, r.slots, "num"); cell(tr, r.jobs, "num");
      cell(tr, r.hit_rate === null ? "-" : `${r.hits} (${Math.round(r.hit_rate * 100)}%)`, "num");
    }), "no model with several replicas");
    fill("active-batches", doc.batches.map((b) => (tr) => {
      cell(tr, b.id); cell(tr, b.tenant); cell(tr, b.status);
      cell(tr, `${b.completed + b.failed} / ${b.total}`, "num"); cell(tr, b.failed, "num");
      cell(tr, age(b.expires_in_s), "num");
    }), "no batch in progress");
    const models = doc.models.map((m) => m.model);
    chart("chart-depth", view.history, models, (p) => p.depth);
    chart("chart-ttft", view.history, models, (p) => p.ttft_p50_ms);
    chart("chart-tps", view.history, models, (p) => p.tokens_per_s);
    const legend = $("legend");
    legend.replaceChildren();
    models.forEach((m, i) => {
      const s = document.createElement("span");
      const dot = document.createElement("i");
      dot.style.background = COLORS[i % COLORS.length];
      s.append(dot, m);
      legend.appendChild(s);
    });
  }

  function svg(tag, attrs) {
    const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
    return el;
  }

  function chart(id, history, models, pick) {
    const el = $(id);
    el.replaceChildren();
    const W = 400, H = 140, L = 34, B = 14, now = Date.now() / 1000;
    // The axis spans the samples kept (at most 15 minutes), at least one minute.
    const first = history.length ? history[0].t : now;
    const span = Math.min(900, Math.max(60, now - first));
    let max = 0;
    for (const p of history) for (const m of models) {
      const v = p.models[m] ? pick(p.models[m]) : null;
      if (typeof v === "number") max = Math.max(max, v);
    }
    max = max > 0 ? max * 1.1 : 1;
    el.appendChild(svg("line", {x1: L, y1: H - B, x2: W, y2: H - B, class: "axis"}));
    el.appendChild(svg("line", {x1: L, y1: 0, x2: L, y2: H - B, class: "axis"}));
    const top = svg("text", {x: 2, y: 10}); top.textContent = max >= 10 ? Math.round(max) : max.toFixed(1);
    const zero = svg("text", {x: 2, y: H - B}); zero.textContent = "0";
    const left = svg("text", {x: L, y: H - 2});
    left.textContent = span >= 120 ? `-${Math.round(span / 60)} min` : `-${Math.round(span)} s`;
    const right = svg("text", {x: W - 20, y: H - 2}); right.textContent = "now";
    el.append(top, zero, left, right);
    models.forEach((m, i) => {
      const pts = [];
      for (const p of history) {
        const v = p.models[m] ? pick(p.models[m]) : null;
        if (typeof v !== "number") continue;
        const x = L + (W - L) * Math.max(0, 1 - (now - p.t) / span);
        const y = (H - B) - (H - B - 4) * (v / max);
        pts.push(`${x.toFixed(1)},${y.toFixed(1)}`);
      }
      if (pts.length) el.appendChild(svg("polyline", {points: pts.join(" "), stroke: COLORS[i % COLORS.length]}));
    });
  }

  // ---- usage --------------------------------------------------------------

  function renderUsage(rep) {
    const t = rep.total;
    $("usage-total").textContent = `${t.requests} requests, ${t.prompt_tokens + t.completion_tokens} tokens (${rep.records} usage records read)`;
    const nums = (tr, r) => { cell(tr, r.requests, "num", "requests"); cell(tr, r.prompt_tokens, "num", "prompt_tokens");
      cell(tr, r.completion_tokens, "num", "completion_tokens"); cell(tr, r.errors, "num", "errors"); };
    fill("usage-tenant", rep.by_tenant.map((r) => (tr) => { tr.dataset.tenant = r.tenant; cell(tr, r.tenant, "", "tenant"); nums(tr, r); }), "no requests");
    fill("usage-key", rep.by_key.map((r) => (tr) => { tr.dataset.key = r.key_id; cell(tr, r.key_id, "", "key"); cell(tr, r.tenant, "", "tenant"); nums(tr, r); }), "no requests");
    fill("usage-model", rep.by_model.map((r) => (tr) => { tr.dataset.model = r.model; cell(tr, r.model, "", "model"); nums(tr, r); }), "no requests");
  }

  // ---- admin --------------------------------------------------------------

  function said(text, bad) {
    const p = $("admin-result");
    p.textContent = text;
    p.className = bad ? "error" : "result";
  }

  async function act(path, body, done) {
    try {
      const out = await api(path, body);
      if (done) done(out);
      await loadAdmin();
    } catch (e) {
      said(e.message, true);
      if (e.status === 401 || e.status === 403) signOut(e.message);
    }
  }

  async function loadAdmin() {
    const [keys, policies, tenants, batches] = await Promise.all(
      [api("keys"), api("policies"), api("tenants"), api("batches")]);
    fill("keys", keys.data.map((k) => (tr) => {
      tr.dataset.key = k.key_id;
      cell(tr, k.key_id, "", "key_id"); cell(tr, k.tenant); cell(tr, k.user || "-");
      cell(tr, k.models.join(",") || "all"); cell(tr, k.admin ? "yes" : "no");
      cell(tr, when(k.created)); cell(tr, when(k.expires)); cell(tr, when(k.last_used));
      button(tr, "Revoke", () => act("keys/revoke", {key_id: k.key_id},
        () => said(`revoked key ${k.key_id}`))).dataset.revoke = k.key_id;
    }), "no keys");
    fill("policies", policies.data.map((p) => (tr) => {
      cell(tr, p.tenant || "*"); cell(tr, p.model || "*"); cell(tr, p.user || "*");
      cell(tr, p.rpm || "-", "num"); cell(tr, p.tpm || "-", "num"); cell(tr, p.concurrency || "-", "num");
      button(tr, "Delete", () => act("policies/delete", {tenant: p.tenant, model: p.model, user: p.user},
        () => said("deleted the policy")));
    }), "no policies");
    fill("tenants", tenants.data.map((t) => (tr) => {
      cell(tr, t.tenant); cell(tr, t.resumable ? "on" : "off"); cell(tr, t.grace === null ? "default" : `${t.grace}s`);
      cell(tr, t.tier || "-");
      button(tr, "Delete", () => act("tenants/delete", {tenant: t.tenant}, () => said(`deleted tenant ${t.tenant}`)));
    }), "no tenant settings");
    fill("batches", batches.data.map((b) => (tr) => {
      cell(tr, b.id); cell(tr, b.tenant); cell(tr, b.status);
      cell(tr, `${b.completed + b.failed} / ${b.total}`, "num"); cell(tr, b.failed, "num"); cell(tr, when(b.created_at));
      if (["validating", "in_progress", "finalizing"].includes(b.status)) {
        button(tr, "Cancel", () => act("batches/cancel", {batch_id: b.id}, (o) => said(`batch ${o.id}: ${o.status}`)));
      } else cell(tr, "");
    }), "no batches");
  }

  function number(value, name) {
    if (value.trim() === "") return undefined;
    const n = Number(value);
    return Number.isFinite(n) ? n : value;  // the server says what is wrong with it
  }

  function forms() {
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const f = ev.target;
      const body = {tenant: f.tenant.value, user: f.user.value, admin: f.admin.checked,
        models: f.models.value.split(",").map((s) => s.trim()).filter((s) => s)};
      const exp = number(f.expires_in.value);
      if (exp !== undefined) body.expires_in = exp;
      act("keys", body, (out) => {
        $("new-key").hidden = false;
        $("new-key-value").textContent = out.key;
        said(`created key ${out.key_id} for tenant ${out.tenant}`);
        f.reset();
      });
    });
    $("policy-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const f = ev.target;
      const body = {tenant: f.tenant.value, model: f.model.value, user: f.user.value};
      for (const n of ["rpm", "tpm", "concurrency"]) {
        const v = number(f[n].value);
        if (v !== undefined) body[n] = v;
      }
      act("policies", body, () => said("set the policy"));
    });
    $("tenant-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const f = ev.target;
      const body = {tenant: f.tenant.value, resumable: f.resumable.checked};
      const g = number(f.grace.value);
      if (g !== undefined) body.grace = g;
      if (f.tier.value) body.tier = f.tier.value;
      act("tenants", body, () => said(`set tenant ${body.tenant}`));
    });
    $("usage-window").addEventListener("change", () => refreshUsage());
  }

  // ---- loop ---------------------------------------------------------------

  async function refreshLive() {
    try { renderLive(await api("status")); }
    catch (e) { if (e.status === 401 || e.status === 403) signOut(e.message); else { $("banner").hidden = false; $("banner").textContent = `console unreachable: ${e.message}`; } }
  }

  async function refreshUsage() {
    try { renderUsage(await api("usage?window=" + $("usage-window").value)); }
    catch (e) { if (e.status === 401 || e.status === 403) signOut(e.message); }
  }

  function signOut(message) {
    sessionStorage.removeItem(KEY);
    clearInterval(live); clearInterval(usage);
    $("main").hidden = true; $("signin").hidden = false; $("signout").hidden = true;
    $("who").textContent = "";
    $("signin-error").textContent = message || "";
    document.body.dataset.state = "signed-out";
  }

  async function signIn() {
    try {
      const me = await api("whoami");
      $("who").textContent = `admin key ${me.key_id}`;
    } catch (e) {
      signOut(e.message);
      return;
    }
    $("signin").hidden = true; $("main").hidden = false; $("signout").hidden = false;
    await Promise.all([refreshLive(), refreshUsage(), loadAdmin().catch((e) => said(e.message, true))]);
    live = setInterval(refreshLive, 2000);
    usage = setInterval(refreshUsage, 5000);
    document.body.dataset.state = "signed-in";
  }

  document.addEventListener("DOMContentLoaded", () => {
    forms();
    $("signin-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(KEY, $("signin-key").value.trim());
      $("signin-key").value = "";
      signIn();
    });
    $("signout").addEventListener("click", () => signOut(""));
    if (sessionStorage.getItem(KEY)) signIn(); else signOut("");
  });
})();
