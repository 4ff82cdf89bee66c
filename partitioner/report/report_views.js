// Partita plan report, the views drawn as SVG or tables of their own: the graph, the pipeline
// timeline and the diff (report.js holds the helpers, the overview, the table and main()).
// Inlined before report.js into the same <script>.
"use strict";

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
