"""The dashboard page: one HTML document with its style and script inline (no CDN, no build).

It polls ``/api/state`` (``dashboard_view``) and redraws with DOM calls and SVG; text from the
swarm goes in through ``textContent`` only. Elements carry ``data-*`` attributes for tests.
"""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>swarmp2p</title>
<style>
:root{--fg:#1d232a;--mut:#66707a;--bg:#f6f7f9;--card:#fff;--line:#d9dde2;--ok:#2e7d32;--bad:#c62828;
--acc:#1565c0;--acc2:#ef6c00}
*{box-sizing:border-box}body{margin:0;font:14px/1.4 system-ui,sans-serif;color:var(--fg);background:var(--bg)}
header{padding:12px 20px;background:#1d232a;color:#fff;display:flex;gap:24px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}header span{color:#c9d1d9}
main{padding:16px 20px;display:grid;gap:16px}
section{background:var(--card);border:1px solid var(--line);border-radius:6px;padding:12px 16px}
h2{font-size:15px;margin:0 0 8px}table{border-collapse:collapse;width:100%}
td,th{text-align:left;padding:4px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{color:var(--mut);font-weight:600}.dead{color:var(--bad)}.alive{color:var(--ok)}
.bar{position:relative;height:14px;width:180px;background:#e8ebef;border-radius:3px;overflow:hidden;display:inline-block;vertical-align:middle}
.bar>i{position:absolute;left:0;top:0;bottom:0;background:var(--acc)}.dev{margin:2px 0;white-space:nowrap}
.dev small,.mut{color:var(--mut)}.job{border-top:1px solid var(--line);padding-top:8px;margin-top:8px}
.charts{display:flex;gap:16px;flex-wrap:wrap}svg text{font-size:10px;fill:var(--mut)}
#error{display:none;background:#fdecea;color:var(--bad);padding:8px 20px}
.state{font-weight:600;text-transform:uppercase;font-size:12px}
</style></head>
<body>
<header><h1>swarmp2p</h1><span id="swarm"></span><span id="leader"></span><span id="table"></span>
<span id="updated"></span></header>
<div id="error"></div>
<main>
<section><h2>Nodes <span class="mut" id="node-count"></span></h2>
<table><thead><tr><th>node</th><th>name</th><th>address</th><th>state</th><th>devices (memory used)</th></tr></thead>
<tbody id="nodes"></tbody></table></section>
<section><h2>Jobs</h2><div id="jobs"><p class="mut">no jobs</p></div></section>
<section><h2>Served models</h2><div id="served"><p class="mut">none</p></div></section>
</main>
<script>
"use strict";
const NS = "http://www.w3.org/2000/svg";
const params = new URLSearchParams(location.search);
const INTERVAL = Math.max(200, Number(params.get("interval")) || 1000);
const PALETTE = ["#1565c0","#ef6c00","#2e7d32","#6a1b9a","#00838f","#c62828","#5d4037","#455a64"];

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const k of kids) if (k != null) e.append(k);
  return e;
}
function svg(tag, attrs) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  return e;
}
function gib(n) { return n == null ? "?" : (n / 1073741824).toFixed(1) + "G"; }
function fmt(v) { return typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toPrecision(4)) : String(v); }

function device(d) {
  const used = d.memory_used_fraction;
  const bar = el("span", {class: "bar", title: used == null ? "unknown" : Math.round(used * 100) + "% used"},
                 el("i", {style: "width:" + (used == null ? 0 : used * 100).toFixed(1) + "%"}));
  const text = `${d.label}${d.name && d.name !== d.kind ? " " + d.name : ""} ${gib(d.memory_total - d.memory_free)}/${gib(d.memory_total)}` +
               (d.compute_capability ? ` cc${d.compute_capability}` : "") + (d.fake ? " (fake)" : "");
  return el("div", {class: "dev", "data-device": d.label, "data-used": used == null ? "" : String(used)},
            bar, " ", el("small", {text}));
}

function renderNodes(s) {
  const body = document.getElementById("nodes");
  body.replaceChildren(...s.nodes.map(n => el("tr", {"data-node-id": n.node_id, "data-alive": String(n.alive)},
    el("td", {text: n.node_id + (n.is_leader ? " \u2605" : "")}),
    el("td", {text: n.name}), el("td", {text: n.address}),
    el("td", {class: n.alive ? "alive" : "dead",
              text: (n.alive ? "alive" : "dead") + (n.last_seen_s ? ` (${n.last_seen_s.toFixed(1)} s)` : "")}),
    el("td", {}, ...n.devices.map(device)))));
  document.getElementById("node-count").textContent = `${s.alive} alive of ${s.nodes.length}`;
}

