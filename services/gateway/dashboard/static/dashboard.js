// Quartermaster dashboard: the few behaviours htmx does not give on its own.
(function () {
  "use strict";
  var paused = false;
  var held = 0;

  function pauseButton() { return document.getElementById("live-pause"); }

  // Pausing keeps the page still: incoming updates are counted, not applied.
  document.addEventListener("click", function (event) {
    var button = event.target.closest("#live-pause");
    if (!button) { return; }
    paused = !paused;
    button.textContent = paused ? "Resume live updates" : "Pause live updates";
    button.setAttribute("aria-pressed", paused ? "true" : "false");
    document.body.classList.toggle("paused", paused);
    if (!paused && held > 0) { window.location.reload(); }
    var note = document.getElementById("live-held");
    if (note) { note.textContent = ""; }
    held = 0;
  });

  document.addEventListener("htmx:sseBeforeMessage", function (event) {
    if (!paused) { return; }
    event.preventDefault();
    held += 1;
    var note = document.getElementById("live-held");
    if (note) { note.textContent = held + " update(s) held while paused"; }
  });

  // Select every row of the page for a bulk action.
  document.addEventListener("change", function (event) {
    if (event.target.id !== "select-all") { return; }
    document.querySelectorAll("input[name=job_id]").forEach(function (box) {
      box.checked = event.target.checked;
    });
  });

  // The jobs table's stream says `ready` once it follows every change (tests wait for it).
  document.addEventListener("htmx:sseMessage", function (event) {
    if (event.detail && event.detail.type === "ready") { document.body.dataset.live = "ready"; }
  });

  // Views other than the jobs table reload themselves when something they show changed,
  // at most every two seconds.
  var last = 0;
  var timer = null;
  document.addEventListener("htmx:sseMessage", function (event) {
    if (!event.detail || event.detail.type !== "changed") { return; }
    var view = document.getElementById("view");
    if (!view || paused) { return; }
    var wait = Math.max(0, 2000 - (Date.now() - last));
    if (timer) { return; }
    timer = setTimeout(function () {
      timer = null;
      last = Date.now();
      htmx.ajax("GET", window.location.pathname + window.location.search,
        { target: "#view", select: "#view", swap: "outerHTML" });
    }, wait);
  });

  // Charts: a <div class="chart" data-chart='{"x": [...], "series": {"name": [...]}}'>.
  var palette = ["#1f5fbf", "#c0392b", "#2e7d32", "#b26a00", "#7e57c2", "#00838f", "#6d4c41"];
  function drawCharts(root) {
    if (typeof uPlot === "undefined") { return; }
    root.querySelectorAll("div.chart[data-chart]").forEach(function (el) {
      if (el.dataset.drawn) { return; }
      el.dataset.drawn = "1";
      var spec = JSON.parse(el.dataset.chart);
      var names = Object.keys(spec.series);
      var data = [spec.x].concat(names.map(function (n) { return spec.series[n]; }));
      var series = [{}].concat(names.map(function (n, i) {
        return { label: n, stroke: palette[i % palette.length], width: 2 };
      }));
      new uPlot({ width: Math.min(el.clientWidth || 900, 1200), height: 220, series: series,
        axes: [{}, { label: el.dataset.unit || "" }] }, data, el);
    });
  }
  document.addEventListener("DOMContentLoaded", function () { drawCharts(document); });
  document.addEventListener("htmx:afterSettle", function (event) { drawCharts(event.target); });
})();
