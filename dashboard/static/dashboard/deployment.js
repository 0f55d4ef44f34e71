// The rollout page: the traffic split and the deployment's state follow the live feed (the judge may move
// a step or roll back while the page is open). A state change offers a reload for the new events.
(function () {
  "use strict";

  var config = JSON.parse(document.getElementById("deployment-config").textContent);

  function stateBadge(cell, state) {
    var badge = cell ? cell.querySelector(".state") : null;
    if (badge && badge.textContent !== state) {
      badge.textContent = state;
      badge.className = "state state-" + state;
    }
  }

  function setText(cell, text) {
    if (cell && cell.textContent !== text) { cell.textContent = text; }
  }

  function apply(update) {
    update.versions.forEach(function (v) {
      var row = document.querySelector('#traffic-table tr[data-version="' + CSS.escape(v.version) + '"]');
      if (!row) { return; }
      setText(row.querySelector('[data-field="traffic"]'), v.traffic_pct + "%");
      stateBadge(row.querySelector('[data-field="state"]'), v.state);
      setText(row.querySelector('[data-field="aliases"]'), v.aliases.length ? v.aliases.join(", ") : "—");
    });
    var deployment = update.deployment;
    if (deployment && deployment.id === config.deployment_id && deployment.state !== config.state) {
      stateBadge(document.getElementById("deployment-state"), deployment.state);
      document.getElementById("deployment-changed").hidden = false;
    }
  }

  window.SwitchyardLive.connect(config.ws_path, apply);
}());