function planChart(job) {
  const W = 560, H = 34, total = job.stages.reduce((a, st) => a + (st.layers ? st.layers[1] - st.layers[0] : 1), 0);
  const g = svg("svg", {width: W, height: H + 14, class: "plan-chart", "data-job-id": job.job_id,
                        "data-stages": String(job.stages.length)});
  let x = 0;
  job.stages.forEach((st, i) => {
    const w = (st.layers ? st.layers[1] - st.layers[0] : 1) / Math.max(total, 1) * W;
    const r = svg("rect", {x: x, y: 0, width: Math.max(w - 2, 1), height: H, fill: PALETTE[i % PALETTE.length],
                           "data-node-id": st.node_id, "data-node": st.node});
    r.append(svg("title", {text: `stage ${st.index} on ${st.node} ${st.devices.join(",")}`}));
    g.append(r);
    g.append(svg("text", {x: x + 4, y: 14, style: "fill:#fff", text: `${st.index}: ${st.node}`}));
    if (st.layers) g.append(svg("text", {x: x + 4, y: 28, style: "fill:#fff", text: `layers ${st.layers[0]}-${st.layers[1] - 1}`}));
    x += w;
  });
  return g;
}

// x: the step numbers the points carry (1 the first, as "step N of M" counts)
function lineChart(job, key, title, color) {
  const pts = job.metrics.filter(p => p[key] != null);
  const W = 360, H = 160, P = 34;
  const g = svg("svg", {width: W, height: H, class: "chart " + key.replace(/_/g, "-") + "-chart",
                        "data-job-id": job.job_id, "data-points": String(pts.length),
                        "data-first-step": pts.length ? String(pts[0].step) : "",
                        "data-last-step": pts.length ? String(pts[pts.length - 1].step) : ""});
  g.append(svg("text", {x: P, y: 12, text: title + (pts.length ? ": " + fmt(pts[pts.length - 1][key]) : " (no data)")}));
  g.append(svg("rect", {x: P, y: 18, width: W - P - 6, height: H - 38, fill: "none", stroke: "#d9dde2"}));
  if (!pts.length) return g;
  const xs = pts.map(p => p.step), ys = pts.map(p => p[key]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  const sx = v => P + (x1 === x0 ? 0.5 : (v - x0) / (x1 - x0)) * (W - P - 6);
  const sy = v => 18 + (1 - (y1 === y0 ? 0.5 : (v - y0) / (y1 - y0))) * (H - 38);
  g.append(svg("polyline", {fill: "none", stroke: color, "stroke-width": 1.5,
                            points: pts.map(p => sx(p.step).toFixed(1) + "," + sy(p[key]).toFixed(1)).join(" ")}));
  const last = pts[pts.length - 1];  // a dot on the newest point (one point draws no line)
  g.append(svg("circle", {cx: sx(last.step).toFixed(1), cy: sy(last[key]).toFixed(1), r: 3, fill: color}));
  g.append(svg("text", {x: 2, y: 24, text: fmt(y1)}));
  g.append(svg("text", {x: 2, y: H - 20, text: fmt(y0)}));
  g.append(svg("text", {x: P, y: H - 6, class: "x-first", text: "step " + x0}));
  if (x1 !== x0) g.append(svg("text", {x: W - 6, y: H - 6, "text-anchor": "end", class: "x-last", text: "step " + x1}));
  return g;
}

function evalTable(rows) {
  const keys = [...new Set(rows.flatMap(r => Object.keys(r)))];
  return el("table", {class: "eval"}, el("thead", {}, el("tr", {}, ...keys.map(k => el("th", {text: k})))),
            el("tbody", {}, ...rows.map(r => el("tr", {}, ...keys.map(k => el("td", {text: r[k] == null ? "" : fmt(r[k])}))))));
}

function progress(j) {
  if (j.step == null && j.attempt == null) return null;
  const parts = [];
  if (j.step != null) parts.push(`step ${j.step}` + (j.steps ? ` of ${j.steps}` : ""));
  if (j.attempt) parts.push(`attempt ${j.attempt}`);
  const box = el("div", {class: "mut", "data-step": String(j.step ?? "")}, parts.join(" \u00b7 "));
  if (j.step != null && j.steps) box.prepend(el("span", {class: "bar", style: "width:120px"},
    el("i", {style: `width:${Math.min(100, j.step / j.steps * 100).toFixed(1)}%`})), " ");
  return box;
}

function renderJobs(s) {
  const box = document.getElementById("jobs");
  if (!s.jobs.length) { box.replaceChildren(el("p", {class: "mut", text: "no jobs"})); return; }
  box.replaceChildren(...s.jobs.map(j => el("div", {class: "job", "data-job-id": j.job_id, "data-state": j.state},
    el("div", {}, el("b", {text: j.job_id}), " ", el("span", {class: "state", text: j.state}), " ",
       el("span", {class: "mut", text: [j.name, j.kind, j.dtype].filter(Boolean).join(" \u00b7 ")})),
    progress(j),
    j.reason ? el("div", {class: "mut", text: "waiting: " + j.reason}) : null,
    j.error ? el("div", {class: "dead", text: "error: " + j.error}) : null,
    j.stages.length ? planChart(j) : el("div", {class: "mut", text: "not planned yet"}),
    el("div", {class: "charts"}, lineChart(j, "loss", "loss", PALETTE[0]),
       lineChart(j, "tokens_per_s", "tokens/s", PALETTE[1])),
    j.boundaries.length ? el("div", {class: "mut", text: j.boundaries.map(b =>
      `boundary ${b.stage}\u2192${Number(b.stage) + 1}: activations ${fmt(b.act_mb_s)} MB/s, gradients ${fmt(b.grad_mb_s)} MB/s`).join(" \u00b7 ")}) : null,
    j.bad_metrics ? el("div", {class: "mut", text: `${j.bad_metrics} metric entries were not valid points`}) : null,
    j.evaluation.length ? evalTable(j.evaluation) : null)));
}

// live sessions of a served model: running of its slots, and requests queued for one
function sessions(m) {
  const n = m.sessions;
  if (!n) return el("div", {class: "mut sessions", "data-active": "", "data-max": "", "data-queued": "",
                            text: "sessions: not known yet"});
  const box = el("div", {class: "sessions", "data-active": String(n.active), "data-max": String(n.max),
                         "data-queued": String(n.queued)},
                 el("span", {class: "bar", style: "width:120px", title: `${n.active} of ${n.max} session slots in use`},
                    el("i", {style: `width:${Math.min(100, n.active / Math.max(n.max, 1) * 100).toFixed(1)}%`})),
                 ` sessions ${n.active}/${n.max} active \u00b7 ${n.queued} queued`);
  return box;
}

// speculative decoding and the prefix cache of a served model (absent: off)
function decoding(m) {
  const n = m.sessions;
  if (!n || (!n.speculation && !n.prefix_cache)) return null;
  const parts = [];
  const sp = n.speculation;
  if (sp) {
    const spec = el("span", {class: "speculation", "data-mode": sp.mode, "data-off": sp.off,
                             "data-laps": String(sp.laps), "data-drafted": String(sp.drafted),
                             "data-acceptance": String(sp.acceptance)});
    spec.textContent = sp.off ? `speculation ${sp.mode}: off (${sp.off})`
      : `speculation ${sp.mode}: ${(sp.acceptance * 100).toFixed(0)}% of ${sp.drafted} drafted kept, ` +
        `${sp.tokens_per_lap.toFixed(2)} tokens a lap`;
    parts.push(spec);
  }
  const pc = n.prefix_cache;
  if (pc) {
    if (parts.length) parts.push(" \u00b7 ");
    parts.push(el("span", {class: "prefix-cache", "data-blocks": String(pc.blocks),
                           "data-capacity": String(pc.capacity), "data-lookups": String(pc.lookups),
                           "data-hits": String(pc.hits),
                           text: `prefix cache ${pc.blocks}/${pc.capacity} blocks, ` +
                                 `${pc.hits} of ${pc.lookups} prompts reused ${pc.reused_tokens} tokens`}));
  }
  return el("div", {class: "mut decoding"}, ...parts);
}

function renderServed(s) {
  const box = document.getElementById("served");
  if (!s.served.length) { box.replaceChildren(el("p", {class: "mut", text: "none"})); return; }
  box.replaceChildren(...s.served.map(m => el("div", {class: "served job", "data-model": m.model, "data-state": m.state},
    el("div", {}, el("b", {text: m.model}), " ", m.state ? el("span", {class: "state", text: m.state}) : null, " ",
       m.url ? el("code", {text: m.url}) : null),
    m.reason ? el("div", {class: "mut", text: m.reason}) : null,
    m.url || m.sessions ? sessions(m) : null,
    decoding(m),
    m.stages.length ? planChart({job_id: m.job_id || m.model, stages: m.stages}) : null)));
}

async function poll() {
  try {
    const r = await fetch("api/state", {cache: "no-store"});
    if (r.status === 401) {
      const box = document.getElementById("error");
      box.textContent = "this page needs its key: open the URL that `swarm dashboard` prints, or run `swarm dashboard --open`";
      box.style.display = "block";
      setTimeout(poll, INTERVAL);
      return;
    }
    if (!r.ok) throw new Error("HTTP " + r.status);
    const s = await r.json();
    document.getElementById("swarm").textContent = `swarm ${s.swarm_id.slice(0, 12)} \u00b7 node ${s.node_id} \u00b7 v${s.version}`;
    document.getElementById("leader").textContent = "leader " + s.leader + (s.leader_ready ? "" : " (taking over)");
    document.getElementById("leader").dataset.leader = s.leader;
    document.getElementById("table").textContent = `table term ${s.term} version ${s.table_version}`;
    document.getElementById("updated").textContent = "updated " + new Date(s.generated_at * 1000).toLocaleTimeString();
    renderNodes(s); renderJobs(s); renderServed(s);
    document.body.dataset.tableVersion = String(s.table_version);
    document.getElementById("error").style.display = "none";
  } catch (e) {
    const box = document.getElementById("error");
    box.textContent = "cannot reach this node's daemon (" + e.message + "); is `swarm up` running?";
    box.style.display = "block";
  }
  setTimeout(poll, INTERVAL);
}
poll();
</script></body></html>
"""
