// Partita plan report: draws the JSON that partitioner/report/data.py wrote into the page.
// Every number and text comes from Python; this script lays out tables, bars and SVG and
// wires the filter, the sorting, the folding and the node details. No network, no libraries.
"use strict";

const DATA = JSON.parse(document.getElementById("plan-data").textContent);
const ROLE_COLOURS = { data: "#2f7ed8", tensor: "#d9822b", sequence: "#8e44ad", pipeline: "#16a085", expert: "#c0392b", replicated: "#7f8c8d", "-": "#aaa" };
const SPLIT_COLOURS = { compute_s: "#4c8bd6", comm_s: "#d9534f", optimizer_s: "#f0ad4e", bubble_s: "#b8c2cc" };
const SPLIT_NAMES = { compute_s: "compute", comm_s: "exposed communication", optimizer_s: "optimizer step", bubble_s: "bubble (idle)" };
const MEMORY_COLOURS = ["#4c8bd6", "#7fb3e6", "#f0ad4e", "#9b8ad0", "#5cb85c", "#2e9e8f", "#e37d6f", "#c8ccd2", "#b5a06b"];
const ACTION_COLOURS = { F: "#6fa8dc", B: "#93c47d", I: "#b6d7a8", W: "#ffd966", "gradient sync + optimizer step": "#e69f7a" };
const SHORT = { all_reduce: "AR", all_gather: "AG", reduce_scatter: "RS", all_to_all: "A2A" };

function esc(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;");
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k === "style") node.style.cssText = v;
    else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return node;
}

function fmtSeconds(s) {
  if (s >= 1) return s.toFixed(3) + " s";
  if (s >= 1e-3) return (s * 1e3).toFixed(3) + " ms";
  return (s * 1e6).toFixed(1) + " us";
}

function swatch(colour) {
  return el("span", { class: "swatch", style: "background:" + colour });
}

function legend(items) {
  const box = el("div", { class: "legend" });
  for (const [label, colour] of items) box.appendChild(el("span", { class: "item" }, swatch(colour), label));
  return box;
}

function stackedBar(parts, total) {
  const bar = el("div", { class: "bar" });
  for (const [label, value, colour, text] of parts) {
    if (value <= 0 || total <= 0) continue;
    bar.appendChild(el("span", { style: `width:${(100 * value) / total}%;background:${colour}`, title: `${label}: ${text}` }));
  }
  return bar;
}

// -- tabs --------------------------------------------------------------------------------------

function showTab(name) {
  for (const b of document.querySelectorAll("nav button")) b.classList.toggle("active", b.dataset.tab === name);
  for (const s of document.querySelectorAll("section.tab")) s.classList.toggle("active", s.id === "tab-" + name);
}

function buildTabs() {
  const tabs = [["overview", "Overview"], ["table", "Plan table"], ["graph", "Graph"]];
  if (DATA.timeline) tabs.push(["timeline", "Pipeline timeline"]);
  if (DATA.diff) tabs.push(["diff", "Diff"]);
  const nav = document.getElementById("tabs");
  for (const [name, title] of tabs) {
    const button = el("button", { "data-tab": name, id: "tab-button-" + name, text: title });
    button.addEventListener("click", () => showTab(name));
    nav.appendChild(button);
  }
  showTab("overview");
}

// -- overview ----------------------------------------------------------------------------------

function buildHeader() {
  const h = DATA.header;
  document.title = `Partita plan: ${h.model}`;
  document.getElementById("title").textContent = `Partita plan: ${h.model}`;
  const inputs = Object.entries(h.inputs).map(([k, v]) => `${k} ${v}`).join(", ");
  const mesh = DATA.axes.map((a) => `${a.name}=${a.size}`).join(" x ");
  document.getElementById("meta").textContent =
    `mesh ${mesh} | cluster ${h.cluster} | precision ${h.precision} | budget ${h.budget} | ` +
    `objective ${h.objective} | optimizer ${h.optimizer} | inputs ${inputs || "-"} | fingerprint ${h.fingerprint || "-"}`;
}

