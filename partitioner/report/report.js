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

// -- graph -------------------------------------------------------------------------------------

function graphSvg(g) {
  const parts = [`<svg class="plan-graph" width="${g.width}" height="${g.height}" viewBox="0 0 ${g.width} ${g.height}" font-family="system-ui, Helvetica, sans-serif">`];
  parts.push('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker>' +
    '<marker id="arrow-red" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#c0392b"/></marker></defs>');
  for (const c of g.clusters) {
    parts.push(`<rect x="${c.x}" y="${c.y}" width="${c.w}" height="${c.h}" rx="10" fill="#fbfaf5" stroke="#888" stroke-dasharray="6 4"/>`);
    parts.push(`<text x="${c.x + 10}" y="${c.y + 16}" font-size="12" fill="#555">${esc(c.note)}</text>`);
  }
  for (const e of g.edges) {
    const dy = Math.max(30, (e.y2 - e.y1) / 2);
    const comm = e.collectives.length > 0;
    const dash = e.mask_index ? ' stroke-dasharray="2 3"' : e.from_layer ? ' stroke-dasharray="6 4"' : "";
    parts.push(`<path class="edge${comm ? " comm-edge" : ""}" d="M${e.x1},${e.y1} C${e.x1},${e.y1 + dy} ${e.x2},${e.y2 - dy} ${e.x2},${e.y2}" fill="none" stroke="${comm ? "#c0392b" : "#777"}" stroke-width="${comm ? 2 : 1}"${dash} marker-end="url(#${comm ? "arrow-red" : "arrow"})"/>`);
    const label = comm ? e.collectives.join(" ") : e.mask_index ? "mask/index" : e.from_layer ? `from ${e.from_layer}` : "";
    if (label) {  // near the producer, where edges into one consumer are still apart; a white halo keeps it legible
      const t = 0.3, u = 1 - t;
      const x = u * u * u * e.x1 + 3 * u * u * t * e.x1 + 3 * u * t * t * e.x2 + t * t * t * e.x2 + 4;
      const y = u * u * u * e.y1 + 3 * u * u * t * (e.y1 + dy) + 3 * u * t * t * (e.y2 - dy) + t * t * t * e.y2 + 4;
      parts.push(`<text x="${x}" y="${y}" font-size="11" fill="${comm ? "#c0392b" : "#666"}" font-weight="${comm ? 600 : 400}" paint-order="stroke" stroke="#fff" stroke-width="3">${esc(label)}${comm && e.from_layer ? esc(" from " + e.from_layer) : ""}</text>`);
    }
  }
  for (const n of g.nodes) {
    const isOutput = n.id === null;
    parts.push(`<g class="gnode" data-id="${esc(n.id || "")}"><title>${esc(n.title)}</title>`);
    parts.push(`<rect x="${n.x}" y="${n.y}" width="${n.w}" height="${n.h}" rx="${isOutput ? 25 : 7}" fill="${n.colour}" stroke="#445" stroke-width="1"/>`);
    const lines = isOutput ? ["output"] : [n.title, n.op, n.placement + (n.folded_rows ? `  (+${n.folded_rows} mask/index)` : "")];
    lines.forEach((line, i) => {
      const y = n.y + (isOutput ? 30 : 15 + 14 * i);
      parts.push(`<text x="${n.x + n.w / 2}" y="${y}" font-size="${i === 0 ? 11.5 : 10.5}" text-anchor="middle" font-weight="${i === 0 ? 600 : 400}">${esc(line)}</text>`);
    });
    parts.push("</g>");
  }
  parts.push("</svg>");
  return parts.join("");
}

