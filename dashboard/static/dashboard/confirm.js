// Forms with data-confirm ask first (the Promote and Rollback buttons). A plain script, no inline handlers.
"use strict";
document.addEventListener("submit", function (event) {
  var form = event.target;
  var message = form && form.dataset ? form.dataset.confirm : null;
  if (message && !window.confirm(message)) {
    event.preventDefault();
  }
});
