// The overview, kept current by its live feed (no reload): the fleet cards, each model's versions with
// traffic, state and last-minute rates, its deployment badge, and the replicas table. A model added or
// removed since the page loaded offers a reload (its panel and links come from the server).
(function () {
  "use strict";

  var live = window.SwitchyardLive;
  var config = JSON.parse(document.getElementById("overview-config").textContent);
  var VERSION_FIELDS = ["version", "traffic", "state", "aliases", "req_s", "err_pct", "ttft_p99_ms",
    "tpot_p99_ms"];
  var CELL_CLASS = { traffic: "traffic", req_s: "num", err_pct: "num", ttft_p99_ms: "num", tpot_p99_ms: "num" };

  function updateFleet(fleet, at) {
    var cards = document.getElementById("fleet");
    var states = Object.keys(fleet.states).map(function (s) { return fleet.states[s] + " " + s; });
    live.setField(cards, "num_replicas", String(fleet.num_replicas));
    live.setField(cards, "states", states.length ? states.join(", ") : "none running");
    live.setField(cards, "kv_mean", fleet.kv_mean_pct === null ? "n/a" : live.fmt(fleet.kv_mean_pct, "%", 1));
    live.setField(cards, "kv_detail", "mean of ready and draining replicas" +
      (fleet.kv_max_pct === null ? "" : "; max " + live.fmt(fleet.kv_max_pct, "%", 1)));
    live.setField(cards, "load", String(fleet.load));
    live.setField(cards, "queue_depth", fleet.queue_depth + " waiting for a batch slot");
    live.setField(cards, "at", at.slice(11));
  }

  function versionRow(body) {
    var tr = body.insertRow();
    VERSION_FIELDS.forEach(function (field) {
      var td = tr.insertCell();
      if (CELL_CLASS[field]) { td.className = CELL_CLASS[field]; }
      if (field === "version") {  // bold, as the server draws it
        td.appendChild(document.createElement("strong")).dataset.field = field;
        return;
      }
      td.dataset.field = field;
      if (field === "state") {
        var badge = document.createElement("span");
        badge.className = "state";
        td.appendChild(badge);
      }
    });
    return tr;
  }

  function fillVersion(tr, v) {
    tr.dataset.version = v.version;
    live.setField(tr, "version", v.version);
    live.setField(tr, "traffic", v.traffic_pct + "%");
    live.stateBadge(tr.querySelector('[data-field="state"]'), v.state);
    live.setField(tr, "aliases", v.aliases.length ? v.aliases.join(", ") : "—");
    live.setField(tr, "req_s", live.fmt(v.req_s, "", 2));
    live.setField(tr, "err_pct", live.fmt(v.err_pct, "%", 2));
    live.setField(tr, "ttft_p99_ms", live.fmt(v.ttft_p99_ms, " ms", 1));
    live.setField(tr, "tpot_p99_ms", live.fmt(v.tpot_p99_ms, " ms", 1));
  }

  function updateDeployment(section, deployment) {
    var holder = section.querySelector('[data-field="deployment"]');
    if (!holder) { return; }
    if (!deployment) { holder.textContent = ""; return; }
    var badge = holder.querySelector("a.badge");
    if (!badge) {
      badge = document.createElement("a");
      badge.className = "badge";
      holder.appendChild(badge);
    }
    var href = config.deployment_url.replace("/0/", "/" + deployment.id + "/");
    if (badge.getAttribute("href") !== href) { badge.setAttribute("href", href); }
    var text = "deployment " + deployment.id + ": " + deployment.candidate + " " + deployment.state +
      " (" + deployment.current_pct + "%)";
    if (badge.textContent !== text) { badge.textContent = text; }
  }

  function updateModel(section, model) {
    var body = section.querySelector("tbody[data-versions]");
    var shown = Array.prototype.map.call(body.rows, function (tr) { return tr.dataset.version; });
    var wanted = model.versions.map(function (v) { return v.version; });
    if (shown.join("\n") !== wanted.join("\n")) {  // a version gained or lost traffic: new rows
      body.textContent = "";
      model.versions.forEach(function () { versionRow(body); });
    }
    model.versions.forEach(function (v, i) { fillVersion(body.rows[i], v); });
    updateDeployment(section, model.deployment);
  }

  var numUpdates = 0;
  function apply(update) {
    updateFleet(update.fleet, update.at);
    var sections = {};
    document.querySelectorAll("section[data-model]").forEach(function (s) { sections[s.dataset.model] = s; });
    var names = update.models.map(function (m) { return m.name; });
    update.models.forEach(function (model) {
      if (sections[model.name]) { updateModel(sections[model.name], model); }
    });
    var changed = names.length !== Object.keys(sections).length ||
      names.some(function (name) { return !sections[name]; });
    document.getElementById("overview-changed").hidden = !changed;
    live.setField(document.getElementById("fleet"), "num_models", String(names.length));
    live.renderReplicas(document.getElementById("replicas-table"), update.replicas, true);
    numUpdates += 1;
    document.body.dataset.liveUpdates = String(numUpdates);
  }

  live.connect(config.ws_path, apply);
}());
