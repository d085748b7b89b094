// memsentry HTML report: draws the charts from the data embedded in the page, links findings
// and the timeline both ways, sorts the layer table and folds its module tree. No request
// leaves the page.
function memsentryRender(dom) {
  "use strict";
  var root = document.getElementById(dom);
  var data = JSON.parse(document.getElementById(dom + "-data").textContent);
  var config = {displaylogo: false, responsive: true,
                modeBarButtonsToRemove: ["sendDataToCloud", "lasso2d", "select2d"]};

  function drawCharts() {
    var charts = root.querySelectorAll("[data-chart]");
    for (var i = 0; i < charts.length; i++) {
      var div = charts[i], figure = data.figures[div.getAttribute("data-chart")];
      if (!figure) { continue; }
      if (typeof Plotly === "undefined") {
        div.textContent = "The chart needs plotly.js, which is not on this page " +
          "(in a notebook it comes with the first memsentry report shown): " +
          "display the report again or open report.to_html(path).";
        continue;
      }
      Plotly.newPlot(div, figure.data, figure.layout, config);
      if (div.getAttribute("data-chart") === "timeline") { linkFindings(div); }
    }
  }

  function flash(card) {
    card.classList.add("flash");
    card.scrollIntoView({block: "center"});
    setTimeout(function () { card.classList.remove("flash"); }, 1600);
  }

  function linkFindings(div) {
    // A finding's marker, clicked, shows its card.
    div.on("plotly_click", function (event) {
      var point = event.points && event.points[0];
      if (!point || point.customdata === undefined) { return; }
      var card = document.getElementById(dom + "-f" + point.customdata);
      if (card) { flash(card); }
    });
    // A card's link marks its iteration on the timeline.
    var links = root.querySelectorAll("a.jump");
    for (var i = 0; i < links.length; i++) {
      links[i].addEventListener("click", function (event) {
        event.preventDefault();
        var x = Number(this.getAttribute("data-iteration"));
        var shapes = (div.layout.shapes || []).filter(function (s) { return !s.memsentry; });
        shapes.push({type: "line", xref: "x", yref: "paper", x0: x, x1: x, y0: 0, y1: 1,
                     memsentry: true, line: {color: "#f5a300", width: 3}});
        Plotly.relayout(div, {shapes: shapes});
        div.scrollIntoView({block: "center"});
      });
    }
  }

  function setupTable(table) {
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var folded = {};
    function hiddenByFold(row) {
      var parent = row.getAttribute("data-parent");
      while (parent !== null) {
        if (folded[parent]) { return true; }
        parent = rows[Number(parent)].getAttribute("data-parent");
      }
      return false;
    }
    function showTree() {
      rows.forEach(function (row) { row.classList.toggle("hidden", hiddenByFold(row)); });
    }
    rows.forEach(function (row) {
      var button = row.querySelector("button.fold");
      if (!button) { return; }
      button.addEventListener("click", function () {
        var id = row.getAttribute("data-row");
        folded[id] = !folded[id];
        button.textContent = folded[id] ? "▸" : "▾";
        showTree();
      });
    });
    var headings = table.tHead.rows[0].cells;
    var order = {column: 0, descending: false};
    Array.prototype.forEach.call(headings, function (th) {
      th.addEventListener("click", function () {
        var column = Number(th.getAttribute("data-col"));
        var descending = order.column === column ? !order.descending : column > 1;
        if (column === 0) { descending = false; }
        order = {column: column, descending: descending};
        var sorted = rows.slice().sort(function (a, b) {
          var va = a.cells[column].getAttribute("data-v");
          var vb = b.cells[column].getAttribute("data-v");
          var na = Number(va), nb = Number(vb);
          var cmp = (isNaN(na) || isNaN(nb)) ? va.localeCompare(vb) : na - nb;
          return descending ? -cmp : cmp;
        });
        sorted.forEach(function (row) { body.appendChild(row); });
        Array.prototype.forEach.call(headings, function (h) {
          h.classList.remove("sorted-asc", "sorted-desc");
        });
        th.classList.add(descending ? "sorted-desc" : "sorted-asc");
        if (column === 0) { showTree(); }  // the tree, in call order
        else { rows.forEach(function (row) { row.classList.remove("hidden"); }); }
      });
    });
  }

  drawCharts();
  Array.prototype.forEach.call(root.querySelectorAll("table.layers"), setupTable);
}
