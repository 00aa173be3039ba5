// The llmserver console: one page over the server's own HTTP API. The API key lives in this tab's
// sessionStorage only; every call goes to this origin; nothing is loaded from anywhere else.

const KEY_SLOT = "llmserver.key";
const OPEN_SLOT = "llmserver.conversation"; // the id of the conversation open in this tab, for a reload
const $ = (selector, root = document) => root.querySelector(selector);
const state = { me: null, tab: null, timer: null, rows: [], abort: null, sodium: null, chat: null, chats: null, vault: null, editing: null };
const PAGES = ["overview", "models", "keys", "teams", "usage", "audit", "playground"];
const ADMIN_PAGES = ["overview", "models", "teams", "audit"];
const MANAGER_PAGES = ["keys"]; // admin keys, and team admin keys for their own team's keys

// ---- HTTP -------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.type = error.type;
    this.param = error.param;
  }
}

function authHeaders(extra = {}) {
  return { Authorization: `Bearer ${sessionStorage.getItem(KEY_SLOT) || ""}`, ...extra };
}

async function api(path, { method = "GET", body, key, extra = {} } = {}) {
  const headers = { ...(key ? { Authorization: `Bearer ${key}` } : authHeaders()), ...extra };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const answer = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await answer.json().catch(() => null);
  if (!answer.ok) {
    const error = new ApiError(answer.status, data);
    if (answer.status === 401 && !key && state.me) signOut(`Signed out: the server refused this key (${error.message})`);
    throw error;
  }
  return data;
}

// ---- Small helpers ----------------------------------------------------------------------------

function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "onclick") node.addEventListener("click", value);
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child ?? "")));
  return node;
}

const number = (value, digits = 0) =>
  value === null || value === undefined ? "–" : Number(value).toLocaleString(undefined, { maximumFractionDigits: digits });

function duration(seconds) {
  if (!seconds) return "–";
  const d = Math.floor(seconds / 86400), h = Math.floor((seconds % 86400) / 3600), m = Math.floor((seconds % 3600) / 60);
  return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : `${m}m ${seconds % 60}s`;
}

const localTime = (value) => (value ? new Date(typeof value === "number" ? value * 1000 : value).toLocaleString() : "–");

function say(id, text, isError = false) {
  const node = document.getElementById(id);
  node.textContent = text;
  node.classList.toggle("error", isError);
}

// A status line that the page's periodic refresh leaves alone for a while, so that it can be read.
function tell(id, text, isError = false) {
  const node = document.getElementById(id);
  node.dataset.sticky = "1";
  say(id, text, isError);
  clearTimeout(node.stickyTimer);
  node.stickyTimer = setTimeout(() => delete node.dataset.sticky, 6000);
}

async function copy(text, button) {
  await navigator.clipboard.writeText(text).catch(() => {});
  const label = button.textContent;
  button.textContent = "Copied";
  setTimeout(() => (button.textContent = label), 1200);
}

// ---- Sign-in and navigation -------------------------------------------------------------------

async function signIn(key) {
  const me = await api("/api/me", { key });
  forget();
  sessionStorage.setItem(KEY_SLOT, key);
  state.me = me;
  $("#sign-in").hidden = true;
  $("#tabs").hidden = false;
  $("#who").hidden = false;
  $("#who-name").textContent = `${me.name}${me.admin ? " (admin)" : me.team_admin ? ` (admin of team ${me.team.name})` : ""}`;
  for (const button of document.querySelectorAll("#tabs button")) {
    button.hidden = ("admin" in button.dataset && !me.admin) || ("manager" in button.dataset && !manages());
  }
  // A team admin's keys are its team's: it picks no team and makes no admin keys (the server refuses both).
  for (const node of document.querySelectorAll("[data-admin-only]")) node.hidden = !me.admin;
  for (const node of document.querySelectorAll(".currency")) node.textContent = me.server.currency;
  show(allowed(pageInUrl()) ? pageInUrl() : me.admin ? "overview" : me.team_admin ? "keys" : "playground", { focus: true });
}

function signOut(reason = "") {
  sessionStorage.removeItem(KEY_SLOT);
  sessionStorage.removeItem(OPEN_SLOT);
  state.me = null;
  clearInterval(state.timer);
  if (state.abort) state.abort.abort();
  forget();
  for (const section of document.querySelectorAll("main > section")) section.hidden = section.id !== "sign-in";
  $("#tabs").hidden = true;
  $("#who").hidden = true;
  $("#who-name").textContent = "";
  $("#api-key").value = "";
  history.replaceState(null, "", window.location.pathname); // the next key starts on its own first page
  say("sign-in-error", typeof reason === "string" ? reason : "", typeof reason === "string" && Boolean(reason));
  $("#api-key").focus();
}

// Nothing of a session outlives it: every page's contents, the forms, what the page fetched.
function forget() {
  for (const body of document.querySelectorAll("main table tbody")) body.replaceChildren();
  for (const chart of document.querySelectorAll(".chart")) chart.replaceChildren();
  for (const status of document.querySelectorAll("main .status, main .error, main .field-error")) status.textContent = "";
  for (const form of document.querySelectorAll("main form:not(#sign-in-form)")) form.reset();
  $("#new-key-value").textContent = "";
  $("#new-key").hidden = true;
  closeLog();
  $("#usage-key").replaceChildren();
  $("#usage-key-field").hidden = true;
  $("#usage-keys-part").hidden = true;
  $("#usage-teams-part").hidden = true;
  $("#key-team").replaceChildren(el("option", { value: "" }, "none"));
  $("#usage-quota").hidden = true;
  $("#usage-quota").textContent = "";
  $("#log-model").replaceChildren(el("option", { value: "" }, "All models"));
  $("#log-newer").disabled = $("#log-older").disabled = true;
  modelForm(true);
  $("#play-model").replaceChildren();
  $("#chats").replaceChildren();
  $("#play-editing").hidden = true;
  $("#play-code").textContent = "";
  $("#play-code").hidden = true;
  for (const stat of document.querySelectorAll("#play-stats dd")) stat.textContent = "–";
  $("#audit-action").replaceChildren(el("option", { value: "" }, "All actions"));
  $("#audit-newer").disabled = $("#audit-older").disabled = true;
  for (const page of ["overview", "models", "keys", "teams", "usage", "audit"]) fresh(page);
  // The key derived for the kept conversations goes too: what IndexedDB holds cannot be read without the API key.
  Object.assign(state, { tab: null, rows: [], keys: [], teams: [], models: {}, chat: newChat(), chats: null, vault: null, editing: null, log: null, audit: null });
  renderConversation();
}