function configCard() {
  const card = el("div", { class: "card", id: "config" }, el("h2", { text: "Configuration" }));
  if (DATA.config) card.appendChild(el("p", { text: DATA.config }));
  const table = el("table", {}, el("tr", {}, el("th", { text: "mesh axis" }), el("th", { class: "num", text: "devices" }), el("th", { text: "role" }), el("th", { text: "what its matmuls do there" })));
  for (const axis of DATA.axes) {
    const shares = axis.shares.map(([role, share]) => [role, share, ROLE_COLOURS[role] || "#999", `${(100 * share).toFixed(0)}%`]);
    const cell = el("td", {}, stackedBar(shares, 1), legend(shares.map(([role, , colour, text]) => [`${role} ${text}`, colour])));
    table.appendChild(el("tr", { class: "axis-row" }, el("td", { class: "mono", text: axis.name }), el("td", { class: "num", text: String(axis.size) }),
      el("td", {}, el("span", { class: "role", style: "background:" + (ROLE_COLOURS[axis.role] || "#999"), text: axis.role })), cell));
  }
  card.appendChild(table);
  card.appendChild(el("p", { class: "muted", text: "Roles are read off the plan: per axis, its matmuls by compute time, data (batch split), tensor (output features split or partial sums), sequence (another dim, ring/Ulysses attention), replicated; a pipeline's first axis is its stages." }));
  return card;
}

function estimateCard() {
  const e = DATA.estimate;
  const card = el("div", { class: "card", id: "estimate" }, el("h2", { text: "Estimate per training step" }));
  card.appendChild(el("div", {}, el("span", { class: "big", text: e.step }), el("span", { class: "muted", text: `  step time on ${e.where}` })));
  const parts = Object.entries(e.split).map(([k, v]) => [SPLIT_NAMES[k], v, SPLIT_COLOURS[k], e.split_text[k]]);
  const total = parts.reduce((s, p) => s + p[1], 0);
  card.appendChild(stackedBar(parts, total));
  card.appendChild(legend(parts.map(([name, , colour, text]) => [`${name} ${text}`, colour])));
  const facts = el("table", { style: "margin-top:10px" });
  const row = (k, v) => facts.appendChild(el("tr", {}, el("td", { class: "muted", text: k }), el("td", { text: v })));
  row("MFU", e.tflops ? `${(100 * e.mfu).toFixed(1)}% (${e.tflops.toFixed(1)} TFLOP/s per device)` : "-");
  row("peak memory per device", e.memory);
  for (const [kind, axis, bytes, calls] of e.comm) row(`${kind} on ${axis}`, `${bytes} per device per step` + (calls ? `, ${calls} call${calls === 1 ? "" : "s"}` : ""));
  if (!e.comm.length) row("communication", "none");
  card.appendChild(facts);
  return card;
}

function memoryCard() {
  const m = DATA.memory;
  const card = el("div", { class: "card", id: "memory" }, el("h2", { text: "Memory per device at its peak" }));
  const top = Math.max(...m.bars.map((b) => b.peak), 1);
  const kinds = [];
  for (const bar of m.bars) for (const [k] of bar.parts) if (!kinds.includes(k)) kinds.push(k);
  const colour = (k) => MEMORY_COLOURS[kinds.indexOf(k) % MEMORY_COLOURS.length];
  const table = el("table", {});
  for (const bar of m.bars) {
    const parts = bar.parts.map(([k, v, text]) => [k, v, colour(k), text]);
    const fill = stackedBar(parts, bar.peak);
    fill.style.width = `${Math.max(2, (100 * bar.peak) / top)}%`;
    const note = `${bar.peak_text} (${bar.phase} peak)` + (bar.offloaded ? `; ${bar.offloaded} offloaded to the host` : "");
    table.appendChild(el("tr", { class: "memory-row" }, el("td", { class: "muted", style: "width:140px", text: bar.label }), el("td", {}, fill, el("div", { class: "muted", text: note }))));
  }
  card.appendChild(table);
  const single = m.bars.length === 1 ? new Map(m.bars[0].parts.map(([k, , text]) => [k, text])) : new Map();
  card.appendChild(legend(kinds.map((k) => [single.has(k) ? `${k} ${single.get(k)}` : k, colour(k)])));
  const share = m.budget ? ` (${((100 * top) / m.budget).toPrecision(3)}% of it at the largest peak)` : "";
  card.appendChild(el("p", { class: "muted", text: `budget per device: ${m.budget_text}${share}` }));
  return card;
}

function searchCard() {
  const s = DATA.search;
  const card = el("div", { class: "card wide", id: "search" }, el("h2", { text: "Configuration search: the runner-ups and why they lost" }), el("p", { class: "muted", text: s.summary }));
  const table = el("table", {}, el("tr", {}, ...["configuration", "status", "step", "memory", "why"].map((t) => el("th", { text: t }))));
  for (const r of s.rows) {
    table.appendChild(el("tr", { class: "search-row" }, el("td", { text: r.config }), el("td", { class: "status-" + r.status.replace(/ /g, "-"), text: r.status }),
      el("td", { class: "num", text: r.step }), el("td", { class: "num", text: r.memory }), el("td", { text: r.reason })));
  }
  card.appendChild(table);
  return card;
}

