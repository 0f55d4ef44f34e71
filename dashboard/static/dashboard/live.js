// The dashboard's live feeds: one WebSocket to /dashboard/ws/…, reconnected with backoff.
// SwitchyardLive.connect(path, onUpdate) calls onUpdate(message) for every pushed update and keeps the
// #live-status indicator (when the page has one) current. Close codes 4403/4404 are final.
// The helpers below are shared by the pages that update their tables in place.
(function () {
  "use strict";

  function setStatus(state, text) {
    var status = document.getElementById("live-status");
    if (status) {
      status.dataset.state = state;
      status.textContent = text;
    }
  }

  function connect(path, onUpdate) {
    var retryMs = 1000;
    function open() {
      var scheme = location.protocol === "https:" ? "wss://" : "ws://";
      var socket = new WebSocket(scheme + location.host + path);
      socket.onopen = function () { retryMs = 1000; setStatus("live", "live"); };
      socket.onmessage = function (event) {
        var message = JSON.parse(event.data);
        if (message.type === "update") {
          onUpdate(message);
          setStatus("live", "live · " + message.at.slice(11) + " UTC");
        }
      };
      socket.onclose = function (event) {
        if (event.code === 4403 || event.code === 4404) {
          setStatus("closed", event.code === 4403 ? "live feed refused: sign in as staff" : "model not found");
          return;
        }
        setStatus("reconnecting", "reconnecting…");
        window.setTimeout(open, retryMs);
        retryMs = Math.min(retryMs * 2, 15000);
      };
    }
    open();
  }

  function fmt(value, unit, digits) {
    if (value === null || value === undefined) { return "—"; }
    return value.toFixed(digits) + (unit ? unit : "");
  }

  // Writes only what changed, so a push does not disturb a selection or restart a transition.
  function setField(root, field, text) {
    var cell = root ? root.querySelector('[data-field="' + field + '"]') : null;
    if (cell && cell.textContent !== text) { cell.textContent = text; }
  }

  function stateBadge(cell, state) {
    var badge = cell ? cell.querySelector(".state") : null;
    if (badge && badge.textContent !== state) {
      badge.textContent = state;
      badge.className = "state state-" + state;
    }
  }

  // The replicas table (dashboard/_replicas.html) rebuilt from a push. Text goes in through
  // textContent: ids and versions are never parsed as HTML.
  function renderReplicas(container, rows, showModel) {
    var body = container ? container.querySelector("tbody") : null;
    if (!body) { return; }
    // A push lists every replica (a feed whose directory read fails skips it): the page's note that
    // it could list only its own process's no longer holds.
    var notice = container.querySelector(".notice");
    if (notice) { notice.remove(); }
    var numColumns = showModel ? 9 : 8;
    body.textContent = "";
    if (!rows.length) {
      var empty = body.insertRow();
      var only = empty.insertCell();
      only.colSpan = numColumns;
      only.className = "muted";
      only.textContent = "No replicas running.";
      return;
    }
    rows.forEach(function (r) {
      var tr = body.insertRow();
      tr.dataset.replica = r.replica_id;
      function cell(text, className, field) {
        var td = tr.insertCell();
        if (className) { td.className = className; }
        if (field) { td.dataset.field = field; }
        if (text !== null) { td.textContent = text; }
        return td;
      }
      if (showModel) { cell(r.model); }
      cell(r.version);
      var code = document.createElement("code");
      code.title = r.replica_id;
      code.textContent = r.replica_id.length > 14 ? r.replica_id.slice(0, 13) + "…" : r.replica_id;
      cell(null).appendChild(code);
      var badge = document.createElement("span");
      badge.className = "state state-" + r.state;
      badge.textContent = r.state;
      cell(null).appendChild(badge);
      cell(String(r.queue_depth), "num", "queue_depth");
      cell(String(r.running), "num", "running");
      cell(String(r.adapters || 0), "num", "adapters");
      cell(r.step_ms == null ? "—" : r.step_ms.toFixed(1) + " ms", "num", "step_ms");
      var kv = cell(null);
      var meter = document.createElement("div");
      meter.className = "meter";
      meter.setAttribute("role", "meter");
      meter.setAttribute("aria-valuenow", String(r.kv_pct));
      meter.setAttribute("aria-valuemin", "0");
      meter.setAttribute("aria-valuemax", "100");
      var bar = document.createElement("span");
      bar.style.width = Math.max(0, Math.min(100, r.kv_pct)).toFixed(0) + "%";
      meter.appendChild(bar);
      kv.appendChild(meter);
      kv.appendChild(document.createTextNode(" " + r.kv_pct.toFixed(1) + "%"));
      cell(r.is_local ? "in process" : "replica process");
    });
  }

  window.SwitchyardLive = {
    connect: connect, setStatus: setStatus, fmt: fmt, setField: setField, stateBadge: stateBadge,
    renderReplicas: renderReplicas,
  };
}());