function buildGraph() {
  const section = document.getElementById("tab-graph");
  section.appendChild(el("p", { class: "muted", text: "Boxes are coloured by their output placement; red edges carry collectives (AR all-reduce, AG all-gather, RS reduce-scatter, A2A all-to-all, with the mesh axis and phase). A block of identical layers is drawn once; click a box for its options." }));
  for (const g of DATA.graphs) {
    if (g.stage !== null) section.appendChild(el("h3", { class: "stage", text: `stage ${g.stage}` }));
    const legendItems = g.legend.map(([placement, colour]) => [placement, colour]);
    legendItems.push(["collective on an edge", "#c0392b"]);
    const box = legend(legendItems);
    box.classList.add("graph-legend");
    section.appendChild(box);
    if (g.folded) section.appendChild(el("p", { class: "muted", text: `${g.folded} mask/index rows not drawn (counted on the box that uses them; the table lists them)` }));
    const wrap = el("div", { class: "graph-wrap" });
    wrap.innerHTML = graphSvg(g);
    wrap.addEventListener("click", (event) => {
      const node = event.target.closest(".gnode");
      if (node && node.dataset.id) showNode(node.dataset.id);
    });
    section.appendChild(wrap);
  }
}

// -- pipeline timeline -------------------------------------------------------------------------

function actionKind(action) {
  const m = /^\d+([FBIW])/.exec(action);
  return m ? m[1] : "gradient sync + optimizer step";
}

function timelineSvg(panels, span) {
  const width = 1100, left = 90, row = 26;
  const scale = (width - left - 20) / Math.max(span, 1e-12);
  const parts = [];
  let y = 10;
  for (const [name, timeline] of panels) {
    const all = Object.values(timeline).flat();
    const origin = Math.min(...all.map((a) => a[1]));
    const end = Math.max(...all.map((a) => a[2]));
    parts.push(`<text x="4" y="${y + 13}" font-size="13" font-weight="600">${esc(name)}: step ${esc(fmtSeconds(end - origin))}</text>`);
    y += 20;
    for (const rank of Object.keys(timeline).sort((a, b) => a - b)) {
      parts.push(`<text x="4" y="${y + row * 0.65}" font-size="11">rank ${esc(rank)}</text>`);
      parts.push(`<rect x="${left}" y="${y}" width="${span * scale}" height="${row - 4}" fill="#f3f4f6"/>`);
      for (const [action, s, e] of timeline[rank]) {
        const x = left + (s - origin) * scale, w = Math.max((e - s) * scale, 0.5);
        parts.push(`<rect class="action" x="${x}" y="${y}" width="${w}" height="${row - 4}" fill="${ACTION_COLOURS[actionKind(action)]}" stroke="#333" stroke-width="0.4"><title>${esc(action)}: ${esc(fmtSeconds(e - s))}</title></rect>`);
        if (w > 24) parts.push(`<text x="${x + 2}" y="${y + row * 0.6}" font-size="9">${esc(action)}</text>`);
      }
      y += row;
    }
    y += 10;
  }
  for (let i = 0; i <= 5; i++) {
    const x = left + (i / 5) * span * scale;
    parts.push(`<line x1="${x}" y1="${y}" x2="${x}" y2="${y + 5}" stroke="#333"/><text x="${x}" y="${y + 17}" font-size="10" text-anchor="middle">${esc(fmtSeconds((i / 5) * span))}</text>`);
  }
  parts.push(`<line x1="${left}" y1="${y}" x2="${left + span * scale}" y2="${y}" stroke="#333"/>`);
  y += 26;
  return `<svg id="timeline-svg" width="${width}" height="${y}" font-family="system-ui, Helvetica, sans-serif">${parts.join("")}</svg>`;
}

function buildTimeline() {
  const t = DATA.timeline;
  const section = document.getElementById("tab-timeline");
  const panels = [];
  if (t.simulated) panels.push([`simulated by the cost model (${t.schedule})`, t.simulated]);
  if (t.measured) panels.push(["measured", t.measured]);
  const spans = panels.map(([, tl]) => {
    const all = Object.values(tl).flat();
    return Math.max(...all.map((a) => a[2])) - Math.min(...all.map((a) => a[1]));
  });
  section.appendChild(el("p", { class: "muted", text: "One row per pipeline rank; both timelines share one time scale, so a longer measured step draws longer. F forward, B backward, I input-gradient, W weight-gradient pass of stage s, microbatch m (sF m)." }));
  section.appendChild(legend(Object.entries(ACTION_COLOURS)));
  const wrap = el("div", { class: "timeline-wrap" });
  wrap.innerHTML = timelineSvg(panels, Math.max(...spans));
  section.appendChild(wrap);
}