function buildOverview() {
  const cards = el("div", { class: "cards" }, configCard(), estimateCard(), memoryCard());
  if (DATA.search) cards.appendChild(searchCard());
  document.getElementById("tab-overview").appendChild(cards);
}

// -- node details ------------------------------------------------------------------------------

const ROWS_BY_ID = new Map(DATA.rows.map((r) => [r.id, r]));

function commText(c) {
  return `${SHORT[c[0]] || c[0]}@${c[1]} ${c[2]} ${c[3]} (${c[4]})`;
}

function showNode(id) {
  const r = ROWS_BY_ID.get(id);
  if (!r) return;
  for (const tr of document.querySelectorAll("tr.node.selected")) tr.classList.remove("selected");
  const tr = document.querySelector(`tr.node[data-node="${CSS.escape(id)}"]`);
  if (tr) tr.classList.add("selected");
  const panel = document.getElementById("detail-body");
  panel.textContent = "";
  panel.appendChild(el("h3", { text: r.label }));
  const facts = el("table", {});
  const fact = (k, v) => v && facts.appendChild(el("tr", {}, el("td", { class: "muted", text: k }), el("td", { class: "mono", text: v })));
  fact("node", r.name);
  fact("stage", r.stage === null ? "" : String(r.stage));
  fact("op", r.op);
  fact("module", r.module || "(top)");
  fact("shape", r.shape + (r.local ? ` -> ${r.local} per device` : ""));
  fact("placement", r.out);
  fact("inputs placed", r.ins.join(", "));
  fact("time", r.time);
  fact("memory", r.memory);
  fact("collectives", r.comm.map(commText).join("; "));
  if (r.folded_into) fact("folded into", r.folded_into);
  panel.appendChild(facts);
  panel.appendChild(el("h4", { text: "explain" }));
  panel.appendChild(el("pre", { id: "explain", text: r.explain }));
  document.getElementById("detail").classList.add("open");
}

// -- plan table --------------------------------------------------------------------------------

const COLUMNS = [
  ["label", "node", "mono"], ["module", "module", "mono"], ["op", "op", "mono"], ["shape", "shape", "mono"],
  ["out", "placement", "mono"], ["local", "local shape", "mono"], ["time_s", "time", "num"], ["memory_b", "memory", "num"], ["comm", "communication", ""],
];
const tableState = { sortKey: null, ascending: true, filter: "", showViews: false, open: new Set() };
const tableRows = [];

function blockKey(r) {
  return `${r.stage}|${r.block}`;
}