const pageInUrl = () => window.location.hash.replace(/^#\/?/, "");
const manages = () => Boolean(state.me?.admin || state.me?.team_admin);
const allowed = (tab) =>
  Boolean(state.me) && PAGES.includes(tab) && !(ADMIN_PAGES.includes(tab) && !state.me.admin) && !(MANAGER_PAGES.includes(tab) && !manages());

function show(tab, { focus = false } = {}) {
  if (!allowed(tab)) return; // signed out, or a page this key may not see
  state.tab = tab;
  clearInterval(state.timer);
  if (pageInUrl() !== tab) history.replaceState(null, "", `#/${tab}`);
  for (const section of document.querySelectorAll("main > section")) section.hidden = section.id !== tab;
  for (const button of document.querySelectorAll("#tabs button")) {
    button.setAttribute("aria-selected", String(button.dataset.tab === tab));
    button.tabIndex = button.dataset.tab === tab ? 0 : -1; // one Tab stop for the tab list; arrows move within it
  }
  if (focus) document.getElementById(`${tab}-title`).focus();
  ({ overview: startOverview, models: startModels, keys: startKeys, teams: startTeams, usage: loadUsage, audit: startAudit, playground: loadPlayground })[tab]();
}

// The tab list as ARIA's pattern has it: Left/Right (wrapping), Home and End move to a tab and open it.
function tabKeys(event) {
  const tabs = [...document.querySelectorAll("#tabs button:not([hidden])")];
  const at = tabs.indexOf(document.activeElement);
  if (at < 0) return;
  const to = { ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: tabs.length - 1 }[event.key];
  if (to === undefined) return;
  event.preventDefault();
  const next = tabs[(to + tabs.length) % tabs.length];
  next.focus();
  show(next.dataset.tab);
}

// ---- Overview ---------------------------------------------------------------------------------

function startOverview() {
  refreshOverview();
  state.timer = setInterval(refreshOverview, 2000);
}

async function refreshOverview() {
  let listed;
  try {
    listed = await api("/api/instances");
  } catch (error) {
    stale("overview", "overview-status", error, 2);
    return;
  }
  fresh("overview");
  const models = $("#models-table tbody");
  models.replaceChildren(
    ...listed.models.map((m) =>
      el("tr", {},
        el("td", {}, m.model), el("td", { class: "num" }, m.instances), el("td", { class: "num" }, m.queue_depth),
        el("td", { class: "num" }, number(m.tokens_per_second_5m, 1)), el("td", { class: "num" }, number(m.avg_tokens_per_second, 1)),
        el("td", { class: "actions" }, el("button", { type: "button", onclick: () => startInstance(m.model), "aria-label": `Start instance of ${m.model}` }, "Start instance")),
      ),
    ),
  );
  const instances = $("#instances-table tbody");
  instances.replaceChildren(
    ...listed.data.map((i) =>
      el("tr", { "data-instance": i.instance_id },
        el("td", {}, el("code", {}, i.instance_id)), el("td", {}, i.model),
        el("td", {}, el("span", { class: `badge ${i.status}` }, i.status)),
        el("td", {}, i.host), el("td", { class: "num" }, i.port), el("td", { class: "num pid" }, i.pid || "–"),
        el("td", { class: "num" }, i.active_users), el("td", { class: "num" }, number(i.ram_used_mb)),
        el("td", { class: "num" }, number(i.cpu_percent, 1)), el("td", {}, duration(i.uptime_seconds)),
        el("td", {}, localTime(i.last_activity)),
        el("td", { class: "actions" }, el("span", {},
          el("button", { type: "button", onclick: () => showLog(i.instance_id), "aria-label": `Log of instance ${i.instance_id}` }, "Log"), " ",
          el("button", { type: "button", onclick: () => drainInstance(i.instance_id), "aria-label": `Drain instance ${i.instance_id}` }, "Drain"))),
      ),
    ),
  );
  if (!$("#overview-status").dataset.sticky) say("overview-status", `Updated ${new Date().toLocaleTimeString()}`);
}

// A page whose server did not answer: its tables are as of the last answer, greyed, and no action may be
// taken on them until it answers again (every `every` seconds).
function stale(page, statusId, error, every) {
  if (!state.me) return;
  const section = document.getElementById(page);
  section.dataset.lostAt ??= new Date().toLocaleTimeString();
  section.classList.add("stale");
  for (const button of section.querySelectorAll("tbody button, form button[type=submit]")) button.disabled = true;
  const reason = error instanceof ApiError ? error.message : `the server cannot be reached (${error.message})`;
  say(statusId, `Not up to date: ${reason}, since ${section.dataset.lostAt}. Trying again every ${every} s.`, true);
}

// A page whose server answered again: its actions back; true if it had been stale.
function fresh(page) {
  const section = document.getElementById(page);
  const was = section.classList.contains("stale");
  delete section.dataset.lostAt;
  section.classList.remove("stale");
  if (was) for (const button of section.querySelectorAll("form button[type=submit]")) button.disabled = false;
  return was;
}

async function act(statusId, working, action) {
  document.getElementById(statusId).dataset.sticky = "1"; // kept while the action runs, however long
  say(statusId, working);
  try {
    tell(statusId, await action());
  } catch (error) {
    tell(statusId, error.message, true);
  }
}

function startInstance(model) {
  act("overview-status", `Starting an instance of ${model}…`, async () => {
    const started = await api("/api/instances", { method: "POST", body: { model } });
    refreshOverview();
    return `Started instance ${started.instance_id} of ${model} (pid ${started.pid}).`;
  });
}

// An instance's last log lines, as the server reads them (keys masked), under the table.
async function showLog(id) {
  const panel = $("#instance-log"), lines = $("#instance-log-lines");
  panel.hidden = false;
  panel.dataset.instance = id;
  $("#instance-log-title").textContent = `Log of instance ${id}: its last ${LOG_LINES} lines`;
  lines.textContent = "Reading…";
  $("#instance-log-title").focus();
  try {
    const tail = await api(`/api/instances/${encodeURIComponent(id)}/log?lines=${LOG_LINES}`);
    lines.textContent = tail.lines.join("\n") || "(its log is empty)";
  } catch (error) {
    lines.textContent = error instanceof ApiError ? error.message : `The server cannot be reached (${error.message}).`;
  }
  lines.scrollTop = lines.scrollHeight; // the newest lines in view
}

function closeLog() {
  $("#instance-log").hidden = true;
  $("#instance-log-lines").textContent = "";
}

function drainInstance(id) {
  if (!confirm(`Drain instance ${id}? It takes no new requests, finishes those in flight, then stops.`)) return;
  act("overview-status", `Draining instance ${id}…`, async () => {
    await api(`/api/instances/${encodeURIComponent(id)}`, { method: "DELETE" });
    refreshOverview();
    return `Instance ${id} drained and stopped.`;
  });
}

// ---- Models -----------------------------------------------------------------------------------

const LOG_LINES = 100;
const MODEL_NUMBERS = { min_instances: [0, 64], max_instances: [0, 64], parallel: [1, 256], ctx_size: [128, 1048576], idle_timeout: [1, null] };
const MODEL_TEXTS = ["path", "hf_repo", "hf_file"];

function startModels() {
  loadCatalog();
  state.timer = setInterval(loadCatalog, 3000);
}

async function loadCatalog() {
  let catalog, running;
  try {
    [catalog, running] = await Promise.all([api("/api/models"), api("/api/instances")]);
  } catch (error) {
    stale("models", "catalog-status", error, 3);
    return;
  }
  if (state.tab !== "models") return;
  fresh("models");
  const where = (name) => running.data.filter((i) => i.model === name);
  // A gateway that shares its database with others serves its own config file's models besides the
  // catalog's, without writing them there: shown too, as this gateway's, with nothing to change here.
  const listed = new Set(catalog.data.map((m) => m.name));
  const own = running.models.filter((m) => !listed.has(m.model)).map((m) => ({
    name: m.model, origin: "file (this gateway)", revision: null, settings: null, updated_at: null, queue_depth: m.queue_depth,
    instances: m.instances, ready_instances: where(m.model).filter((i) => i.status === "ready" || i.status === "busy").length,
  }));
  const models = [...catalog.data, ...own];
  $("#catalog-table tbody").replaceChildren(...models.map((m) => catalogRow(m, where(m.name))));
  if (!$("#catalog-status").dataset.sticky) say("catalog-status", `${models.length} model${models.length === 1 ? "" : "s"}; updated ${new Date().toLocaleTimeString()}`);
}

function catalogRow(m, instances) {
  const s = m.settings ?? {}, fixed = m.origin !== "api";
  const source = !m.settings ? "–" : s.hf_repo ? `${s.hf_repo}${s.hf_file ? ` / ${s.hf_file}` : ""}` : s.path || "embedded default";
  const because = fixed ? "it comes from the server's config file: change it there" : null;
  const bounds = m.settings ? ` (${s.min_instances}–${s.max_instances})` : "";
  return el("tr", { "data-model": m.name },
    el("td", { class: "name", "data-label": "Model" }, m.name, s.embedding ? " (embedding)" : ""), el("td", { class: "source", "data-label": "Source" }, source), el("td", { "data-label": "Origin" }, m.origin),
    el("td", { class: "num", "data-label": "Revision" }, m.revision ?? "–"),
    el("td", { "data-label": "Instances" }, el("span", { class: "scale" },
      el("button", { type: "button", class: "small", disabled: fixed || s.max_instances <= 0, title: because, onclick: () => scaleModel(m, -1), "aria-label": s.min_instances > 0 ? `Keep one instance fewer of ${m.name} running` : `Stop ${m.name}` }, "−"),
      ` ${m.ready_instances ?? 0} ready of ${m.instances ?? 0}${bounds} `,
      el("button", { type: "button", class: "small", disabled: fixed || s.min_instances >= 64, title: because, onclick: () => scaleModel(m, 1), "aria-label": `Keep one instance more of ${m.name} running` }, "+")),
      ...modelProblems(m)),
    el("td", { "data-label": "Running on" }, instances.length ? el("ul", { class: "plain" }, ...instances.map((i) => el("li", {}, `${i.node ? `${i.node} ` : ""}${i.host}:${i.port} `, el("span", { class: `badge ${i.status}` }, i.status)))) : "none"),
    el("td", { class: "num", "data-label": "Queue" }, m.queue_depth ?? 0),
    el("td", { "data-label": "Changed" }, localTime(m.updated_at)),
    el("td", { class: "actions" }, el("span", {},
      el("button", { type: "button", disabled: fixed, title: because, onclick: () => editModel(m), "aria-label": `Edit ${m.name}` }, "Edit"), " ",
      el("button", { type: "button", disabled: fixed, title: because, onclick: () => removeModel(m), "aria-label": `Remove ${m.name}` }, "Remove"))),
  );
}

// What keeps a model from serving, at its row: why it is blocked, its file downloading, and (while it has
// no ready instance or is blocked) its last failed start, the instance's last log lines a click away.
function modelProblems(m) {
  const shown = [];
  if (m.blocked) shown.push(el("div", { class: "problem" }, m.blocked));
  for (const f of m.fetching ?? []) {
    const part = f.total ? ` ${Math.floor((100 * f.bytes) / f.total)}% of ${number(f.total / 2 ** 20, 1)} MiB` : ` ${number(f.bytes / 2 ** 20, 1)} MiB`;
    shown.push(el("div", { class: "hint fetching" }, `downloading its file${f.node ? ` on ${f.node}` : ""}:${part}`));
  }
  const failed = m.last_start_failure;
  if (failed && (m.blocked || !m.ready_instances)) {
    shown.push(el("details", { class: "start-failure" },
      el("summary", {}, `last start failed ${localTime(failed.at)}${failed.node ? ` on ${failed.node}` : ""}`),
      el("div", { class: "problem" }, failed.message),
      el("pre", {}, (failed.log ?? []).join("\n") || "(its log is empty)")));
  }
  return shown;
}

function modelForm(reset = false) {
  return clearForm($("#model-form"), "model-error", reset && { title: "Add a model", submit: "Add" });
}

function editModel(m) {
  const form = modelForm(true);
  form.elements.editing.value = m.name;
  form.elements.name.value = m.name;
  form.elements.name.disabled = true;
  for (const name of MODEL_TEXTS) form.elements[name].value = m.settings[name] ?? "";
  for (const name of Object.keys(MODEL_NUMBERS)) form.elements[name].value = m.settings[name] ?? "";
  form.elements.embedding.checked = Boolean(m.settings.embedding);
  $("#model-form-title").textContent = `Edit ${m.name} (changes that need a restart roll its instances over one by one)`;
  $("#model-submit").textContent = "Save";
  $("#model-cancel").hidden = false;
  form.elements.path.focus();
}

// The fields as the API takes them, and every problem found before sending (the server checks again).
function modelBody(form, editing) {
  const problems = {}, body = {};
  if (!editing) {
    const name = form.elements.name.value.trim();
    if (!name) problems.name = "A name is required.";
    body.name = name;
  }
  for (const name of MODEL_TEXTS) {
    const raw = form.elements[name].value.trim();
    if (raw || editing) body[name] = raw || null;
  }
  for (const [name, [low, high]] of Object.entries(MODEL_NUMBERS)) {
    const raw = form.elements[name].value.trim();
    if (raw === "") {
      if (editing) body[name] = null;
      continue;
    }
    const value = Number(raw);
    if (!Number.isFinite(value) || (name !== "idle_timeout" && !Number.isInteger(value)) || value < low || (high !== null && value > high))
      problems[name] = `${name === "idle_timeout" ? "Seconds" : "A whole number"} from ${low}${high !== null ? ` to ${high}` : " up"}.`;
    else body[name] = value;
  }
  if (body.min_instances !== undefined && body.max_instances !== undefined && body.min_instances > body.max_instances && body.max_instances !== null)
    problems.max_instances ??= "At least as many as are kept running.";
  if (form.elements.embedding.checked || editing) body.embedding = form.elements.embedding.checked;
  const more = form.elements.more.value.trim();
  if (Boolean(body.hf_repo) !== Boolean(body.hf_file)) problems[body.hf_repo ? "hf_file" : "hf_repo"] ??= "A Hugging Face repository and a file in it go together.";
  if (body.hf_repo && body.path) problems.path ??= "A file on this host, or a Hugging Face repository and file: not both.";
  if (more) {
    let extra = null;
    try {
      extra = JSON.parse(more);
    } catch (error) {
      problems.more = `Not JSON: ${error.message}`;
    }
    if (extra !== null && (typeof extra !== "object" || Array.isArray(extra))) problems.more = "A JSON object of settings, such as {\"cache_ram_mb\": 2048}.";
    else if (extra) Object.assign(body, extra);
  }
  return { body, problems };
}

async function submitModel(event) {
  event.preventDefault();
  const form = modelForm();
  const editing = form.elements.editing.value;
  const { body, problems } = modelBody(form, editing);
  const found = Object.entries(problems);
  if (found.length) {
    for (const [name, message] of found) fieldError(form, name, message);
    form.elements[found[0][0]].focus();
    return;
  }
  try {
    const saved = editing
      ? await api(`/api/models/${encodeURIComponent(editing)}`, { method: "PATCH", body })
      : await api("/api/models", { method: "POST", body });
    tell("catalog-status", editing ? `${saved.name} saved (revision ${saved.revision}).` : `${saved.name} added: its instances start on the hosts that may run it.`);
    modelForm(true);
    loadCatalog();
  } catch (error) {
    // The API names the field at fault: shown there (a setting given in the JSON box, at that box, in the
    // API's own words as the box takes them).
    showRefusal(form, error, "model-error", "more");
  }
}

async function scaleModel(m, step) {
  // − below no instance kept running stops the model (max_instances 0: its instances drain now); idle
  // instances above a lowered minimum stop at once on the server, busy ones once idle.
  if (step < 0 && m.settings.min_instances <= 0) {
    if (!confirm(`Stop ${m.name}? Its instances drain now, and requests for it are answered 503 until it is started again (+).`)) return;
    try {
      await api(`/api/models/${encodeURIComponent(m.name)}/stop`, { method: "POST" });
      tell("catalog-status", `${m.name} stopped: its instances drain.`);
      loadCatalog();
    } catch (error) {
      tell("catalog-status", error.message, true);
    }
    return;
  }
  // + keeps one more running, raising the most instances with it when they meet; − keeps one fewer and,
  // where the most was the number kept (as + leaves it), lowers that too, so that one fewer runs rather
  // than one fewer being kept while as many may still run. A range above the number kept stays.
  const s = m.settings, min = s.min_instances + step;
  const max = step > 0 ? Math.max(s.max_instances, min) : s.max_instances === s.min_instances ? Math.max(min, 1) : s.max_instances;
  const body = { min_instances: min, ...(max !== s.max_instances ? { max_instances: max } : {}) };
  try {
    await api(`/api/models/${encodeURIComponent(m.name)}`, { method: "PATCH", body });
    tell("catalog-status", `${m.name}: ${keptText(min, max)}${step < 0 ? "; the idle ones above that stop now" : ""}.`);
    loadCatalog();
  } catch (error) {
    tell("catalog-status", error.message, true);
  }
}

// How many instances of a model run, as its bounds say: those kept running and the most under load.
function keptText(min, max) {
  const kept = min === 0 ? "none kept running" : `${min} instance${min === 1 ? "" : "s"} kept running`;
  return min === max ? kept : `${kept}, up to ${max} ${min === 0 ? "started as requests come" : "under load"}`;
}

async function removeModel(m) {
  if (!confirm(`Remove the model ${m.name}? Its instances drain and stop, and requests for it are answered 404.`)) return;
  try {
    await api(`/api/models/${encodeURIComponent(m.name)}`, { method: "DELETE" });
    tell("catalog-status", `${m.name} removed: its instances drain and stop.`);
    loadCatalog();
  } catch (error) {
    tell("catalog-status", error.message, true);
  }
}

// ---- Keys -------------------------------------------------------------------------------------

// The keys, refreshed every 5 s while the page is shown (a quota's standing moves with every request), so
// that the page also comes back by itself after an outage.
function startKeys() {
  loadKeys();
  state.timer = setInterval(loadKeys, 5000);
}

async function loadKeys() {
  let listed;
  try {
    [listed] = await Promise.all([api("/api/keys"), state.me.admin ? loadTeamNames() : null]);
  } catch (error) {
    stale("keys", "keys-status", error, 5);
    return;
  }
  if (state.tab !== "keys") return;
  if (fresh("keys")) say("keys-status", `Up to date again (${new Date().toLocaleTimeString()}).`);
  state.keys = listed.data;
  $("#keys-table tbody").replaceChildren(
    ...listed.data.map((k) =>
      el("tr", { "data-key": k.id },
        el("td", { class: "name" }, k.name), el("td", {}, el("code", {}, k.id)), el("td", {}, k.admin ? "admin" : k.team_admin ? "team admin" : ""),
        el("td", { class: "team" }, teamName(k.team_id)),
        el("td", { class: "num" }, number(k.quota_tokens)), el("td", {}, k.quota_period || "–"), el("td", { class: "quota" }, quotaText(k.quota)),
        el("td", { class: "budget" }, budgetNow(k.spend)),
        el("td", { class: "num" }, number(k.rpm)), el("td", { class: "num" }, number(k.max_concurrency)),
        el("td", { class: "models" }, k.models ? k.models.join(", ") || "none" : "all"),
        el("td", {}, localTime(k.created_at)), el("td", { class: k.expires_at && k.expires_at * 1000 <= Date.now() ? "error" : null }, localTime(k.expires_at)),
        el("td", { class: "last-used" }, localTime(k.last_used_at)), el("td", {}, localTime(k.revoked_at)),
        el("td", { class: "actions" }, k.revoked_at ? "" : el("span", {},
          el("button", { type: "button", onclick: () => editKey(k), "aria-label": `Edit the limits of ${k.name}` }, "Edit"), " ",
          el("button", { type: "button", onclick: () => rotateKey(k), "aria-label": `Rotate ${k.name}` }, "Rotate"), " ",
          el("button", { type: "button", onclick: () => revokeKey(k), "aria-label": `Revoke ${k.name}` }, "Revoke"))),
      ),
    ),
  );
}

function keyForm(reset = false) {
  return clearForm($("#key-form"), "key-error", reset && { title: "Create a key", submit: "Create" });
}

// A form cleared of the last attempt's problems and, given `fresh`, back to its first state: empty,
// every field enabled, its title and submit button as given, no Cancel.
function clearForm(form, errorId, fresh) {
  if (fresh) {
    form.reset();
    for (const input of form.querySelectorAll("input[type=hidden]")) input.value = "";
    for (const input of form.querySelectorAll(":disabled")) input.disabled = false;
    form.querySelector("h3").textContent = fresh.title;
    form.querySelector("button[type=submit]").textContent = fresh.submit;
    form.querySelector("button[type=button]").hidden = true; // Cancel
  }
  for (const node of form.querySelectorAll(".field-error")) node.textContent = "";
  for (const input of form.querySelectorAll("[aria-invalid]")) input.removeAttribute("aria-invalid");
  say(errorId, "");
  return form;
}

function editKey(k) {
  const form = keyForm(true);
  form.elements.id.value = k.id;
  form.elements.name.value = k.name;
  form.elements.name.disabled = true;
  form.elements.admin.checked = k.admin;
  form.elements.admin.disabled = true;
  form.elements.team_id.value = k.team_id ?? "";
  form.elements.team_admin.checked = k.team_admin;
  fillLimits(form, k);
  form.elements.expires_at.value = k.expires_at ? localInput(k.expires_at) : "";
  form.elements.expires_at.dataset.was = form.elements.expires_at.value; // sent only when changed
  $("#key-form-title").textContent = `Edit the limits of ${k.name}`;
  $("#key-submit").textContent = "Save";
  $("#key-cancel").hidden = false;
  form.elements.quota_tokens.focus();
}

// Every field's problem that the page can see, at once (the server checks them again, and what only it
// knows, such as which models it has, comes back at its field).
function keyProblems(form, creating) {
  const problems = limitProblems(form, creating);
  const expires = form.elements.expires_at;
  if (expires.value && expires.value !== expires.dataset.was && !(new Date(expires.value).getTime() > Date.now())) problems.expires_at = "A time in the future, or empty for never (to stop a key now, revoke it).";
  if (form.elements.team_admin.checked && !form.elements.team_id.value && state.me.admin) problems.team_id = "A team admin key needs a team.";
  return problems;
}

// The problems of the limits a key and a team share (and of a new one's name), each at its field.
function limitProblems(form, creating) {
  const problems = {};
  if (creating && !form.elements.name.value.trim()) problems.name = "A name is required.";
  for (const name of ["quota_tokens", "rpm", "max_concurrency"]) {
    const raw = form.elements[name].value.trim();
    if (raw !== "" && !(Number.isInteger(Number(raw)) && Number(raw) >= 1)) problems[name] = "A whole number of at least 1, or empty for none.";
  }
  if (form.elements.quota_tokens.value.trim() && !form.elements.quota_period.value) problems.quota_period = "A token quota needs a period: a day, a month or in total.";
  if (!form.elements.quota_tokens.value.trim() && form.elements.quota_period.value) problems.quota_tokens = "A period needs a token quota.";
  const budget = form.elements.budget.value.trim();
  if (budget !== "" && !(Number(budget) > 0)) problems.budget = "An amount of more than 0, or empty for none.";
  else if (budget && !form.elements.budget_period.value) problems.budget_period = "A budget needs a period: a day, a month or in total.";
  if (!budget && form.elements.budget_period.value) problems.budget = "A period needs a budget.";
  if (allowList(form.elements.models.value) === undefined) problems.models = "An entry between two commas is empty: remove it (an empty field means every model).";
  return problems;
}

// A form's limit fields as a key's or team's limits show them.
function fillLimits(form, limits) {
  for (const name of ["quota_tokens", "quota_period", "rpm", "max_concurrency", "budget", "budget_period"]) form.elements[name].value = limits[name] ?? "";
  form.elements.models.value = limits.models ? limits.models.join(", ") : "";
  // An allow-list of no model ([]) has no text of its own: kept as it is unless the field is changed.
  form.elements.models.dataset.was = form.elements.models.value;
  form.elements.models.dataset.list = JSON.stringify(limits.models);
}

// The limits a key's or team's form asks for (every one named: null clears it), `editing` an existing one.
function limitsOf(form, editing) {
  const value = (name) => {
    const raw = form.elements[name].value.trim();
    return raw === "" ? null : form.elements[name].type === "number" ? Number(raw) : raw;
  };
  const models = form.elements.models;
  return {
    quota_tokens: value("quota_tokens"), quota_period: value("quota_period"), rpm: value("rpm"), max_concurrency: value("max_concurrency"),
    budget: value("budget"), budget_period: value("budget_period"),
    models: editing && models.value === models.dataset.was ? JSON.parse(models.dataset.list) : allowList(models.value),
  };
}

// The models a key may use as typed: null (an empty field: every model), the names and patterns, or
// undefined when an entry is empty (`a,,b`, `,,,`), which is neither every model nor none.
function allowList(raw) {
  if (!raw.trim()) return null;
  const entries = raw.split(",").map((m) => m.trim());
  return entries.every(Boolean) ? entries : undefined;
}

// A refusal of the server at the field its `param` names, in the page's words (without the API's field
// name in front: the field's label says which); else (or at `elsewhere`, as given) in the form's line.
function showRefusal(form, error, errorId, elsewhere = null) {
  const param = error.param?.split(".")[0];
  const here = param && form.querySelector(`.field-error[data-for="${CSS.escape(param)}"]`);
  const field = here ? param : param && elsewhere ? elsewhere : null;
  if (!field) {
    say(errorId, error.message, true);
    return;
  }
  const words = here && error.message.startsWith(`${error.param}: `) ? error.message.slice(error.param.length + 2) : error.message;
  fieldError(form, field, words.charAt(0).toUpperCase() + words.slice(1));
  form.elements[field]?.focus();
}

function fieldError(form, name, message) {
  form.querySelector(`.field-error[data-for="${CSS.escape(name)}"]`).textContent = message;
  form.elements[name]?.setAttribute("aria-invalid", "true");
}

async function submitKey(event) {
  event.preventDefault();
  const form = keyForm();
  const id = form.elements.id.value;
  const problems = Object.entries(keyProblems(form, !id));
  if (problems.length) {
    for (const [name, message] of problems) fieldError(form, name, message);
    form.elements[problems[0][0]].focus();
    return;
  }
  const limits = limitsOf(form, Boolean(id));
  if (state.me.admin) Object.assign(limits, { team_id: form.elements.team_id.value || null, team_admin: form.elements.team_admin.checked });
  const expires = form.elements.expires_at;
  if (!id || expires.value !== expires.dataset.was) limits.expires_at = expires.value ? new Date(expires.value).getTime() / 1000 : null;
  try {
    if (id) {
      await api(`/api/keys/${encodeURIComponent(id)}`, { method: "PATCH", body: limits });
      say("keys-status", `Limits of ${form.elements.name.value} saved.`);
    } else {
      const body = { name: form.elements.name.value.trim(), ...limits };
      if (state.me.admin) body.admin = form.elements.admin.checked;
      const created = await api("/api/keys", { method: "POST", body });
      showNewKey(created.key, "The new key, shown once: copy it now.");
      say("keys-status", `Key ${created.name} created.`);
    }
    keyForm(true);
    loadKeys();
  } catch (error) {
    showRefusal(form, error, "key-error");
  }
}

function showNewKey(key, note) {
  $("#new-key-note").textContent = note;
  $("#new-key-value").textContent = key;
  $("#new-key").hidden = false;
}

// A datetime-local field's value for a Unix time, in the browser's time zone.
const localInput = (seconds) => new Date(seconds * 1000 - new Date(seconds * 1000).getTimezoneOffset() * 60000).toISOString().slice(0, 16);

const ROTATION_GRACE = 3600; // seconds the old secret keeps working (the API's default)

async function rotateKey(k) {
  if (!confirm(`Give the key ${k.name} a new secret? The old one keeps working for one hour, then is refused.`)) return;
  try {
    const rotated = await api(`/api/keys/${encodeURIComponent(k.id)}/rotate?grace_seconds=${ROTATION_GRACE}`, { method: "POST" });
    showNewKey(rotated.key, `The new secret of ${k.name}, shown once: copy it now. The old one works until ${localTime(rotated.previous_valid_until)}.`);
    say("keys-status", `Key ${k.name} rotated.`);
    loadKeys();
  } catch (error) {
    say("keys-status", error.message, true);
  }
}

async function revokeKey(k) {
  if (!confirm(`Revoke the key ${k.name}? Requests with it are refused at once.`)) return;
  try {
    await api(`/api/keys/${encodeURIComponent(k.id)}`, { method: "DELETE" });
    say("keys-status", `Key ${k.name} revoked.`);
    loadKeys();
  } catch (error) {
    say("keys-status", error.message, true);
  }
}

// ---- Teams ------------------------------------------------------------------------------------

// The teams, refreshed every 5 s while the page is shown (their quotas and budgets move with every request).
function startTeams() {
  loadTeams();
  state.timer = setInterval(loadTeams, 5000);
}

async function loadTeams() {
  let listed;
  try {
    listed = await api("/api/teams");
  } catch (error) {
    stale("teams", "teams-status", error, 5);
    return;
  }
  if (state.tab !== "teams") return;
  if (fresh("teams")) say("teams-status", `Up to date again (${new Date().toLocaleTimeString()}).`);
  state.teams = listed.data;
  $("#teams-table tbody").replaceChildren(
    ...listed.data.map((t) =>
      el("tr", { "data-team": t.id },
        el("td", { class: "name" }, t.name), el("td", {}, el("code", {}, t.id)),
        el("td", { class: "members" }, t.keys.length ? t.keys.map((k) => k.name).sort((a, b) => a.localeCompare(b)).join(", ") : "none"),
        el("td", { class: "budget" }, budgetNow(t.spend)), el("td", { class: "quota" }, quotaText(t.quota)),
        el("td", { class: "num" }, number(t.rpm)), el("td", { class: "num" }, number(t.max_concurrency)),
        el("td", { class: "models" }, t.models ? t.models.join(", ") || "none" : "all"), el("td", {}, localTime(t.created_at)),
        el("td", { class: "actions" }, el("span", {},
          el("button", { type: "button", onclick: () => editTeam(t), "aria-label": `Edit the team ${t.name}` }, "Edit"), " ",
          el("button", { type: "button", onclick: () => deleteTeam(t), "aria-label": `Delete the team ${t.name}` }, "Delete"))),
      ),
    ),
  );
}

const teamForm = (reset = false) => clearForm($("#team-form"), "team-error", reset && { title: "Create a team", submit: "Create" });

function editTeam(t) {
  const form = teamForm(true);
  form.elements.id.value = t.id;
  form.elements.name.value = t.name;
  fillLimits(form, t);
  $("#team-form-title").textContent = `Edit the team ${t.name}`;
  $("#team-submit").textContent = "Save";
  $("#team-cancel").hidden = false;
  form.elements.name.focus();
}

async function submitTeam(event) {
  event.preventDefault();
  const form = teamForm();
  const id = form.elements.id.value;
  const problems = Object.entries(limitProblems(form, true));
  if (problems.length) {
    for (const [name, message] of problems) fieldError(form, name, message);
    form.elements[problems[0][0]].focus();
    return;
  }
  const body = { name: form.elements.name.value.trim(), ...limitsOf(form, Boolean(id)) };
  try {
    if (id) {
      await api(`/api/teams/${encodeURIComponent(id)}`, { method: "PATCH", body });
      say("teams-status", `Team ${body.name} saved.`);
    } else {
      await api("/api/teams", { method: "POST", body });
      say("teams-status", `Team ${body.name} created: give it keys on the Keys page.`);
    }
    teamForm(true);
    loadTeams();
  } catch (error) {
    showRefusal(form, error, "team-error");
  }
}

async function deleteTeam(t) {
  if (!confirm(`Delete the team ${t.name}? Only a team without active keys can be: move them out or revoke them first.`)) return;
  try {
    await api(`/api/teams/${encodeURIComponent(t.id)}`, { method: "DELETE" });
    say("teams-status", `Team ${t.name} deleted.`);
    loadTeams();
  } catch (error) {
    say("teams-status", error.message, true); // with active members: which to move out or revoke first
  }
}

// ---- Usage ------------------------------------------------------------------------------------

const COLOURS = ["#1f6feb", "#e8590c", "#2f9e44", "#ae3ec9", "#f08c00", "#0c8599", "#c2255c", "#5c7cfa"];

async function loadUsage(event) {
  event?.preventDefault();
  if (!state.me) return;
  if (state.me.admin) {
    await loadKeyNames(); // names for the picker and the tables, and each key's quota now
    if (!$("#usage-key").options.length) {
      $("#usage-key-field").hidden = false;
      $("#usage-key").replaceChildren(el("option", { value: "*" }, "All keys"), ...state.keys.map((k) => el("option", { value: k.id }, `${k.name} (${k.id})`)));
    }
  }
  const days = Number($("#usage-range").value);
  const bucket = days <= 1 ? "hour" : "day";
  const until = Date.now() / 1000;
  const since = bucket === "day" ? startOfLocalDay(days - 1) : until - 86400;
  const query = new URLSearchParams({ since: String(since), until: String(until + 1), bucket, offset_minutes: String(-new Date().getTimezoneOffset()) });
  if (state.me.admin) query.set("key", usageKey());
  try {
    const [series, summary] = await Promise.all([
      api(`/api/usage/series?${query}`),
      api(`/api/usage?${new URLSearchParams({ since: query.get("since"), until: query.get("until"), ...(state.me.admin ? { key: usageKey() } : {}) })}`),
      state.me.admin ? null : api("/api/me").then((me) => (state.me.quota = me.quota)),
    ]);
    state.rows = series.points;
    state.range = [since, until];
    if (state.tab !== "usage") return;
    fresh("usage");
    drawUsage(series, since, until);
    drawTotals(summary);
    const spend = summary.cost === null ? "" : `, ${money(summary.cost, summary.currency)} spent`;
    say("usage-status", `${summary.requests} requests${spend} from ${localTime(since)} to ${localTime(until)}.`);
  } catch (error) {
    // As of the last answer, greyed, until the server answers again (tried every 5 s while shown).
    if (error instanceof ApiError && error.status < 500) say("usage-status", error.message, true);
    else {
      stale("usage", "usage-status", error, 5);
      clearInterval(state.timer);
      state.timer = setTimeout(() => state.tab === "usage" && loadUsage(), 5000);
    }
    return;
  }
  loadLog([]);
}

const usageKey = () => (state.me.admin ? $("#usage-key").value || "*" : state.me.id);
const keyName = (id) => (id === state.me?.id ? state.me.name : state.keys?.find((k) => k.id === id)?.name ?? id);

async function loadKeyNames() {
  const [listed] = await Promise.all([api("/api/keys").catch(() => ({ data: [] })), loadTeamNames()]);
  state.keys = listed.data;
}

const PERIOD_WORDS = { day: "today (UTC)", month: "this month (UTC)", total: "in all" };
const resetText = (standing) => (standing.resets_at ? `resets ${localTime(standing.resets_at)}` : "never resets");

// A quota as used / limit, what is left and when it resets (in the reader's own time).
function quotaText(quota) {
  if (!quota) return "–";
  const held = quota.reserved ? `, ${number(quota.reserved)} held by requests in flight` : "";
  const when = PERIOD_WORDS[quota.period] ?? quota.period;
  return `${number(quota.used)} of ${number(quota.limit)} used ${when}${held}; ${number(quota.left)} left, ${resetText(quota)}`;
}

// A budget as a bar (amber from 50 %, red from 80 %: the default alert marks) and in words: spent of the
// budget, what requests in flight hold, what is left and when it resets.
function budgetNow(spend) {
  if (!spend) return "–";
  const amount = (value) => money(value, spend.currency);
  const held = spend.reserved ? `, ${amount(spend.reserved)} held by requests in flight` : "";
  const used = Math.min(spend.spent + spend.reserved, spend.budget);
  const share = Math.round((100 * used) / spend.budget);
  const text = `${amount(spend.spent)} of ${amount(spend.budget)} spent ${PERIOD_WORDS[spend.period] ?? spend.period}${held}; ${amount(spend.left)} left, ${resetText(spend)}`;
  return el("span", { class: "budget-now" },
    el("meter", { min: 0, max: spend.budget, low: spend.budget * 0.5, high: spend.budget * 0.8, optimum: 0, value: used, "aria-label": `${share} % of the budget` }),
    el("span", {}, text));
}

const teamName = (id) => (id ? (state.teams?.find((t) => t.id === id) ?? (state.me?.team?.id === id ? state.me.team : null))?.name ?? id : "–");

// The teams, for their names in the key and usage tables and the key form's team picker (admin keys only).
async function loadTeamNames() {
  const listed = await api("/api/teams").catch(() => null);
  if (!listed) return;
  state.teams = listed.data;
  const picker = $("#key-team"), chosen = picker.value;
  picker.replaceChildren(el("option", { value: "" }, "none"), ...listed.data.map((t) => el("option", { value: t.id }, t.name)));
  picker.value = chosen;
}

// An amount of the server's currency (models without prices: none, "–"); small amounts keep their digits.
function money(amount, currency) {
  if (amount === null || amount === undefined) return "–";
  const digits = amount !== 0 && Math.abs(amount) < 0.01 ? 6 : 2;
  return amount.toLocaleString(undefined, { style: "currency", currency: currency || "USD", minimumFractionDigits: 2, maximumFractionDigits: digits });
}

function drawTotals(summary) {
  state.currency = summary.currency;
  const total = (c) => c.prompt_tokens + c.completion_tokens;
  const mostFirst = (counts) => Object.entries(counts).sort((a, b) => total(b[1]) - total(a[1]));
  const row = (c) => [el("td", { class: "num" }, number(c.requests)), el("td", { class: "num" }, number(c.prompt_tokens)),
    el("td", { class: "num" }, number(c.completion_tokens)), el("td", { class: "num" }, number(total(c))), el("td", { class: "num" }, money(c.cost, summary.currency))];
  $("#usage-models tbody").replaceChildren(...mostFirst(summary.by_model).map(([name, c]) => el("tr", {}, el("td", {}, name), ...row(c))));
  const byKey = summary.by_key;
  $("#usage-keys-part").hidden = !byKey;
  if (byKey) {
    const keyOf = (id) => state.keys.find((k) => k.id === id);
    $("#usage-keys tbody").replaceChildren(...mostFirst(byKey).map(([id, c]) =>
      el("tr", { "data-key": id }, el("td", { class: "name" }, keyName(id)), ...row(c),
        el("td", { class: "quota" }, quotaText(keyOf(id)?.quota)), el("td", { class: "budget" }, budgetNow(keyOf(id)?.spend)))));
    const byTeam = teamTotals(byKey);
    $("#usage-teams-part").hidden = !Object.keys(byTeam).length;
    $("#usage-teams tbody").replaceChildren(...mostFirst(byTeam).map(([id, c]) =>
      el("tr", { "data-team": id }, el("td", { class: "name" }, teamName(id)), ...row(c),
        el("td", { class: "budget" }, budgetNow(state.teams.find((t) => t.id === id)?.spend)))));
  }
  const own = state.me.admin ? state.keys.find((k) => k.id === usageKey()) : state.me;
  $("#usage-quota").hidden = !own?.quota;
  $("#usage-quota").textContent = own?.quota ? `Quota of ${own.name}: ${quotaText(own.quota)}.` : "";
  const select = $("#log-model"), chosen = select.value;
  const names = [...new Set([...Object.keys(summary.by_model), ...(chosen ? [chosen] : [])])].sort();
  select.replaceChildren(el("option", { value: "" }, "All models"), ...names.map((n) => el("option", { value: n }, n)));
  select.value = chosen;
}

// The keys' counts summed by their team (keys in none are left out): a team's usage is its keys'.
function teamTotals(byKey) {
  const totals = {};
  for (const [id, c] of Object.entries(byKey)) {
    const team = state.keys.find((k) => k.id === id)?.team_id;
    if (!team) continue;
    const sum = (totals[team] ??= { requests: 0, prompt_tokens: 0, completion_tokens: 0, cost: null });
    sum.requests += c.requests;
    sum.prompt_tokens += c.prompt_tokens;
    sum.completion_tokens += c.completion_tokens;
    if (c.cost !== null && c.cost !== undefined) sum.cost = (sum.cost ?? 0) + c.cost;
  }
  return totals;
}

// The request log: pages of the ledger, newest first; `cursors` holds the `before` of every page up to this one.
async function loadLog(cursors) {
  if (!state.me || !state.range) return;
  const query = new URLSearchParams({ since: String(state.range[0]), until: String(state.range[1] + 1), limit: $("#log-size").value });
  if (state.me.admin) query.set("key", usageKey());
  if ($("#log-model").value) query.set("model", $("#log-model").value);
  if ($("#log-status").value) query.set("status", $("#log-status").value);
  const before = cursors.at(-1);
  if (before) query.set("before", String(before));
  try {
    const page = await api(`/api/usage/requests?${query}`);
    state.log = { cursors, next: page.next_before };
    $("#log-table tbody").replaceChildren(...page.data.map((r) =>
      el("tr", { "data-request": r.id },
        el("td", {}, localTime(r.time)), el("td", { class: "name" }, keyName(r.key)), el("td", {}, r.model), el("td", {}, r.endpoint),
        el("td", {}, el("span", { class: `badge ${r.status}`, title: r.outcome }, r.status === "error" ? r.outcome : r.status)),
        el("td", { class: "num" }, number(r.prompt_tokens)), el("td", { class: "num" }, number(r.completion_tokens)),
        el("td", { class: "num" }, number(r.latency_ms)), el("td", { class: "num" }, number(r.ttft_ms)),
        el("td", { class: "num" }, money(r.cost, state.currency)),
        el("td", {}, r.instance_id ? el("code", {}, r.instance_id) : "–"))));
    $("#log-newer").disabled = cursors.length === 0;
    $("#log-older").disabled = !page.has_more;
    const first = cursors.length * Number($("#log-size").value) + 1;
    say("log-status-line", page.data.length ? `Requests ${first}–${first + page.data.length - 1}, newest first${page.has_more ? "; older ones on the next page" : ""}.` : "No requests match.");
  } catch (error) {
    say("log-status-line", error.message, true);
  }
}

function startOfLocalDay(daysAgo) {
  const day = new Date();
  day.setHours(0, 0, 0, 0);
  day.setDate(day.getDate() - daysAgo);
  return day.getTime() / 1000;
}

function drawUsage(series, since, until) {
  const starts = [];
  for (let t = series.bucket === 86400 ? since : Math.floor(since / 3600) * 3600; t < until; ) {
    starts.push(t);
    if (series.bucket === 86400) {
      const next = new Date(t * 1000);
      next.setDate(next.getDate() + 1);
      t = next.getTime() / 1000;
    } else t += 3600;
  }
  const models = [...new Set(series.points.map((p) => p.model))].sort();
  const at = (start) => starts.findIndex((s) => Math.abs(s - start) < 60);
  const byModel = Object.fromEntries(models.map((m) => [m, starts.map(() => null)]));
  for (const p of series.points) if (at(p.start) >= 0) byModel[p.model][at(p.start)] = p;
  const label = (t) => series.bucket === 86400 ? new Date(t * 1000).toLocaleDateString(undefined, { month: "short", day: "numeric" }) : new Date(t * 1000).toLocaleTimeString(undefined, { hour: "2-digit" });
  const labels = starts.map(label);
  const colour = (i) => COLOURS[i % COLOURS.length];

  bars($("#chart-tokens"), labels, models.map((m, i) => ({ name: m, colour: colour(i), values: byModel[m].map((p) => (p ? p.prompt_tokens + p.completion_tokens : 0)) })));
  const requests = starts.map((_, i) => models.reduce((sum, m) => sum + (byModel[m][i]?.requests || 0), 0));
  const errors = starts.map((_, i) => models.reduce((sum, m) => sum + (byModel[m][i]?.errors || 0), 0));
  // The error rate has a scale of its own, on the right (0–100 %): not the requests' axis.
  bars($("#chart-requests"), labels, [{ name: "requests", colour: colour(0), values: requests }],
    [{ name: "error rate % (right axis)", colour: "#d9480f", values: requests.map((r, i) => (r ? (100 * errors[i]) / r : null)), max: 100, unit: "%" }]);
  // p50 and p95 of one model: two colours of their own (and p95 dashed), told apart without colour too.
  lines($("#chart-latency"), labels, models.flatMap((m, i) => [
    { name: `${m} p50`, colour: colour(2 * i), values: byModel[m].map((p) => p?.latency_p50_ms ?? null) },
    { name: `${m} p95`, colour: colour(2 * i + 1), dashed: true, values: byModel[m].map((p) => p?.latency_p95_ms ?? null) },
  ]));
  $("#usage-table tbody").replaceChildren(
    ...series.points.map((p) =>
      el("tr", {}, el("td", {}, localTime(p.start)), el("td", {}, p.model), el("td", { class: "num" }, p.requests), el("td", { class: "num" }, p.errors),
        el("td", { class: "num" }, p.prompt_tokens), el("td", { class: "num" }, p.completion_tokens),
        el("td", { class: "num" }, number(p.latency_p50_ms, 1)), el("td", { class: "num" }, number(p.latency_p95_ms, 1))),
    ),
  );
}

const SVG = "http://www.w3.org/2000/svg";
function svgEl(tag, attributes = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function frame(container, labels, max, rightAxis = null) {
  // Drawn at the container's own width: text and dots keep their shape.
  const width = Math.max(280, container.clientWidth || 800), height = 220, left = 48, bottom = 22, top = 8;
  const right = rightAxis ? 40 : 8;
  const svg = svgEl("svg", { viewBox: `0 0 ${width} ${height}`, role: "img" });
  const plot = { left, top, width: width - left - right, height: height - top - bottom, max: max || 1 };
  svg.append(svgEl("line", { class: "axis", x1: left, y1: top + plot.height, x2: width - right, y2: top + plot.height }));
  for (const f of [0, 0.5, 1]) {
    const y = top + plot.height * (1 - f);
    svg.append(svgEl("text", { x: left - 4, y: y + 4, "text-anchor": "end" }, number(plot.max * f)));
    if (rightAxis) svg.append(svgEl("text", { x: width - right + 4, y: y + 4, "text-anchor": "start" }, `${number(rightAxis.max * f)}${rightAxis.unit}`));
  }
  const step = Math.max(1, Math.ceil(labels.length / 10));
  labels.forEach((text, i) => {
    if (i % step === 0) svg.append(svgEl("text", { x: left + (plot.width * (i + 0.5)) / labels.length, y: height - 6, "text-anchor": "middle" }, text));
  });
  return { svg, plot };
}

function legend(container, svg, entries) {
  const swatch = (colour) => {
    const node = el("i", { "aria-hidden": "true" });
    node.style.background = colour; // CSSOM, not a style attribute: the page's CSP allows no inline styles
    return node;
  };
  const key = el("div", { class: "legend" }, ...entries.map((e) => el("span", {}, swatch(e.colour), e.name)));
  svg.setAttribute("aria-label", entries.length ? entries.map((e) => e.name).join(", ") : "No requests in this range");
  container.replaceChildren(svg, key);
}

function bars(container, labels, stacks, overlays = []) {
  const totals = labels.map((_, i) => stacks.reduce((sum, s) => sum + (s.values[i] || 0), 0));
  const { svg, plot } = frame(container, labels, Math.max(0, ...totals), overlays[0] ?? null);
  const slot = plot.width / labels.length, barWidth = Math.max(2, slot * 0.7);
  labels.forEach((_, i) => {
    let base = 0;
    for (const s of stacks) {
      const value = s.values[i] || 0;
      if (!value) continue;
      const h = (plot.height * value) / plot.max, y = plot.top + plot.height - ((base + value) * plot.height) / plot.max;
      const bar = svgEl("rect", { x: plot.left + slot * i + (slot - barWidth) / 2, y, width: barWidth, height: h, fill: s.colour });
      bar.append(svgEl("title", {}, `${labels[i]} ${s.name}: ${number(value)}`));
      svg.append(bar);
      base += value;
    }
  });
  for (const o of overlays) drawLine(svg, plot, labels, o, o.max);
  legend(container, svg, [...stacks, ...overlays]);
}

function drawLine(svg, plot, labels, series, max) {
  const slot = plot.width / labels.length;
  const points = series.values.map((v, i) => (v === null ? null : [plot.left + slot * (i + 0.5), plot.top + plot.height * (1 - v / (max || plot.max))]));
  const path = points.reduce((d, p, i) => (p ? d + `${d && points[i - 1] ? "L" : "M"}${p[0].toFixed(1)},${p[1].toFixed(1)}` : d), "");
  if (path) svg.append(svgEl("path", { d: path, fill: "none", stroke: series.colour, "stroke-width": 2, "stroke-dasharray": series.dashed ? "5 4" : "none" }));
  for (const p of points) if (p) svg.append(svgEl("circle", { cx: p[0], cy: p[1], r: 2.5, fill: series.colour }));
}

function lines(container, labels, series) {
  const max = Math.max(0, ...series.flatMap((s) => s.values.filter((v) => v !== null)));
  const { svg, plot } = frame(container, labels, max);
  for (const s of series) drawLine(svg, plot, labels, s);
  legend(container, svg, series);
}

function downloadCsv() {
  // Whose usage it is (a key's id, "all" keys, or the signed-in key's own) in a column and in the name.
  const key = state.me.admin ? ($("#usage-key").value === "*" ? "all" : $("#usage-key").value) : state.me.id;
  const header = ["start", "key", "model", "requests", "errors", "cancelled", "prompt_tokens", "completion_tokens", "latency_p50_ms", "latency_p95_ms"];
  const rows = state.rows.map((p) => [new Date(p.start * 1000).toISOString(), key, p.model, p.requests, p.errors, p.cancelled, p.prompt_tokens, p.completion_tokens, p.latency_p50_ms, p.latency_p95_ms]);
  const text = [header, ...rows].map((r) => r.map((v) => (/[",\n]/.test(String(v)) ? `"${String(v).replaceAll('"', '""')}"` : v)).join(",")).join("\n");
  const day = (seconds) => new Date(seconds * 1000).toISOString().slice(0, 10);
  const name = `llmserver-usage-${key}-${day(state.range[0])}-to-${day(state.range[1])}.csv`.replace(/[^A-Za-z0-9._-]/g, "_");
  const link = el("a", { href: URL.createObjectURL(new Blob([text + "\n"], { type: "text/csv" })), download: name });
  link.click();
  URL.revokeObjectURL(link.href);
}

// ---- Audit log --------------------------------------------------------------------------------

// The actions an admin can take through the API, for the filter (GET /api/audit takes any).
const AUDIT_ACTIONS = [
  "keys.create", "keys.update", "keys.rotate", "keys.delete", "teams.create", "teams.update", "teams.delete", "models.create", "models.update", "models.stop", "models.start",
  "models.delete", "instances.create", "instances.delete", "nodes.cordon", "nodes.drain", "nodes.uncordon",
];

function startAudit() {
  if ($("#audit-action").options.length === 1) $("#audit-action").append(...AUDIT_ACTIONS.map((a) => el("option", { value: a }, a)));
  loadAudit(state.audit?.cursors ?? []);
}

// A page of the log; `cursors` are the `before` of each page up to this one (none: the newest).
async function loadAudit(cursors) {
  if (!state.me?.admin) return;
  const query = new URLSearchParams({ limit: $("#audit-size").value });
  if ($("#audit-action").value) query.set("action", $("#audit-action").value);
  if ($("#audit-target").value.trim()) query.set("target", $("#audit-target").value.trim());
  if (cursors.length) query.set("before", String(cursors.at(-1)));
  let page;
  try {
    page = await api(`/api/audit?${query}`);
  } catch (error) {
    if (error instanceof ApiError && error.status < 500) say("audit-status", error.message, true);
    else {
      stale("audit", "audit-status", error, 5);
      clearTimeout(state.timer);
      state.timer = setTimeout(() => state.tab === "audit" && loadAudit(cursors), 5000);
    }
    return;
  }
  if (state.tab !== "audit") return;
  fresh("audit");
  state.audit = { cursors, next: page.next_before };
  const change = (c) => (c ? Object.entries(c).map(([name, value]) => `${name}: ${JSON.stringify(value)}`).join(", ") : "–");
  $("#audit-table tbody").replaceChildren(...page.data.map((r) =>
    el("tr", { "data-row": r.id },
      el("td", {}, localTime(r.time)), el("td", { class: "name" }, `${r.key.name} (${r.key.id})`), el("td", {}, el("code", {}, r.action)),
      el("td", { class: "name" }, r.target ?? "–"),
      el("td", {}, el("span", { class: `badge ${r.status < 400 ? "ok" : "error"}` }, String(r.status))),
      el("td", { class: "source" }, change(r.change)), el("td", {}, r.client ?? "–"), el("td", {}, r.request_id ? el("code", {}, r.request_id) : "–"))));
  $("#audit-newer").disabled = cursors.length === 0;
  $("#audit-older").disabled = !page.has_more;
  const first = cursors.length * Number($("#audit-size").value) + 1;
  say("audit-status", page.data.length ? `Actions ${first}–${first + page.data.length - 1}, newest first${page.has_more ? "; older ones on the next page" : ""}.` : "No admin action matches.");
}

// ---- Playground -------------------------------------------------------------------------------

async function loadPlayground() {
  loadChats();
  const select = $("#play-model");
  if (select.options.length) return;
  try {
    const listed = await api("/v1/models");
    state.models = Object.fromEntries(listed.data.map((m) => [m.id, m]));
    // Only what a chat request can reach: not embedding models, nor models stopped or blocked.
    const usable = listed.data.filter((m) => !m.embedding && m.available !== false);
    select.replaceChildren(...usable.map((m) => el("option", { value: m.id }, m.vision_capable ? `${m.id} (vision)` : m.id)));
    if (!usable.length) say("play-error", "No model can answer now: ask an admin to start one.", true);
    $("#play-max-tokens").max = state.me.server.max_tokens_limit;
  } catch (error) {
    say("play-error", error.message, true);
  }
}

const readDataUri = (file) =>
  new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`${file.name} could not be read.`));
    reader.readAsDataURL(file);
  });

// The API's own limits, checked before anything is sent; the server checks them again.
function checkFiles(files, model) {
  const limits = state.me.server, mb = (bytes) => `${Math.round(bytes / 1e6)} MB`;
  const images = files.filter((f) => f.type.startsWith("image/")), documents = files.filter((f) => !f.type.startsWith("image/"));
  if (images.length && !state.models[model]?.vision_capable) return `The model ${model} does not take images: choose a vision model.`;
  if (images.length > limits.max_images) return `At most ${limits.max_images} images per request.`;
  if (documents.length > limits.max_files) return `At most ${limits.max_files} files per request.`;
  for (const f of images) if (f.size > limits.max_image_bytes) return `${f.name} is over ${mb(limits.max_image_bytes)}, the largest image accepted.`;
  for (const f of documents) if (f.size > limits.max_file_bytes) return `${f.name} is over ${mb(limits.max_file_bytes)}, the largest file accepted.`;
  return null;
}

// The message in the box as the next user turn: its text, the files chosen for it and, when an earlier
// message is being edited, the attachments that message carried (they stay with their turn).
async function userTurn() {
  const files = [...$("#play-files").files];
  const problem = checkFiles(files, $("#play-model").value);
  if (problem) throw new ApiError(400, { error: { message: problem } });
  const parts = [{ type: "text", text: $("#play-message").value }];
  if (state.editing !== null) parts.push(...attachments(state.chat.messages[state.editing]));
  for (const file of files) {
    const data = await readDataUri(file);
    parts.push(file.type.startsWith("image/") ? { type: "image_url", image_url: { url: data } } : { type: "file", file: { filename: file.name, file_data: data } });
  }
  return { role: "user", content: parts.length === 1 ? parts[0].text : parts };
}

const attachments = (message) => (typeof message.content === "string" ? [] : message.content.filter((p) => p.type !== "text"));
const messageText = (message) =>
  typeof message.content === "string" ? message.content : message.content.filter((p) => p.type === "text").map((p) => p.text).join("");
// The turns a message in the box follows: all of them, or those before the message being edited.
const earlierTurns = () => (state.editing === null ? state.chat.messages : state.chat.messages.slice(0, state.editing));

function requestBody(history, turn) {
  const messages = [];
  if ($("#play-system").value.trim()) messages.push({ role: "system", content: $("#play-system").value });
  messages.push(...history, turn);
  return {
    model: $("#play-model").value, messages,
    max_tokens: Number($("#play-max-tokens").value), temperature: Number($("#play-temperature").value), top_p: Number($("#play-top-p").value),
  };
}

const playRequest = async () => requestBody(earlierTurns(), await userTurn());

function stats({ speed, latency, prompt, completion, instance }) {
  if (speed !== undefined) $("#stat-speed").textContent = number(speed, 1);
  if (latency !== undefined) $("#stat-latency").textContent = `${number(latency)} ms`;
  if (prompt !== undefined) $("#stat-prompt").textContent = number(prompt);
  if (completion !== undefined) $("#stat-completion").textContent = number(completion);
  if (instance !== undefined) $("#stat-instance").textContent = instance || "–";
}

// ---- Markdown: a small subset, built as DOM nodes from text (no HTML string is ever parsed) -------
// Fenced code blocks, headings, bullet and numbered lists, paragraphs; inline code, bold, italic and
// http(s) links. Anything else, HTML included, stays text.

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\n]+\*|_[^_\n]+_)|(\[[^\]\n]+\]\(https?:\/\/[^)\s]+\))/;

