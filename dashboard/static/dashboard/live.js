// The dashboard's live feed: one WebSocket to /dashboard/ws/models/{model}/, reconnected with backoff.
// SwitchyardLive.connect(path, onUpdate) calls onUpdate(message) for every pushed update and keeps the
// #live-status indicator (when the page has one) current. Close codes 4403/4404 are final.
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

  window.SwitchyardLive = { connect: connect, setStatus: setStatus };
}());