// -- diff --------------------------------------------------------------------------------------

function buildDiff() {
  const d = DATA.diff;
  const section = document.getElementById("tab-diff");
  const [a, b] = d.names;
  const summary = el("table", { id: "diff-summary", style: "max-width:900px" }, el("tr", {}, el("th", { text: "" }), el("th", { text: a }), el("th", { text: b })));
  const line = (k, x, y) => summary.appendChild(el("tr", {}, el("td", { class: "muted", text: k }), el("td", { text: x }), el("td", { text: y })));
  line("model", d.here.model, d.there.model);
  line("mesh", `${d.here.mesh.join("x")} (${d.here.axis_names.join(", ")})`, `${d.there.mesh.join("x")} (${d.there.axis_names.join(", ")})`);
  line("configuration", d.here.config || "given mesh", d.there.config || "given mesh");
  line("step time", fmtSeconds(d.here.step_s), fmtSeconds(d.there.step_s));
  line("memory per device", `${(d.here.memory_bytes / 2 ** 20).toFixed(2)} MiB`, `${(d.there.memory_bytes / 2 ** 20).toFixed(2)} MiB`);
  line("communication per device", `${(d.here.comm_bytes / 2 ** 20).toFixed(2)} MiB`, `${(d.there.comm_bytes / 2 ** 20).toFixed(2)} MiB`);
  section.appendChild(el("div", { class: "card" }, el("h2", { text: "Two plans" }), summary));
  if (d.note) section.appendChild(el("p", { class: "muted", text: d.note }));
  const hide = el("input", { type: "checkbox", id: "diff-hide-views", checked: "checked" });
  section.appendChild(el("div", { class: "toolbar", style: "margin-top:12px" }, el("label", {}, hide, " hide views")));
  const tables = [];
  d.stages.forEach((stage, i) => {
    if (d.pipelined) section.appendChild(el("h3", { class: "stage", text: `stage ${i}` }));
    section.appendChild(el("p", { text: `${stage.changed_nodes} nodes placed differently, in ${stage.groups.length} lines: a change made in every layer of a block is one line` + (stage.same_graph ? "" : " (the plans were made for different graphs; nodes matched by name)") }));
    const table = el("table", { class: "diff-table" }, el("tr", {}, ...["block", "layers", "node", "module", "op", a, b].map((t) => el("th", { text: t }))));
    let block;
    for (const g of stage.groups) {
      if (g.block !== block) {
        block = g.block;
        table.appendChild(el("tr", { class: "block-head" }, el("td", { colspan: "7", text: block ? `${block}: identical layers, each change listed once with the layers it is made in` : "outside repeated blocks" })));
      }
      const layers = g.layers.length ? (g.layers.length > 2 ? `${g.layers[0]} .. ${g.layers[g.layers.length - 1]} (${g.layers.length})` : g.layers.join(", ")) : "";
      const tr = el("tr", { class: "diff-row" + (g.view ? " diff-view" : "") }, el("td", { class: "mono", text: g.block || "" }), el("td", { class: "mono", text: layers }),
        el("td", { class: "mono", text: g.name }), el("td", { class: "mono", text: g.module }), el("td", { class: "mono", text: g.op }),
        el("td", { class: "mono diff-before", text: g.before }), el("td", { class: "mono diff-after", text: g.after }));
      table.appendChild(tr);
    }
    for (const name of stage.only_here) table.appendChild(el("tr", { class: "diff-row" }, el("td", { colspan: "7", text: `${name}: only in ${a}` })));
    for (const name of stage.only_there) table.appendChild(el("tr", { class: "diff-row" }, el("td", { colspan: "7", text: `${name}: only in ${b}` })));
    tables.push(table);
    section.appendChild(el("div", { class: "table-wrap" }, table));
  });
  const apply = () => { for (const tr of document.querySelectorAll("tr.diff-view")) tr.style.display = hide.checked ? "none" : ""; };
  hide.addEventListener("change", apply);
  apply();
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