function inline(text) {
  const nodes = [];
  for (let rest = text; rest; ) {
    const found = INLINE.exec(rest);
    if (!found) {
      nodes.push(document.createTextNode(rest));
      break;
    }
    if (found.index) nodes.push(document.createTextNode(rest.slice(0, found.index)));
    const [token] = found;
    if (found[1]) nodes.push(el("code", {}, token.slice(1, -1)));
    else if (found[2]) nodes.push(el("strong", {}, token.slice(2, -2)));
    else if (found[3]) nodes.push(el("em", {}, token.slice(1, -1)));
    else {
      const [, label, href] = /^\[([^\]]+)\]\((.+)\)$/.exec(token);
      nodes.push(el("a", { href, rel: "noopener noreferrer nofollow", target: "_blank" }, label));
    }
    rest = rest.slice(found.index + token.length);
  }
  return nodes;
}

function markdown(text) {
  const blocks = [], lines = text.split("\n");
  let paragraph = [], list = null;
  const flush = () => {
    if (paragraph.length) blocks.push(el("p", {}, ...inline(paragraph.join(" "))));
    paragraph = [];
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = /^\s*```\s*([\w+-]*)\s*$/.exec(line);
    if (fence) {
      flush();
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      blocks.push(el("pre", {}, el("code", fence[1] ? { "data-language": fence[1] } : {}, code.join("\n"))));
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    const item = /^\s*(?:([-*+])|(\d+)[.)])\s+(.*)$/.exec(line);
    if (heading) {
      flush();
      blocks.push(el(`h${Math.min(6, heading[1].length + 3)}`, {}, ...inline(heading[2])));
    } else if (item) {
      if (paragraph.length) flush();
      const kind = item[1] ? "ul" : "ol";
      if (!list || list.tagName.toLowerCase() !== kind) blocks.push((list = el(kind)));
      list.append(el("li", {}, ...inline(item[3])));
    } else if (!line.trim()) flush();
    else {
      list = null;
      paragraph.push(line.trim());
    }
  }
  flush();
  return blocks;
}

// The conversation so far (the system prompt aside, read at each send): each request carries it, with
// its session as X-Session-Id, so that affinity keeps it on the instance that holds its prompt cache.
// While an answer comes, `pending` holds the turns it follows, the turn sent and the element the answer is
// written into: the answer is shown once, where it stays (the latest answer is #play-output). A stopped
// answer (`pending.stopped`) stays in view under the conversation it was not added to.
function renderConversation(pending = null) {
  const busy = Boolean(pending) && !pending.stopped;
  const messages = busy ? pending.history : state.chat.messages;
  const last = busy ? -1 : messages.length - 1;
  const turns = messages.map((m, index) => {
    const text = messageText(m), extra = attachments(m).length;
    const who = m.role === "user" ? "You" : "Model";
    const body = m.role === "assistant"
      ? el("div", { class: "markdown", id: index === last ? "play-output" : null }, ...markdown(text))
      : el("div", {}, text + (extra ? ` (+${extra} attached)` : ""));
    const button = (label, action, name) => el("button", { type: "button", class: "small", "aria-label": `${name} ${who === "You" ? "your" : "the model's"} message ${index + 1}`, disabled: busy, onclick: action }, label);
    const actions = [button("Copy", (event) => copy(text, event.target), "Copy")];
    if (m.role === "user") actions.push(button("Edit", () => editTurn(index), "Edit"));
    if (m.role === "assistant" && index === last) actions.push(button("Regenerate", regenerate, "Regenerate"));
    return el("li", { class: m.role }, el("span", { class: "who" }, who), body, el("div", { class: "buttons actions" }, ...actions));
  });
  if (busy) turns.push(el("li", { class: "user" }, el("span", { class: "who" }, "You"), el("div", {}, messageText(pending.turn))));
  if (busy || pending?.output.textContent) {
    pending.output.removeAttribute("id"); // #play-output is the answer being written, else the latest kept
    if (busy) pending.output.id = "play-output";
    turns.push(el("li", { class: "assistant" }, el("span", { class: "who" }, busy ? "Model" : "Model (stopped: not kept)"), pending.output));
  }
  $("#play-history").replaceChildren(...turns);
  $("#play-history").hidden = !turns.length;
  if (pending) pending.output.scrollIntoView({ block: "nearest" });
}

function newChat() {
  return { id: randomId(), title: "", created: Date.now(), updated: 0, session: randomId(), system: "", messages: [] };
}

// crypto.randomUUID is for secure contexts only: a console opened over plain http on a LAN address has none.
const randomId = () => Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, "0")).join("");

function newConversation() {
  state.chat = newChat();
  sessionStorage.removeItem(OPEN_SLOT);
  cancelEdit();
  $("#play-system").value = "";
  renderConversation();
  renderChats();
}

const sessionId = () => state.chat.session;

async function play(event) {
  event.preventDefault();
  if ($("#play-send").disabled) return; // Ctrl+Enter while an answer is on its way
  $("#play-send").disabled = true; // at once: the attachments are read before anything is sent
  let turn;
  try {
    turn = await userTurn();
  } catch (error) {
    say("play-error", error.message, true);
    $("#play-send").disabled = false;
    return;
  }
  await send(earlierTurns(), turn, { fromBox: true });
}

// The last answer again: the same turns sent again, the answer replaced when the new one is complete.
function regenerate() {
  const messages = state.chat.messages;
  if (messages.at(-1)?.role === "assistant") send(messages.slice(0, -2), messages.at(-2), { fromBox: false });
}

// An earlier message back in the box: sending it replaces that message and every turn after it.
function editTurn(index) {
  state.editing = index;
  const message = state.chat.messages[index];
  $("#play-message").value = messageText(message);
  const kept = attachments(message).length;
  $("#play-editing-text").textContent = `Editing message ${index + 1}${kept ? ` (its ${kept} attachment${kept > 1 ? "s" : ""} kept)` : ""}: Send replaces it and the ${state.chat.messages.length - index - 1} message(s) after it.`;
  $("#play-editing").hidden = false;
  $("#play-message").focus();
}

function cancelEdit() {
  if (state.editing !== null) $("#play-message").value = "";
  state.editing = null;
  $("#play-editing").hidden = true;
}

async function send(history, turn, { fromBox }) {
  say("play-error", "");
  const output = el("div", { id: "play-output", class: "output", role: "region", "aria-live": "polite", "aria-label": "Answer" });
  stats({ speed: null, latency: null, prompt: null, completion: null, instance: null });
  $("#play-send").disabled = true;
  $("#play-stop").disabled = false;
  for (const button of document.querySelectorAll("#chats button, #play-clear, #chats-delete-all")) button.disabled = true;
  renderConversation({ history, turn, output });
  state.abort = new AbortController();
  const chat = state.chat;
  try {
    const body = requestBody(history, turn);
    const isAsync = $("#play-async").checked;
    const answer = isAsync ? await playAsync(body, output) : await playStream(body, output);
    if (chat !== state.chat) return; // signed out, or another conversation opened, meanwhile
    if (state.abort.signal.aborted) throw new DOMException("stopped", "AbortError");
    Object.assign(chat, {
      messages: [...history, turn, { role: "assistant", content: answer }],
      title: chat.title || messageText(turn).replace(/\s+/g, " ").trim().slice(0, 60) || "Untitled",
      system: $("#play-system").value, updated: Date.now(),
    });
    // Sent and answered: the message and its attachments belong to that turn now, not to the next one.
    if (fromBox) {
      $("#play-message").value = "";
      $("#play-files").value = "";
      state.editing = null;
      $("#play-editing").hidden = true;
    }
    $("#play-send").disabled = false; // the turns' own buttons come back with the rendering below
    renderConversation(); // the answer, streamed as text, shown formatted once complete
    if (isAsync) $("#play-output").dataset.decrypted = "true";
    await keepChat(chat);
  } catch (error) {
    if (chat === state.chat) renderConversation({ history, turn, output, stopped: true });
    if (error.name === "AbortError") say("play-error", "Stopped: the answer above is as far as it got, and is not kept.");
    else if (error instanceof NotSent) say("play-error", error.message, true);
    else if (error instanceof TypeError) say("play-error", `The connection to the server was lost before the answer was complete (${error.message}).`, true);
    else say("play-error", error.message, true);
  } finally {
    $("#play-send").disabled = false;
    $("#play-stop").disabled = true;
    if (chat === state.chat) renderChats();
  }
}

// A request the server never got (it could not be reached): the message is still in the box to send again.
class NotSent extends Error {
  constructor(cause) {
    super(`Not sent: the server cannot be reached (${cause.message}). Your message is kept: send it again once the server is back.`);
  }
}

// A failure before any answer came (fetch's TypeError) as a NotSent; any other error (an abort, a
// refusal) as it is.
const asNotSent = (error) => (error instanceof TypeError ? new NotSent(error) : error);

async function playStream(body, output) {
  const started = performance.now();
  const answer = await fetch("/v1/chat/completions", {
    method: "POST", signal: state.abort.signal,
    headers: authHeaders({ "Content-Type": "application/json", "X-Session-Id": sessionId() }),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
  }).catch((error) => { throw asNotSent(error); });
  if (!answer.ok) throw new ApiError(answer.status, await answer.json().catch(() => null));
  stats({ instance: answer.headers.get("x-llmserver-instance") });
  const reader = answer.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "", first = null, tokens = 0, text = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      // An event's data lines; comment lines (": reading the prompt", sent while a long prompt is read) and
      // other fields are not the answer.
      const data = event.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(500, chunk);
      const piece = chunk.choices?.[0]?.delta?.content;
      if (piece) {
        first ??= performance.now();
        tokens += 1;
        text += piece;
        output.append(piece);
        const seconds = (performance.now() - first) / 1000;
        if (seconds > 0) stats({ speed: tokens / seconds, completion: tokens });
      }
      if (chunk.usage) stats({ prompt: chunk.usage.prompt_tokens, completion: chunk.usage.completion_tokens });
    }
  }
  stats({ latency: performance.now() - started });
  return text;
}

async function libsodium() {
  if (state.sodium) return state.sodium;
  for (const file of ["libsodium.js", "libsodium-wrappers.js"]) {
    await new Promise((resolve, reject) => {
      // Beside this file, under the same version (a module knows its own URL).
      const script = el("script", { src: new URL(`vendor/${file}`, import.meta.url).href });
      script.onload = resolve;
      script.onerror = () => reject(new Error("libsodium.js is not installed with this server: run scripts/setup.sh."));
      document.head.append(script);
    });
  }
  await window.sodium.ready;
  state.sodium = window.sodium;
  return state.sodium;
}

const toBase64 = (bytes) => btoa(String.fromCharCode(...bytes));
const fromBase64 = (text) => Uint8Array.from(atob(text), (c) => c.charCodeAt(0));

async function playAsync(body, output) {
  const sodium = await libsodium();
  const key = crypto.getRandomValues(new Uint8Array(32)); // made here; sent once; the result is decrypted here
  const started = performance.now();
  const job = await api("/v1/chat/completions", { method: "POST", body: { ...body, mode: "async", key: toBase64(key) }, extra: { "X-Session-Id": sessionId() } })
    .catch((error) => { throw asNotSent(error); });
  output.textContent = `Submitted (job ${job.tracking_id}); waiting for the encrypted result…`;
  for (let delay = 250; ; delay = Math.min(2000, delay * 1.5)) {
    await new Promise((resolve) => setTimeout(resolve, delay));
    if (state.abort.signal.aborted) return;
    const polled = await api(`/api/async_result?tracking_id=${encodeURIComponent(job.tracking_id)}`);
    if (polled.status === "pending") continue;
    if (polled.status === "failed") throw new ApiError(500, polled);
    const plain = sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(null, fromBase64(polled.result), null, fromBase64(job.nonce), key);
    const result = JSON.parse(new TextDecoder().decode(plain));
    output.textContent = result.choices[0].message.content;
    stats({ latency: performance.now() - started, prompt: result.usage.prompt_tokens, completion: result.usage.completion_tokens, instance: result.instance_id });
    return result.choices[0].message.content;
  }
}

// ---- Conversations kept in this browser -------------------------------------------------------
// One IndexedDB record per conversation, {slot, nonce, box}: the box is XChaCha20-Poly1305 of the
// conversation's JSON under a key derived from the API key (BLAKE2b, keyed by a context string: API keys
// are random, so a slow password hash would add nothing), the slot "<owner>/<id>" with the owner another
// BLAKE2b of the key, bound into the box as additional data. A key lists only its own records and reads
// no other's; after sign-out the derived key is gone and nothing is readable without the API key. None
// of it is sent anywhere.

const CHATS_DB = "llmserver-console", CHATS = "conversations";

function chatsDatabase() {
  state.chatsDb ??= new Promise((resolve, reject) => {
    const opening = indexedDB.open(CHATS_DB, 1);
    opening.onupgradeneeded = () => opening.result.createObjectStore(CHATS, { keyPath: "slot" });
    opening.onsuccess = () => resolve(opening.result);
    opening.onerror = () => reject(opening.error);
  });
  return state.chatsDb;
}

// One transaction over the store: `work` makes its requests; the last one's result once it committed.
async function chatStore(mode, work) {
  const db = await chatsDatabase();
  return new Promise((resolve, reject) => {
    const transaction = db.transaction(CHATS, mode);
    const request = work(transaction.objectStore(CHATS));
    transaction.oncomplete = () => resolve(request?.result);
    transaction.onerror = transaction.onabort = () => reject(transaction.error || new Error("the browser's storage refused"));
  });
}

async function vault() {
  if (state.vault) return state.vault;
  const apiKey = sessionStorage.getItem(KEY_SLOT);
  const sodium = await libsodium();
  if (!apiKey || apiKey !== sessionStorage.getItem(KEY_SLOT)) throw new Error("signed out");
  const derive = (length, context) => sodium.crypto_generichash(length, sodium.from_string(apiKey), sodium.from_string(context));
  state.vault = { key: derive(32, "llmserver console: conversations key"), owner: sodium.to_hex(derive(16, "llmserver console: conversations owner")) };
  return state.vault;
}

async function keepChat(chat) {
  try {
    const { key, owner } = await vault();
    const sodium = state.sodium, slot = `${owner}/${chat.id}`, nonce = sodium.randombytes_buf(24);
    const box = sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(sodium.from_string(JSON.stringify(chat)), sodium.from_string(slot), null, nonce, key);
    await chatStore("readwrite", (store) => store.put({ slot, nonce, box }));
    sessionStorage.setItem(OPEN_SLOT, chat.id);
    await refreshChats();
  } catch (error) {
    say("chats-status", `Answered, but not kept in this browser: ${error.message}`, true);
  }
}

async function refreshChats() {
  const { key, owner } = await vault();
  const sodium = state.sodium;
  const rows = await chatStore("readonly", (store) => store.getAll(IDBKeyRange.bound(`${owner}/`, `${owner}/\uffff`)));
  const chats = [];
  for (const row of rows) {
    try {
      const plain = sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(null, row.box, sodium.from_string(row.slot), row.nonce, key);
      chats.push(JSON.parse(sodium.to_string(plain)));
    } catch {
      // A record that does not open under this key's: not this key's (it cannot be, by its slot) or damaged.
    }
  }
  if (state.vault?.owner !== owner) return; // signed out (or in with another key) meanwhile
  state.chats = chats.sort((a, b) => b.updated - a.updated);
  renderChats();
}

// Once per sign-in, when the playground opens: the kept conversations listed, the one this tab had open
// (before a reload) opened again.
async function loadChats() {
  if (state.chats) return;
  state.chats = [];
  try {
    await refreshChats();
    const open = sessionStorage.getItem(OPEN_SLOT);
    if (open && !state.chat.messages.length) openChat(open);
  } catch (error) {
    if (state.me) say("chats-status", `Conversations cannot be kept in this browser: ${error.message}`, true);
  }
}

function renderChats() {
  const chats = state.chats || [], busy = $("#play-send").disabled;
  const items = chats.map((chat) => {
    const title = chat.title || "Untitled";
    const open = el("button", { type: "button", class: "chat-title", "aria-current": chat.id === state.chat.id ? "true" : null, disabled: busy, onclick: () => openChat(chat.id) }, title);
    const rename = el("button", { type: "button", class: "small", "aria-label": `Rename ${title}`, disabled: busy, onclick: () => renameChat(chat, item) }, "Rename");
    const remove = el("button", { type: "button", class: "small", "aria-label": `Delete ${title}`, disabled: busy, onclick: () => deleteChat(chat) }, "Delete");
    const item = el("li", {}, open, el("span", { class: "chat-actions" }, rename, " ", remove));
    return item;
  });
  $("#chats").replaceChildren(...items);
  $("#play-clear").disabled = busy;
  $("#chats-delete-all").disabled = busy || !chats.length;
  if (!$("#chats-status").classList.contains("error") || !chats.length) say("chats-status", chats.length ? `${chats.length} kept` : "None kept yet.");
}

function openChat(id) {
  const chat = (state.chats || []).find((c) => c.id === id);
  if (!chat || $("#play-send").disabled) return;
  state.chat = structuredClone(chat);
  sessionStorage.setItem(OPEN_SLOT, id);
  cancelEdit();
  $("#play-system").value = chat.system || "";
  say("play-error", "");
  renderConversation();
  renderChats();
}

// The title edited in place: Enter or Save keeps it, Escape or Cancel leaves it as it was.
function renameChat(chat, item) {
  const field = el("input", { type: "text", value: chat.title, maxlength: "120", "aria-label": `New title for ${chat.title}` });
  const form = el("form", { class: "rename" }, field, el("button", { type: "submit", class: "small" }, "Save"), el("button", { type: "button", class: "small", onclick: renderChats }, "Cancel"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const title = field.value.replace(/\s+/g, " ").trim();
    if (!title) return renderChats();
    const renamed = { ...chat, title };
    if (state.chat.id === chat.id) state.chat.title = title;
    await keepChat(renamed);
  });
  field.addEventListener("keydown", (event) => event.key === "Escape" && renderChats());
  item.replaceChildren(form);
  field.focus();
  field.select();
}

async function deleteChat(chat) {
  if (!confirm(`Delete the conversation "${chat.title || "Untitled"}" from this browser?`)) return;
  const { owner } = await vault();
  await chatStore("readwrite", (store) => store.delete(`${owner}/${chat.id}`));
  if (state.chat.id === chat.id) newConversation();
  await refreshChats();
}

async function deleteAllChats() {
  const count = (state.chats || []).length;
  if (!count || !confirm(`Delete all ${count} conversations this key keeps in this browser?`)) return;
  const { owner } = await vault();
  await chatStore("readwrite", (store) => store.delete(IDBKeyRange.bound(`${owner}/`, `${owner}/\uffff`)));
  newConversation();
  await refreshChats();
}

// The async request as a shell script: a key of the caller's own (openssl), the submission, a poll every
// second until the job is done (a ready result is handed out once), and the answer decrypted there with
// PyNaCl (pip install pynacl): the server never holds the key.
function asyncCurl(origin, submit) {
  return [
    "RESULT_KEY=$(openssl rand -base64 32)   # the result is encrypted under it: keep it to decrypt",
    `JOB=$(${submit})`,
    "field() { python3 -c 'import json, sys; print(json.loads(sys.argv[1]).get(sys.argv[2], \"\"))' \"$1\" \"$2\"; }",
    `while RESULT=$(curl -s "${origin}/api/async_result?tracking_id=$(field "$JOB" tracking_id)" -H "Authorization: Bearer $LLMSERVER_API_KEY"); [ "$(field "$RESULT" status)" = pending ]; do sleep 1; done`,
    "python3 - \"$JOB\" \"$RESULT\" \"$RESULT_KEY\" <<'PY'",
    "import base64, json, sys",
    "from nacl.bindings import crypto_aead_xchacha20poly1305_ietf_decrypt as decrypt",
    "job, polled, key = json.loads(sys.argv[1]), json.loads(sys.argv[2]), base64.b64decode(sys.argv[3])",
    "if polled.get(\"status\") != \"ready\":",
    "    sys.exit(f\"not answered: {polled}\")",
    "answer = json.loads(decrypt(base64.b64decode(polled[\"result\"]), None, base64.b64decode(job[\"nonce\"]), key))",
    "print(answer[\"choices\"][0][\"message\"][\"content\"])",
    "PY",
  ].join("\n");
}

async function showCode(kind, button) {
  let body;
  try {
    body = await playRequest();
  } catch (error) {
    say("play-error", error.message, true);
    return;
  }
  const origin = window.location.origin;
  const isAsync = $("#play-async").checked;
  // Async: the request names a key of the caller's own (made with openssl) that the result comes back
  // encrypted under; the answer's tracking_id is then polled at /api/async_result.
  const json = JSON.stringify(isAsync ? { ...body, mode: "async", key: "__RESULT_KEY__" } : body).replaceAll("'", "'\\''");
  const sdkNote = isAsync ? "# Async mode is the HTTP API's (Copy as curl): the SDK below waits for the answer.\n" : "";
  const submit = `curl -s ${origin}/v1/chat/completions \\\n  -H "Authorization: Bearer $LLMSERVER_API_KEY" -H "Content-Type: application/json" \\\n  -d '${json.replace('"__RESULT_KEY__"', `"'"$RESULT_KEY"'"`)}'`;
  const text = kind === "curl" ? (isAsync ? asyncCurl(origin, submit) : submit)
    : `${sdkNote}from openai import OpenAI\n\nclient = OpenAI(base_url="${origin}/v1", api_key=os.environ["LLMSERVER_API_KEY"])\n` +
      `answer = client.chat.completions.create(**${JSON.stringify(body, null, 2).replaceAll("null", "None").replaceAll("true", "True").replaceAll("false", "False")})\nprint(answer.choices[0].message.content)`;
  const code = kind === "curl" ? text : `import os\n${text}`;
  $("#play-code").hidden = false;
  $("#play-code").textContent = code;
  await copy(code, button);
}

// ---- Wiring -----------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  $("#sign-in-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      await signIn($("#api-key").value.trim());
    } catch (error) {
      say("sign-in-error", error.message, true);
    }
  });
  $("#sign-out").addEventListener("click", signOut);
  for (const button of document.querySelectorAll("#tabs button")) button.addEventListener("click", () => show(button.dataset.tab));
  $("#key-form").addEventListener("submit", submitKey);
  $("#key-cancel").addEventListener("click", () => keyForm(true));
  $("#team-form").addEventListener("submit", submitTeam);
  $("#team-cancel").addEventListener("click", () => teamForm(true));
  $("#copy-key").addEventListener("click", (event) => copy($("#new-key-value").textContent, event.target));
  $("#usage-form").addEventListener("submit", loadUsage);
  $("#usage-csv").addEventListener("click", downloadCsv);
  for (const picker of ["#usage-range", "#usage-key"]) $(picker).addEventListener("change", () => loadUsage());
  for (const picker of ["#log-model", "#log-status", "#log-size"]) $(picker).addEventListener("change", () => loadLog([]));
  $("#log-form").addEventListener("submit", (event) => event.preventDefault());
  $("#log-older").addEventListener("click", () => loadLog([...state.log.cursors, state.log.next]));
  $("#log-newer").addEventListener("click", () => loadLog(state.log.cursors.slice(0, -1)));
  $("#tabs").addEventListener("keydown", tabKeys);
  // Enter in a form's select submits it, as it does in its text fields (browsers leave it to the page).
  document.addEventListener("keydown", (event) => {
    const target = event.target;
    if (event.key === "Enter" && target instanceof HTMLSelectElement && target.form) {
      event.preventDefault();
      target.form.requestSubmit();
    }
  });
  $("#model-form").addEventListener("submit", submitModel);
  $("#instance-log-close").addEventListener("click", closeLog);
  $("#instance-log-refresh").addEventListener("click", () => showLog($("#instance-log").dataset.instance));
  $("#model-cancel").addEventListener("click", () => modelForm(true));
  $("#audit-form").addEventListener("submit", (event) => {
    event.preventDefault();
    loadAudit([]);
  });
  $("#audit-action").addEventListener("change", () => loadAudit([]));
  $("#audit-size").addEventListener("change", () => loadAudit([]));
  $("#audit-older").addEventListener("click", () => loadAudit([...state.audit.cursors, state.audit.next]));
  $("#audit-newer").addEventListener("click", () => loadAudit(state.audit.cursors.slice(0, -1)));
  $("#play-form").addEventListener("submit", play);
  $("#play-stop").addEventListener("click", () => state.abort?.abort());
  $("#play-clear").addEventListener("click", newConversation);
  $("#play-edit-cancel").addEventListener("click", cancelEdit);
  $("#chats-delete-all").addEventListener("click", deleteAllChats);
  $("#play-message").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("#play-form").requestSubmit();
  });
  window.addEventListener("hashchange", () => show(pageInUrl()));
  $("#copy-curl").addEventListener("click", (event) => showCode("curl", event.target));
  $("#copy-sdk").addEventListener("click", (event) => showCode("sdk", event.target));
  state.chat = newChat();
  const saved = sessionStorage.getItem(KEY_SLOT);
  if (saved) signIn(saved).catch((error) => signOut(`Signed out: ${error.message}`));
});