function buildTable() {
  const section = document.getElementById("tab-table");
  const filter = el("input", { type: "search", id: "filter", placeholder: "filter: node, module, op or placement (all words)" });
  filter.addEventListener("input", () => { tableState.filter = filter.value.trim().toLowerCase(); renderTable(); });
  const views = el("input", { type: "checkbox", id: "show-views" });
  views.addEventListener("change", () => { tableState.showViews = views.checked; renderTable(); });
  const count = el("span", { id: "row-count", class: "muted" });
  section.appendChild(el("div", { class: "toolbar" }, filter, el("label", {}, views, " show views and mask/index rows"), count,
    el("span", { class: "muted", text: "click a row for its options (explain); click a block header to unfold its layers; click a column to sort" })));
  const staged = DATA.stages.length > 1 || DATA.stages[0].index !== null;
  const head = el("tr", {});
  if (staged) head.appendChild(el("th", { text: "stage" }));
  for (const [key, title, cls] of COLUMNS) {
    const th = el("th", { class: `sortable ${cls}`, "data-sort": key, text: title + (key === "out" ? " " + DATA.axes.filter((a) => !staged || a.role !== "pipeline").map((a) => a.name).join("x") : "") });
    th.addEventListener("click", () => {
      tableState.ascending = tableState.sortKey === key ? !tableState.ascending : true;
      tableState.sortKey = key;
      renderTable();
    });
    head.appendChild(th);
  }
  const tbody = el("tbody", { id: "plan-rows" });
  const table = el("table", { id: "plan-table" }, el("thead", {}, head), tbody);
  section.appendChild(el("div", { class: "table-wrap" }, table));
  const blocks = new Map(DATA.blocks.map((b) => [`${b.stage}|${b.label}`, b]));
  const headed = new Set();
  DATA.rows.forEach((r, order) => {
    if (r.block && r.fold !== "layer" && !headed.has(blockKey(r))) {
      headed.add(blockKey(r));
      const b = blocks.get(blockKey(r)) || { count: "?", label: r.block };
      const td = el("td", { colspan: String(COLUMNS.length + (staged ? 1 : 0)) });
      const head = el("tr", { class: "block-head", "data-block": blockKey(r) }, td);
      head.addEventListener("click", () => {
        const key = blockKey(r);
        if (tableState.open.has(key)) tableState.open.delete(key); else tableState.open.add(key);
        renderTable();
      });
      tableRows.push({ kind: "head", tr: head, td, row: r, block: b, order: order - 0.5 });
    }
    const tr = el("tr", { class: "node" + (r.fold === "layer" ? " folded-layer" : ""), "data-node": r.id, "data-name": r.name });
    if (staged) tr.appendChild(el("td", { class: "num", text: String(r.stage) }));
    tr.appendChild(el("td", { class: "mono", text: r.label }));
    tr.appendChild(el("td", { class: "mono", text: r.module }));
    tr.appendChild(el("td", { class: "mono", text: r.op }));
    tr.appendChild(el("td", { class: "mono", text: r.shape }));
    tr.appendChild(el("td", { class: "mono", text: r.out }));
    tr.appendChild(el("td", { class: "mono", text: r.local }));
    tr.appendChild(el("td", { class: "num", text: r.time }));
    tr.appendChild(el("td", { class: "num", text: r.memory }));
    tr.appendChild(el("td", { class: "comm", text: r.comm.map((c) => `${SHORT[c[0]] || c[0]}@${c[1]} ${c[2]}`).join(", ") }));
    tr.addEventListener("click", () => showNode(r.id));
    const text = [r.label, r.name, r.module, r.op, r.out, r.comm.map((c) => `${SHORT[c[0]] || c[0]}@${c[1]}`).join(" ")].join(" ").toLowerCase();
    tableRows.push({ kind: "node", tr, row: r, text, order });
  });
  renderTable();
}

function rowVisible(item) {
  const r = item.row;
  const words = tableState.filter ? tableState.filter.split(/\s+/) : [];
  if (words.length) return words.every((w) => item.text.includes(w));  // the filter searches every row
  if (r.fold === "layer" && !tableState.open.has(blockKey(r))) return false;
  if ((r.fold === "view" || r.fold === "mask") && !tableState.showViews) return false;
  return true;
}

function renderTable() {
  const tbody = document.getElementById("plan-rows");
  const key = tableState.sortKey;
  let items = tableRows.slice();
  if (key) {
    items = items.filter((i) => i.kind === "node");
    const value = (i) => (key === "comm" ? i.row.comm.length : i.row[key]);
    items.sort((a, b) => {
      const x = value(a), y = value(b);
      const c = typeof x === "number" ? x - y : String(x).localeCompare(String(y));
      return (tableState.ascending ? c : -c) || a.order - b.order;
    });
  } else {
    items.sort((a, b) => a.order - b.order);
  }
  for (const th of document.querySelectorAll("#plan-table th.sortable")) {
    th.classList.toggle("asc", th.dataset.sort === key && tableState.ascending);
    th.classList.toggle("desc", th.dataset.sort === key && !tableState.ascending);
  }
  let shown = 0;
  for (const item of tableRows) item.tr.style.display = "none";
  for (const item of items) {
    tbody.appendChild(item.tr);
    if (item.kind === "head") {
      const open = tableState.open.has(blockKey(item.row));
      const b = item.block;
      item.td.textContent = `${open ? "\u25BE" : "\u25B8"} ${b.label}  x${b.count} identical blocks` + (open ? ": every layer shown (click to fold)" : ", shown once: the first layer (click to show every layer)");
      item.tr.style.display = tableState.filter ? "none" : "";
      continue;
    }
    const visible = rowVisible(item);
    item.tr.style.display = visible ? "" : "none";
    if (visible) shown += 1;
  }
  document.getElementById("row-count").textContent = `${shown} of ${DATA.rows.length} nodes shown`;
}

// -- start -------------------------------------------------------------------------------------

function main() {
  buildHeader();
  buildTabs();
  buildOverview();
  buildTable();
  buildGraph();
  if (DATA.timeline) buildTimeline();
  if (DATA.diff) buildDiff();
  document.getElementById("detail-close").addEventListener("click", () => document.getElementById("detail").classList.remove("open"));
  document.body.dataset.ready = "1";
}

main();
