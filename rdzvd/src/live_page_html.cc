// The live page (live_page.h): one self-contained HTML document, inline CSS and JS, no
// external assets. It polls /api/status and /api/events every 500 ms and redraws in place.
// Nodes a run lost are known from its node_lost events (the server keeps no history): they
// stay on the page, marked lost, while those events are in the feed.
#include "live_page.h"

namespace muster::rdzvd {

const char* const kLivePageHtml = R"HTML(<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>muster rdzvd</title>
<style>
  :root { --bg:#f4f5f7; --card:#fff; --ink:#1d2330; --dim:#667085; --line:#e3e6eb;
          --ok:#127a3e; --warn:#a15c00; --bad:#b42318; --info:#2453a6; }
  * { box-sizing: border-box; }
  body { margin:0; font:14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif;
         background:var(--bg); color:var(--ink); }
  header { display:flex; gap:16px; align-items:baseline; padding:12px 20px;
           background:#1d2330; color:#fff; }
  header h1 { margin:0; font-size:18px; font-weight:600; }
  #summary { color:#c3c9d4; }
  .conn { margin-left:auto; padding:2px 10px; border-radius:10px; font-size:12px; }
  .conn.ok { background:var(--ok); } .conn.bad { background:var(--bad); }
  .conn.wait { background:#475467; }
  main { display:grid; grid-template-columns: minmax(0,3fr) minmax(260px,2fr); gap:16px;
         padding:16px 20px; }
  @media (max-width: 900px) { main { grid-template-columns: 1fr; } }
  .card { background:var(--card); border:1px solid var(--line); border-radius:8px;
          padding:12px 16px; margin-bottom:16px; }
  .run-head { display:flex; align-items:center; gap:10px; }
  .run-head h2 { margin:0; font-size:16px; }
  code { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size:13px; }
  .phase { padding:1px 9px; border-radius:9px; font-size:12px; color:#fff; }
  .phase-joining { background:var(--warn); } .phase-running { background:var(--ok); }
  .phase-finished { background:#475467; } .phase-failed { background:var(--bad); }
  dl.facts { display:flex; flex-wrap:wrap; gap:4px 22px; margin:10px 0; }
  dl.facts div { display:flex; flex-direction:column; }
  dt { color:var(--dim); font-size:11px; text-transform:uppercase; letter-spacing:.04em; }
  dd { margin:0; font-weight:600; }
  table { border-collapse:collapse; width:100%; }
  th, td { text-align:left; padding:4px 8px; border-bottom:1px solid var(--line); }
  th { color:var(--dim); font-weight:500; font-size:12px; }
  .state { font-weight:600; }
  tr.member .state { color:var(--ok); } tr.waiting .state { color:var(--warn); }
  tr.lost { color:var(--dim); } tr.lost .state { color:var(--bad); }
  tr.lost td:not(.state) { text-decoration: line-through; }
  .failure { margin-top:10px; padding:8px 10px; border-left:3px solid var(--bad);
             background:#fef3f2; }
  .straggler { margin-top:10px; padding:8px 10px; border-left:3px solid #f79009;
               background:#fffaeb; }
  .recovery { margin-top:10px; padding:8px 10px; border-left:3px solid var(--info);
              background:#eff4ff; }
  .recovery.mode-full { border-left-color:var(--warn); background:#fffaeb; }
  ol.phases { display:flex; flex-wrap:wrap; gap:6px; list-style:none; margin:6px 0 0; padding:0; }
  .ph { padding:2px 9px; border-radius:9px; font-size:12px; background:#e3e6eb; }
  .ph.done { background:#d1fadf; } .ph.pending { background:#fef0c7; }
  .empty { color:var(--dim); }
  #events { list-style:none; margin:0; padding:0; max-height:75vh; overflow:auto; }
  #events li { padding:4px 0; border-bottom:1px solid var(--line); }
  #events time { color:var(--dim); font-family: ui-monospace, monospace; font-size:12px; }
  .ev-name { font-weight:600; }
  .ev-node_lost .ev-name, .ev-worker_failed .ev-name, .ev-failed .ev-name { color:var(--bad); }
  .ev-restart .ev-name { color:var(--warn); }
  .ev-round_formed .ev-name, .ev-succeeded .ev-name { color:var(--ok); }
  .ev-node_joined .ev-name { color:var(--info); }
  .ev-in_place_resumed .ev-name { color:var(--ok); } .ev-in_place_fallback .ev-name { color:var(--bad); }
</style>
</head>
<body>
<header><h1>muster rdzvd</h1><span id="summary"></span>
  <span id="conn" class="conn wait">connecting</span></header>
<main>
  <div id="runs"><p class="empty">no runs</p></div>
  <section class="card" id="events-card"><h2 style="margin:0 0 8px;font-size:16px">Recent events</h2>
    <ol id="events"><li class="empty">none yet</li></ol></section>
</main>
<script>
'use strict';
const POLL_MS = 500, MAX_EVENTS = 200;
let since = 0, events = [];
const lost = new Map();  // run id -> Map(node id -> its node_lost event)
let shownRuns = '', shownEvents = '';

const esc = (s) => String(s == null ? '' : s).replace(/[&<>"']/g,
    (c) => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c]));
function dur(ms) {
  if (ms < 1000) return ms + 'ms';
  if (ms < 60000) return (ms / 1000).toFixed(1) + 's';
  if (ms < 3600000) return Math.floor(ms / 60000) + 'm' + String(Math.floor(ms / 1000) % 60).padStart(2, '0') + 's';
  return Math.floor(ms / 3600000) + 'h' + String(Math.floor(ms / 60000) % 60).padStart(2, '0') + 'm';
}
const ended = (x) => x.signal > 0 ? 'signal ' + x.signal : 'exit code ' + x.exit_code;
const clock = (e) => { const d = new Date(e.unix_ms);
  return d.toLocaleTimeString([], {hour12: false}) + '.' + String(d.getMilliseconds()).padStart(3, '0'); };

function ingest(feed) {
  if (feed.next - 1 < since) {  // the server restarted: its numbers start again
    since = 0; events = []; lost.clear(); return;
  }
  for (const e of feed.events) {
    since = Math.max(since, e.seq);
    events.push(e);
    if (!e.node) continue;
    if (e.event === 'node_lost') {
      if (!lost.has(e.run)) lost.set(e.run, new Map());
      lost.get(e.run).set(e.node, e);
    } else if (e.event === 'node_joined' && lost.has(e.run)) {
      lost.get(e.run).delete(e.node);
    }
  }
  if (events.length > MAX_EVENTS) events = events.slice(events.length - MAX_EVENTS);
}

function nodeRow(state, n, group, ranks, note) {
  return `<tr class="node ${state}" data-node="${esc(n.node_id || n.node)}" data-state="${state}">` +
      `<td class="state">${state}</td><td>${group}</td><td>${ranks}</td>` +
      `<td>${esc(n.host)}</td><td><code>${esc(n.node_id || n.node)}</code></td><td>${note}</td></tr>`;
}

// The run's last recovery (status last_recovery) and its phases: noticed (the server's
// restart) -> aborted (every in-place node told its survivors; the slowest node's time from
// when it noticed) -> re-formed (the round formed; the slowest node's re-form) -> resumed
// (every in-place node's workers stepping again), the server's times from its restart.
function recoveryHtml(x) {
  const inPlace = x.nodes_in_place > 0;
  const how = inPlace ? `in place on ${x.nodes_in_place} of ${x.nodes} node(s)` : 'full restart, every worker new';
  const done = x.nodes_resumed === x.nodes_in_place;
  const phase = (name, ok, text) =>
      `<li class="ph ${ok ? 'done' : 'pending'}" data-phase="${name}"><b>${name}</b> ${text}</li>`;
  let phases = phase('noticed', true, esc(x.cause));
  if (inPlace) phases += phase('aborted', x.nodes_resumed > 0, x.nodes_resumed > 0 ? dur(x.abort_ms) : '&hellip;');
  phases += phase(inPlace ? 're-formed' : 'round formed', true, '+' + dur(x.formed_ms) +
      (inPlace && x.nodes_resumed > 0 ? ` (node ${dur(x.reform_ms)})` : ''));
  if (inPlace) phases += phase('resumed', done, done ? '+' + dur(x.resumed_ms) :
      `${x.nodes_resumed}/${x.nodes_in_place} node(s)`);
  return `<div class="recovery mode-${esc(x.mode)}" data-mode="${esc(x.mode)}" data-round="${x.round}" ` +
      `data-resumed="${inPlace && done ? 'all' : x.nodes_resumed}"><b>Last recovery:</b> round ${x.round}, ${how}, ` +
      `${dur(x.age_ms)} ago<ol class="phases">${phases}</ol></div>`;
}

function runHtml(r) {
  const present = new Set(r.members.map((n) => n.node_id).concat(r.waiting.map((n) => n.node_id)));
  let rows = '';
  for (const n of r.members) {
    const ranks = n.first_rank === n.last_rank ? n.first_rank : n.first_rank + '&ndash;' + n.last_rank;
    rows += nodeRow('member', n, n.group_rank, ranks, '');
  }
  for (const n of r.waiting) rows += nodeRow('waiting', n, '&ndash;', '(' + n.local_world_size + ')', '');
  for (const [id, e] of (lost.get(r.run_id) || new Map())) {
    if (!present.has(id)) rows += nodeRow('lost', e, '&ndash;', '&ndash;',
        esc(e.cause) + ' in round ' + e.round + ' at ' + clock(e));
  }
  const phase = r.result === 'failed' ? 'failed' : r.phase;
  const label = r.result ? r.phase + ' (' + r.result + ')' : r.phase;
  let failure = '';
  if (r.last_failure) {
    const f = r.last_failure;
    failure = `<div class="failure"><b>Last failure:</b> rank ${f.rank} on ${esc(f.host)}, ` +
        `${ended(f)}, round ${f.round}, ${dur(f.age_ms)} ago &mdash; ${esc(f.reason)}</div>`;
  }
  // --watch_stragglers (docs/stragglers.md): the ranks named now.
  for (const s of (r.stragglers || [])) {
    failure += `<div class="straggler"><b>Straggler:</b> rank ${s.rank} on ${esc(s.host)}, ` +
        `${s.slowdown.toFixed(1)}x the others' own work per step (${esc(s.cause)}), named at ` +
        `step ${s.step}, ${dur(s.age_ms)} ago${s.kept ? '; kept: ' + esc(s.kept) : ''}</div>`;
  }
  // --exclude_stragglers: the nodes excluded, and how long each stays out.
  for (const x of (r.excluded || [])) {
    failure += `<div class="straggler"><b>Excluded:</b> ${esc(x.node_id)} on ${esc(x.host)}, ` +
        `${x.slowdown.toFixed(1)}x (${esc(x.cause)}), ${x.times} time(s)` +
        (x.left_ms > 0 ? `, out for ${dur(x.left_ms)} more` : ', may join again') + `</div>`;
  }
  return `<section class="card run" data-run="${esc(r.run_id)}" data-phase="${esc(r.phase)}" ` +
      `data-round="${r.round}"><div class="run-head"><h2>run <code>${esc(r.run_id)}</code></h2>` +
      `<span class="phase phase-${esc(phase)}">${esc(label)}</span></div>` +
      `<dl class="facts"><div><dt>round</dt><dd class="round">${r.round}</dd></div>` +
      `<div><dt>restarts</dt><dd>${r.restart_count}/${r.max_restarts}</dd></div>` +
      `<div><dt>in place</dt><dd class="in-place">${r.in_place_recoveries}` +
      (r.in_place_fallbacks ? ` (${r.in_place_fallbacks} fell back)` : '') + `</dd></div>` +
      `<div><dt>nodes</dt><dd>${r.members.length} (${r.min_nodes}:${r.max_nodes})</dd></div>` +
      `<div><dt>world size</dt><dd>${r.world_size}</dd></div>` +
      `<div><dt>waiting</dt><dd>${r.waiting.length}</dd></div>` +
      `<div><dt>in phase</dt><dd>${dur(r.phase_age_ms)}</dd></div></dl>` +
      (rows ? `<table class="nodes"><thead><tr><th>state</th><th>group rank</th><th>ranks</th>` +
              `<th>host</th><th>node</th><th></th></tr></thead><tbody>${rows}</tbody></table>` : '') +
      failure + (r.last_recovery ? recoveryHtml(r.last_recovery) : '') + `</section>`;
}

function describe(e) {
  const node = e.node ? `node <code>${esc(e.node)}</code>` + (e.host ? ` (${esc(e.host)})` : '') : '';
  switch (e.event) {
    case 'node_joined': return `${node} joined`;
    case 'node_lost': return `${node} lost: ${esc(e.cause)}${e.member ? ' (a member)' : ''}`;
    case 'round_formed': return `round ${e.round}: ${e.nodes} node(s), world size ${e.world_size}` +
        (e.spares ? `, ${e.spares} spare(s)` : '') + (e.in_place ? `, ${e.in_place} in place` : '') +
        (e.took_ms != null ? `, ${dur(e.took_ms)} after the restart` : '');
    case 'in_place_resumed': return `${node} resumed in place (${e.resumed}/${e.in_place}): abort ` +
        `${dur(e.abort_ms)}, rendezvous ${dur(e.rendezvous_ms)}, re-form ${dur(e.reform_ms)}; ` +
        `${dur(e.took_ms)} after the restart`;
    case 'in_place_fallback': return `${node}: in-place recovery fell back: ${esc(e.reason)}`;
    case 'straggler_named': return `straggler: ${esc(e.reason)}`;
    case 'straggler_cleared': return `straggler cleared: ${esc(e.reason)}`;
    case 'straggler_excluded': return `excluded: ${esc(e.reason)}`;
    case 'worker_failed': return `rank ${e.rank} on ${esc(e.host)} failed: ${ended(e)}`;
    case 'restart': return `restart (${esc(e.cause)}${e.counts ? ', counts' : ''}): ${esc(e.reason)}`;
    case 'succeeded': return 'the run succeeded';
    case 'failed': return `the run failed (${esc(e.cause)}): ${esc(e.reason)}`;
  }
  return '';
}

function render(status) {
  const runs = status.runs.map(runHtml).join('') || '<p class="empty">no runs</p>';
  if (runs !== shownRuns) { document.getElementById('runs').innerHTML = runs; shownRuns = runs; }
  const list = events.slice().reverse().map((e) =>
      `<li class="ev ev-${esc(e.event)}" data-seq="${e.seq}"><time>${clock(e)}</time> ` +
      `<span class="ev-name">${esc(e.event)}</span> <code>${esc(e.run)}</code> ${describe(e)}</li>`).join('') ||
      '<li class="empty">none yet</li>';
  if (list !== shownEvents) { document.getElementById('events').innerHTML = list; shownEvents = list; }
  const nodes = status.runs.reduce((n, r) => n + r.members.length + r.waiting.length, 0);
  document.getElementById('summary').textContent =
      `${status.runs.length} run(s), ${nodes} node(s), updated ${new Date().toLocaleTimeString([], {hour12: false})}`;
}

function connection(ok, why) {
  const c = document.getElementById('conn');
  c.className = 'conn ' + (ok ? 'ok' : 'bad');
  c.textContent = ok ? 'live' : 'no answer: ' + why;
}

async function getJson(url) {
  const r = await fetch(url, {cache: 'no-store'});
  if (!r.ok) throw new Error(url + ': HTTP ' + r.status);
  return r.json();
}

async function poll() {
  try {
    const feed = await getJson('/api/events?since=' + since);
    ingest(feed);
    render(await getJson('/api/status'));
    connection(true);
  } catch (err) {
    connection(false, err.message);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}
poll();
</script>
</body>
</html>
)HTML";

}  // namespace muster::rdzvd
