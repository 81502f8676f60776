// capturestore report: tabs, lazy figures, on-demand prompt pages. Data is read with JSON.parse
// and shown with textContent / Plotly only: nothing from the store is ever inserted as HTML.
(function () {
  "use strict";
  // The overview holds no figure: index.html loads plotly.min.js (about 5 MB) only when a tab
  // with figures opens, so the first page is usable before it is parsed.
  var waiting = [];
  function withPlotly(fn) {
    if (window.Plotly) { fn(); return; }
    waiting.push(fn);
    if (waiting.length > 1) return;
    var s = document.createElement("script");
    s.src = document.body.getAttribute("data-plotly");
    s.onload = function () { var w = waiting; waiting = []; w.forEach(function (f) { f(); }); };
    document.head.appendChild(s);
  }
  function renderFigures(root) {
    if (!root.querySelector("div.fig[data-fig]:not([data-done])")) return;
    if (!window.Plotly) { withPlotly(function () { renderFigures(root); }); return; }
    root.querySelectorAll("div.fig[data-fig]:not([data-done])").forEach(function (div) {
      if (observer) observer.observe(div); else draw(div);
    });
  }
  function draw(div) {
    if (div.hasAttribute("data-done")) return;
    var spec = JSON.parse(document.getElementById(div.getAttribute("data-fig")).textContent);
    div.setAttribute("data-done", "1");
    Plotly.newPlot(div, spec.data, spec.layout, {displaylogo: false, responsive: true});
  }
  // a figure is drawn when it comes near the viewport: a prompt page of 32 layers is usable
  // before its last heatmap is drawn
  var observer = window.IntersectionObserver ? new IntersectionObserver(function (entries) {
    entries.forEach(function (e) {
      if (e.isIntersecting) { observer.unobserve(e.target); draw(e.target); }
    });
  }, {rootMargin: "300px"}) : null;
  function showTab(name) {
    var found = false;
    document.querySelectorAll("nav.tabs button").forEach(function (b) {
      var on = b.getAttribute("data-tab") === name;
      found = found || on;
      b.setAttribute("aria-selected", on ? "true" : "false");
    });
    if (!found) return false;
    document.querySelectorAll("section.tab").forEach(function (s) {
      s.hidden = s.id !== "tab-" + name;
      if (!s.hidden) renderFigures(s);
    });
    return true;
  }
  function openPrompt(page) {
    var link = document.querySelector('.sidebar a[data-page="' + page + '"]');
    var frame = document.getElementById("prompt-frame");
    if (!link || !frame) return;
    showTab("prompts");
    document.querySelectorAll(".sidebar a.active").forEach(function (a) { a.classList.remove("active"); });
    link.classList.add("active");
    if (frame.getAttribute("src") !== link.getAttribute("href")) frame.setAttribute("src", link.getAttribute("href"));
  }
  function route() {
    var h = decodeURIComponent(location.hash.slice(1));
    if (h.indexOf("prompt-") === 0) { openPrompt(h.slice(7)); return; }
    if (h.indexOf("query-") === 0) { showTab("queries"); var q = document.getElementById(h); if (q) q.scrollIntoView(); return; }
    if (!showTab(h)) showTab("overview");
  }
  document.addEventListener("DOMContentLoaded", function () {
    // a click shows its tab at once; hashchange (a later task) routes back/forward and typed links
    document.querySelectorAll("nav.tabs button").forEach(function (b) {
      b.addEventListener("click", function () { location.hash = b.getAttribute("data-tab"); route(); });
    });
    document.querySelectorAll(".sidebar a[data-page]").forEach(function (a) {
      a.addEventListener("click", function (ev) { ev.preventDefault(); location.hash = "prompt-" + a.getAttribute("data-page"); route(); });
    });
    var filter = document.getElementById("prompt-filter"), failing = document.getElementById("prompt-failing");
    function applyFilter() {
      var want = filter.value.toLowerCase();
      document.querySelectorAll(".sidebar a[data-page]").forEach(function (a) {
        var dot = a.querySelector(".dot");
        var bad = dot && (dot.classList.contains("fail") || dot.classList.contains("warn"));
        a.hidden = (want && a.textContent.toLowerCase().indexOf(want) < 0 && (a.title || "").toLowerCase().indexOf(want) < 0)
          || (failing.checked && !bad);
      });
    }
    if (filter) { filter.addEventListener("input", applyFilter); failing.addEventListener("change", applyFilter); }
    window.addEventListener("hashchange", route);
    if (document.querySelector("nav.tabs")) route(); else renderFigures(document);
  });
})();
