// The model page: per-version charts drawn with plotly.js, updated live over the dashboard's WebSocket.
//
// The page embeds its first data (#dashboard-config); the live feed then pushes an "update" every 1-2 s
// with the last few points of each version (replacing points with the same time), the versions' traffic
// and state, and the replicas' gauges. Every trace belongs to exactly one version (legendgroup = the
// version): a canary is never blended with the incumbent.
(function () {
  "use strict";

  var live = window.SwitchyardLive;
  var config = JSON.parse(document.getElementById("dashboard-config").textContent);
  var PALETTE = ["#1f5fbf", "#d9480f", "#2b8a3e", "#7048e8", "#c2255c", "#0b7285", "#5c940d", "#e67700",
    "#495057", "#862e9c", "#1098ad", "#a61e4d"];
  var DASH = { p50: "dot", p95: "dash", p99: "solid" };
  var STAT_INDEX = { p50: 0, p95: 1, p99: 2 };
  var MAX_LIVE_POINTS = 600;
  var PLOT_CONFIG = { displaylogo: false, responsive: true,
    modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d", "toggleSpikelines"] };

  // --- state --------------------------------------------------------------------------------------
  var charted = [];      // versions, in the order they are drawn
  var points = {};       // version -> Map(time -> point)
  var replicas = {};     // replica id -> {version, x: [], kv: [], queue: []}

  // A version keeps its colour; no two charted versions share one (there are as many colours as charted
  // versions at most). By position among all versions, v13 took v1's.
  var colors = {};
  function assignColor(version, others) {
    var used = others.map(function (v) { return colors[v]; });
    var free = PALETTE.filter(function (c) { return used.indexOf(c) < 0; });
    colors[version] = free.length ? free[0] : PALETTE[others.length % PALETTE.length];
  }
  function colorOf(version) {
    if (!(version in colors)) { assignColor(version, Object.keys(colors)); }
    return colors[version];
  }

  function parseUtc(t) { return Date.parse(t.replace(" ", "T") + "Z"); }

  // `at`: the server's time of the data, which ages points out (not this browser's clock, which may be off).
  function addPoints(pointsByVersion, versions, at) {
    versions.forEach(function (version) {
      if (charted.indexOf(version) < 0) {
        charted.push(version);
        // Against the server's charted versions now (at most as many as there are colours), not every
        // one this page has drawn.
        var others = versions.filter(function (v) { return v !== version && v in colors; });
        var clash = others.some(function (v) { return colors[v] === colors[version]; });
        if (!(version in colors) || clash) { assignColor(version, others); }
      }
      if (!points[version]) { points[version] = new Map(); }
    });
    Object.keys(pointsByVersion).forEach(function (version) {
      if (!points[version]) { return; }
      pointsByVersion[version].forEach(function (p) { points[version].set(p.t, p); });
    });
    var cutoff = parseUtc(at) - (config.range.span_s + config.range.step_s) * 1000;
    Object.keys(points).forEach(function (version) {
      points[version].forEach(function (_, t) { if (parseUtc(t) < cutoff) { points[version].delete(t); } });
    });
  }

  function sorted(version) {
    return Array.from(points[version].values()).sort(function (a, b) {
      return a.t < b.t ? -1 : (a.t > b.t ? 1 : 0);
    });
  }

  function addReplicaSample(at, rows) {
    rows.forEach(function (r) {
      var s = replicas[r.replica_id];
      if (!s) { s = replicas[r.replica_id] = { version: r.version, x: [], kv: [], queue: [] }; }
      s.x.push(at); s.kv.push(r.kv_pct); s.queue.push(r.queue_depth);
      if (s.x.length > MAX_LIVE_POINTS) { s.x.shift(); s.kv.shift(); s.queue.shift(); }
    });
    // A replica gone (stopped, scaled down) for as long as the charts' live samples reach back is
    // dropped: a day of autoscaling would otherwise pile up hundreds of traces redrawn on every push.
    var keepAfter = parseUtc(at) - MAX_LIVE_POINTS * config.live_interval_s * 1000;
    Object.keys(replicas).forEach(function (id) {
      var s = replicas[id];
      if (parseUtc(s.x[s.x.length - 1]) < keepAfter) { delete replicas[id]; }
    });
  }

  // --- traces -------------------------------------------------------------------------------------
  function timeTraces(chart) {
    var traces = [];
    charted.forEach(function (version) {
      var pts = sorted(version);
      var x = pts.map(function (p) { return p.t; });
      var stats = chart.stats.length ? chart.stats : [null];
      stats.forEach(function (stat) {
        traces.push({
          type: "scatter", mode: "lines+markers", connectgaps: false,
          name: stat ? version + " " + stat : version, legendgroup: version,
          x: x,
          y: pts.map(function (p) { return stat ? p[chart.id][STAT_INDEX[stat]] : p[chart.id]; }),
          line: { color: colorOf(version), dash: stat ? DASH[stat] : "solid", width: stat === "p50" ? 1.5 : 2 },
          marker: { size: 5, color: colorOf(version) },
        });
      });
    });
    return traces;
  }

  // A per-tier p99 chart: one line per (version, tier) for the tiers that had requests in the range (a
  // point's field, "tier_ttft" say, holds only those of its own step), in the version's colour and the
  // tier's dash, best tier first (config.tier_dash's order).
  var TIER_ORDER = Object.keys(config.tier_dash);
  function tierRank(tier) {
    var i = TIER_ORDER.indexOf(tier);
    return i < 0 ? TIER_ORDER.length : i;
  }
  function tierTraces(field) {
    var traces = [];
    charted.forEach(function (version) {
      var pts = sorted(version);
      var tiers = [];
      pts.forEach(function (p) {
        Object.keys(p[field] || {}).forEach(function (tier) {
          if (tiers.indexOf(tier) < 0) { tiers.push(tier); }
        });
      });
      tiers.sort(function (a, b) { return tierRank(a) - tierRank(b); });
      var x = pts.map(function (p) { return p.t; });
      tiers.forEach(function (tier) {
        traces.push({
          type: "scatter", mode: "lines+markers", connectgaps: false,
          name: version + " " + tier, legendgroup: version, x: x,
          y: pts.map(function (p) { var v = (p[field] || {})[tier]; return v === undefined ? null : v; }),
          line: { color: colorOf(version), dash: config.tier_dash[tier] || "dashdot", width: 2 },
          marker: { size: 5, color: colorOf(version) },
        });
      });
    });
    return traces;
  }

  // A distribution over the range, one bar series per version: field "batch" (engine steps per batch
  // size) or "fill" (requests per queue-wait bin).
  function binTraces(field, labels) {
    return charted.map(function (version) {
      var sums = labels.map(function () { return 0; });
      points[version].forEach(function (p) { p[field].forEach(function (n, i) { sums[i] += n; }); });
      var total = sums.reduce(function (a, b) { return a + b; }, 0);
      return {
        type: "bar", name: version, legendgroup: version, x: labels,
        y: sums.map(function (n) { return total ? Math.round(1000 * n / total) / 10 : null; }),
        marker: { color: colorOf(version) },
      };
    });
  }

  function replicaTraces(field) {
    return Object.keys(replicas).sort().map(function (id) {
      var s = replicas[id];
      return {
        type: "scatter", mode: "lines", name: s.version + " · " + id.slice(-6), legendgroup: s.version,
        x: s.x.slice(), y: s[field].slice(), line: { color: colorOf(s.version), width: 2, shape: "hv" },
      };
    });
  }

  function hasData(traces) {
    return traces.some(function (t) { return t.y.some(function (v) { return v !== null && v !== undefined; }); });
  }

  function layout(unit, traces, extra) {
    var base = {
      margin: { l: 52, r: 10, t: 6, b: 30 }, autosize: true, uirevision: config.range.key,
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)", font: { size: 11 },
      xaxis: { type: "date", automargin: true },
      yaxis: { title: { text: unit }, rangemode: "tozero", automargin: true, zeroline: true },
      legend: { orientation: "h", x: 0, y: -0.18, yanchor: "top" }, showlegend: true,
      annotations: hasData(traces) ? [] : [{ text: "no data yet", showarrow: false, xref: "paper",
        yref: "paper", x: 0.5, y: 0.5, font: { color: "#98a2b3", size: 13 } }],
    };
    return Object.assign(base, extra || {});
  }

  function draw(id, traces, unit, extra) {
    var el = document.getElementById("chart-" + id);
    if (!el) { return; }
    Plotly.react(el, traces, layout(unit, traces, extra), PLOT_CONFIG);
  }

  function render() {
    config.charts.forEach(function (chart) { draw(chart.id, timeTraces(chart), chart.unit); });
    config.tier_charts.forEach(function (chart) { draw(chart.id, tierTraces(chart.id), chart.unit); });
    draw("batch", binTraces("batch", config.batch_bins), "% of steps",
      { barmode: "group", xaxis: { type: "category", title: { text: "batch size" }, automargin: true } });
    draw("fill", binTraces("fill", config.fill_bins), "% of requests",
      { barmode: "group", xaxis: { type: "category", title: { text: "queue wait" }, automargin: true } });
    draw("kv", replicaTraces("kv"), "%");
    draw("queue", replicaTraces("queue"), "requests");
  }

  // --- tables -------------------------------------------------------------------------------------

  function updateVersions(versions, lastMinute) {
    versions.forEach(function (v) {
      var row = document.querySelector('#versions-table tr[data-version="' + CSS.escape(v.version) + '"]');
      if (!row) { return; }
      live.setField(row, "traffic", v.traffic_pct + "%");
      live.stateBadge(row.querySelector('[data-field="state"]'), v.state);
      live.setField(row, "aliases", v.aliases.length ? v.aliases.join(", ") : "—");
      live.setField(row, "target_replicas", v.target_replicas === null ? "—" : String(v.target_replicas));
      var target = row.querySelector('[data-field="target_replicas"]');
      if (target) { target.title = v.target_reason; }
      var m = lastMinute[v.version];
      if (m) {
        live.setField(row, "req_s", live.fmt(m.req_s, "", 2));
        live.setField(row, "err_pct", live.fmt(m.err_pct, "%", 2));
        live.setField(row, "ttft_p99_ms", live.fmt(m.ttft_p99_ms, " ms", 1));
        live.setField(row, "tpot_p99_ms", live.fmt(m.tpot_p99_ms, " ms", 1));
        live.setField(row, "queue_wait_p99_ms", live.fmt(m.queue_wait_p99_ms, " ms", 1));
      }
    });
    document.querySelectorAll("[data-swatch]").forEach(function (el) {
      el.style.background = colorOf(el.dataset.swatch);
    });
  }

  function updateDeployment(deployment) {
    var el = document.getElementById("deployment-state");
    if (el && deployment && el.textContent !== deployment.state) { el.textContent = deployment.state; }
  }

  // --- live feed ----------------------------------------------------------------------------------
  var numUpdates = 0;
  function apply(update) {
    addPoints(update.points, update.charted, update.at);
    addReplicaSample(update.at, update.replicas);
    updateVersions(update.versions, update.last_minute);
    live.renderReplicas(document.getElementById("replicas-table"), update.replicas, false);
    updateDeployment(update.deployment);
    render();
    numUpdates += 1;
    document.body.dataset.liveUpdates = String(numUpdates);
  }

  addPoints(config.points, config.charted, config.at);
  addReplicaSample(config.at, config.replicas);
  updateVersions(config.versions, config.last_minute);
  render();
  live.connect(config.ws_path, apply);
}());
