// tlt-scheduler status page: the job list and, for one job, the live per-GPU timeline.
// Plain JS over the REST API (docs/api.md); no build step. Every REFRESH_MS: new events and the
// worker table; every SLOW_EVERY-th refresh (and when the job changes): the job list, new step
// records and the draft history, which change once per step or lease, not per second.
"use strict";
const REFRESH_MS = 2000;
const SLOW_EVERY = 5;
const STATES = ["ROLLING_OUT", "IDLE", "TRAINING", "SWAPPING", "FAILED"];
let selected = new URLSearchParams(location.search).get("job");
const seen = { job: null, events: [], steps: [], jobRecord: null, drafts: null };  // events fetched so far for the selected job: later polls ask only for new ones

// With an API token configured on the scheduler, job details need it: asked for once on a 401, kept for
// this tab only (sessionStorage), sent as a bearer token.
const TOKEN_KEY = "tlt-api-token";

async function get(path) {
  const headers = { Accept: "application/json" };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  const r = await fetch(path, { headers });
  if (r.status === 401) {
    const entered = window.prompt("This scheduler needs its API token to show job details:");
    if (entered) {
      sessionStorage.setItem(TOKEN_KEY, entered.trim());
      return get(path);
    }
  }
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

function cell(row, text) {
  const td = document.createElement("td");
  td.textContent = text;
  row.appendChild(td);
  return td;
}

// a QUEUED job's state with its place in line: "QUEUED #2" (1 starts next)
function stateText(j) {
  return j.queue_position ? `${j.state} #${j.queue_position}` : j.state;
}

function renderJobs(jobs) {
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren();
  for (const j of jobs) {
    const tr = document.createElement("tr");
    tr.dataset.job = j.job_id;
    if (j.job_id === selected) tr.classList.add("selected");
    [j.job_id, stateText(j), j.spec.model, j.spec.num_workers, j.spec.tlt ? "on" : "off", j.steps,
     new Date(j.created_at * 1000).toLocaleString()].forEach((t) => cell(tr, String(t)));
    tr.addEventListener("click", () => {
      selected = j.job_id;
      history.replaceState(null, "", `?job=${selected}`);
      refresh();
    });
    body.appendChild(tr);
  }
  if (!selected && jobs.length) selected = jobs[0].job_id;
}

// events (oldest first) -> per worker [{state, start, end}], a state lasting until the worker's next event
function spans(events, now) {
  const byWorker = new Map();
  for (const e of events) {
    if (!byWorker.has(e.worker)) byWorker.set(e.worker, []);
    const list = byWorker.get(e.worker);
    if (list.length) list[list.length - 1].end = e.ts;
    list.push({ state: e.to, start: e.ts, end: now, step: e.rl_step });
  }
  return byWorker;
}

function renderTimeline(events, steps, job) {
  const box = document.getElementById("timeline");
  box.replaceChildren();
  if (!events.length) {
    box.textContent = "no worker events yet";
    return;
  }
  const t0 = events[0].ts;
  const end = job.state === "RUNNING" ? Date.now() / 1000 : Math.max(...events.map((e) => e.ts));
  const width = Math.max(end - t0, 1e-3);
  const pct = (t) => `${(100 * (t - t0)) / width}%`;
  const stepStarts = new Map();
  for (const e of events) if (e.to === "ROLLING_OUT" && !stepStarts.has(e.rl_step)) stepStarts.set(e.rl_step, e.ts);
  const workers = [...spans(events, end).entries()].sort(([a], [b]) => a.localeCompare(b, undefined, { numeric: true }));
  for (const [worker, list] of workers) {
    const row = document.createElement("div");
    row.className = "row";
    row.dataset.worker = worker;
    const label = document.createElement("span");
    label.className = "label";
    label.textContent = worker;
    const track = document.createElement("div");
    track.className = "track";
    for (const s of list) {
      const span = document.createElement("div");
      span.className = `span ${STATES.includes(s.state) ? s.state : "IDLE"}`;
      span.style.left = pct(s.start);
      span.style.width = `${(100 * (s.end - s.start)) / width}%`;
      span.title = `${worker} ${s.state} step ${s.step}: ${(s.end - s.start).toFixed(1)} s`;
      track.appendChild(span);
    }
    for (const [, ts] of stepStarts) {
      const mark = document.createElement("div");
      mark.className = "step-mark";
      mark.style.left = pct(ts);
      track.appendChild(mark);
    }
    row.append(label, track);
    box.appendChild(row);
  }
  const axis = document.createElement("div");
  axis.className = "axis";
  for (const [step, ts] of stepStarts) {
    const s = document.createElement("span");
    s.style.left = pct(ts);
    s.textContent = `step ${step}`;
    axis.appendChild(s);
  }
  box.appendChild(axis);
}

function renderFigures(steps, drafts) {
  const idle = steps.reduce((a, s) => a + s.idle_worker_s, 0);
  const reclaimed = drafts.reclaimed_worker_s;
  const last = steps[steps.length - 1];
  const figures = [
    ["reclaimed / idle", idle > 0 ? `${Math.round((100 * reclaimed) / idle)}%` : "-"],
    ["idle worker-s", idle.toFixed(1)],
    ["reclaimed worker-s", reclaimed.toFixed(1)],
    ["draft served", drafts.serving_version === null ? "v0" : `v${drafts.serving_version}`],
    ["published / rejected", `${drafts.num_published} / ${drafts.num_rejected}`],
    ["accepted length (last step)", last ? last.mean_accepted_length.toFixed(2) : "-"],
  ];
  const box = document.getElementById("figures");
  box.replaceChildren();
  for (const [name, value] of figures) {
    const div = document.createElement("div");
    div.className = "figure";
    div.dataset.figure = name;
    const b = document.createElement("b");
    b.textContent = value;
    div.append(b, document.createTextNode(name));
    box.appendChild(div);
  }
}

function renderWorkers(workers) {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren();
  for (const w of workers) {
    const tr = document.createElement("tr");
    [w.worker_id, w.state, w.scheduler_class || "", `${w.num_finished}/${w.num_total}`, w.tokens_per_s.toFixed(1),
     w.mean_accepted_length.toFixed(2), `v${w.draft_version}`, w.rl_step].forEach((t) => cell(tr, String(t)));
    body.appendChild(tr);
  }
}

let tick = 0;
async function refresh() {
  const status = document.getElementById("status");
  const slow = tick++ % SLOW_EVERY === 0;
  try {
    if (slow || !selected) renderJobs(await get("/v1/jobs?limit=50"));
    if (selected) {
      const freshJob = seen.job !== selected;
      if (freshJob) Object.assign(seen, { job: selected, events: [], steps: [], jobRecord: null, drafts: null });
      const last = seen.events.length ? `?after=${seen.events[seen.events.length - 1].id}` : "";
      const job = `/v1/jobs/${selected}`;
      const [fresh, workers] = await Promise.all([get(`${job}/events${last}`), get(`${job}/workers`)]);
      if (slow || freshJob || !seen.jobRecord) {
        const [record, newSteps, drafts] = await Promise.all([
          get(job), get(`${job}/steps?start=${seen.steps.length}`), get(`${job}/drafts`)]);
        Object.assign(seen, { jobRecord: record, drafts });
        seen.steps.push(...newSteps);
      }
      seen.events.push(...fresh);
      document.getElementById("job-section").hidden = false;
      document.getElementById("job-id").textContent = seen.jobRecord.job_id;
      document.getElementById("job-state").textContent = stateText(seen.jobRecord);
      renderFigures(seen.steps, seen.drafts);
      renderTimeline(seen.events, seen.steps, seen.jobRecord);
      renderWorkers(workers);
    }
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    status.textContent = `cannot reach the scheduler: ${err.message}`;
  }
}

refresh();
setInterval(refresh, REFRESH_MS);
