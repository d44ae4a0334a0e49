// polar-mitm view: the little script the pages need. Token hovers (trajectory and turn pages)
// and the live page's event stream. Everything shown came from an untrusted harness: text goes
// in with textContent, never as markup.
"use strict";

(function () {
  const dataEl = document.getElementById("data");
  const data = dataEl ? JSON.parse(dataEl.textContent) : null;

  function el(name, cls, text) {
    const e = document.createElement(name);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  // --- tokens -----------------------------------------------------------------------------
  const tokens = document.getElementById("tokens");
  const tip = document.getElementById("tip");
  if (tokens && tip && data && data.ids) {
    const KIND = { p: "prompt", c: "context", s: "trained", y: "sampled, trained in another row" };
    function kindOf(span) {
      for (const k of Object.keys(KIND)) if (span.classList.contains(k)) return KIND[k];
      return "";
    }
    function show(span, x, y) {
      const i = Number(span.dataset.i);
      const at = data.start + i;
      const t = data.turn[i];
      const turn = t >= 0 ? data.turns[t] : null;
      const lp = data.lp[i];
      tip.replaceChildren();
      const line = (label, value, cls) => {
        const row = el("div", cls);
        row.append(el("b", null, label + " "), el("span", null, value));
        tip.append(row);
      };
      line("token", "#" + at + " · id " + data.ids[i], "tip-id");
      if (data.text) line("text", JSON.stringify(span.textContent), "tip-text");
      line("kind", kindOf(span));
      if (data.trained[i]) line("logprob", lp + "  (p = " + Math.exp(lp).toFixed(4) + ")", "tip-lp");
      if (turn) {
        line("turn", turn.n + " · " + turn.id + (turn.tag ? " · " + turn.tag : ""));
        line("weights", turn.wv || "-");
      }
      tip.dataset.index = String(at);
      tip.dataset.id = String(data.ids[i]);
      tip.dataset.logprob = data.trained[i] ? String(lp) : "";
      tip.dataset.turn = turn ? turn.id : "";
      tip.hidden = false;
      const r = tip.getBoundingClientRect();
      tip.style.left = Math.min(x + 12, window.innerWidth - r.width - 8) + "px";
      tip.style.top = Math.min(y + 14, window.innerHeight - r.height - 8) + "px";
    }
    tokens.addEventListener("mouseover", (ev) => {
      const span = ev.target.closest("span.t");
      if (span && tokens.contains(span)) show(span, ev.clientX, ev.clientY);
    });
    tokens.addEventListener("mouseleave", () => { tip.hidden = true; });
    const m = /^#tok(\d+)$/.exec(location.hash);
    if (m) {
      const span = tokens.querySelector('span.t[data-i="' + (Number(m[1]) - data.start) + '"]');
      if (span) { span.classList.add("target"); span.scrollIntoView({ block: "center" }); }
    }
  }

  // --- live -------------------------------------------------------------------------------
  const tasksEl = document.getElementById("tasks");
  if (tasksEl && data && window.EventSource) {
    const stateEl = document.getElementById("live-state");
    const nodesEl = document.getElementById("nodes");
    const eventsEl = document.getElementById("events");
    const weightsEl = document.getElementById("weights");
    const tasks = new Map((data.tasks || []).map((t) => [t.task_id, t]));
    let nodes = data.nodes || [];
    let weights = { paused: null, version: null };

    function renderTask(t) {
      const box = el("section", "task");
      box.dataset.task = t.task_id;
      box.append(el("h3", null, t.task_id + " · " + t.state + " · " + t.harness + " on " + t.runtime));
      const table = el("table", "grid");
      const head = el("tr");
      for (const h of ["sample", "state", "stage", "status", "reward", "node", "cause"]) head.append(el("th", null, h));
      table.append(head);
      for (const s of t.samples) {
        const tr = el("tr", "sample " + (s.status || s.state));
        tr.dataset.index = String(s.index);
        tr.dataset.state = s.state;
        tr.dataset.status = s.status || "";
        for (const v of [s.index, s.state, s.stage || "-", s.status || "-", s.reward === null || s.reward === undefined ? "-" : s.reward, s.node_id || "-", s.cause || ""]) {
          tr.append(el("td", null, v));
        }
        table.append(tr);
      }
      box.append(table);
      return box;
    }
    function renderTasks() {
      const list = [...tasks.values()].sort((a, b) => b.created_at - a.created_at);
      tasksEl.replaceChildren(...(list.length ? list.map(renderTask) : [el("p", "muted", "no task yet")]));
    }
    function renderNodes() {
      const table = el("table", "grid");
      const head = el("tr");
      for (const h of ["node", "state", "healthy", "dispatched", "generating", "paused", "stages (queued / in flight)"]) head.append(el("th", null, h));
      table.append(head);
      for (const n of nodes) {
        const tr = el("tr");
        const load = n.load || {};
        const stages = Object.entries(load.stages || {}).map(([k, v]) => k + " " + v.queued + "/" + v.in_flight).join(", ");
        for (const v of [n.node_id, n.state, n.healthy ? "yes" : "no", n.dispatched, load.generating ?? "-", load.paused ? "yes" : "no", stages || "-"]) tr.append(el("td", null, v));
        table.append(tr);
      }
      nodesEl.replaceChildren(nodes.length ? table : el("p", "muted", "no node registered"));
      const paused = nodes.some((n) => n.load && n.load.paused);
      if (weights.paused === null) weights.paused = paused;
      renderWeights();
    }
    function renderWeights() {
      weightsEl.textContent = "generation " + (weights.paused ? "paused" : "running") + " · weight version " + (weights.version || "-");
      weightsEl.className = "weights " + (weights.paused ? "paused" : "running");
    }
    function applyEvent(ev) {
      const li = el("li", null, new Date((ev.at || Date.now() / 1000) * 1000).toLocaleTimeString() + "  " + ev.kind + " " + (ev.task_id || "") + (ev.index !== null && ev.index !== undefined ? "#" + ev.index : "") + " " + (ev.state || "") + (ev.data && Object.keys(ev.data).length ? " " + JSON.stringify(ev.data) : ""));
      eventsEl.prepend(li);
      while (eventsEl.children.length > 200) eventsEl.lastChild.remove();
      if (ev.kind === "weights") {
        weights.paused = ev.state === "paused";
        if (ev.data && ev.data.weight_version) weights.version = ev.data.weight_version;
        renderWeights();
      }
      const t = ev.task_id && tasks.get(ev.task_id);
      if (!t) return;
      if (ev.kind === "task" && ev.state) t.state = ev.state;
      if (ev.kind === "sample" && ev.index !== null) {
        const s = t.samples.find((x) => x.index === ev.index);
        if (s) {
          s.state = ev.state === "dispatched" ? "dispatched" : ev.state;
          if (ev.data && ev.data.status) s.status = ev.data.status;
          if (ev.data && ev.data.reward !== undefined) s.reward = ev.data.reward;
          if (ev.data && ev.data.node_id) s.node_id = ev.data.node_id;
        }
      }
      renderTasks();
    }
    renderTasks();
    renderNodes();
    const source = new EventSource("/live/events");
    source.onopen = () => { stateEl.textContent = "live"; };
    source.onerror = () => { stateEl.textContent = "reconnecting…"; };
    source.addEventListener("status", (m) => {
      const s = JSON.parse(m.data);
      stateEl.textContent = s.connected ? "live" : "service unreachable: " + (s.error || "");
    });
    source.addEventListener("event", (m) => {
      const ev = JSON.parse(m.data);
      if (ev.kind === "task" && !tasks.has(ev.task_id)) tasks.set(ev.task_id, { task_id: ev.task_id, state: ev.state, harness: "", runtime: "", created_at: ev.at, samples: [] });
      applyEvent(ev);
    });
    source.addEventListener("task", (m) => { const t = JSON.parse(m.data); tasks.set(t.task_id, t); renderTasks(); });
    source.addEventListener("nodes", (m) => { nodes = JSON.parse(m.data).items || []; renderNodes(); });
  }

  window.__viewReady = true;
})();
