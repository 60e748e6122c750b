// carpool's dashboard: one panel per model, one uPlot chart per group of series the
// server names (GET /dashboard/series); redrawn each second from the server's ring.
"use strict";
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
const panels = {};  // model -> {element, charts: {title: {plot, series}}}

function chartWidth() {
  return Math.max(280, Math.min(460, Math.floor((window.innerWidth - 110) / 3)));
}

function makeChart(parent, title, series) {
  const box = document.createElement("div");
  box.className = "chart";
  box.dataset.title = title;
  const label = document.createElement("div");
  label.className = "title";
  label.textContent = title;
  box.appendChild(label);
  parent.appendChild(box);
  const options = {
    width: chartWidth(),
    height: 160,
    legend: { show: true },
    scales: { x: { time: true } },
    series: [{}].concat(series.map((name, i) => ({
      label: name, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false,
    }))),
  };
  const empty = [[]].concat(series.map(() => []));
  return { plot: new uPlot(options, empty, box), series: series.join("\n"), box: box };
}

function panelFor(name) {
  if (!panels[name]) {
    const element = document.createElement("section");
    element.className = "panel";
    element.dataset.model = name;
    const heading = document.createElement("h2");
    heading.textContent = name;
    const charts = document.createElement("div");
    charts.className = "charts";
    element.append(heading, charts);
    document.getElementById("models").appendChild(element);
    panels[name] = { element: element, chartsElement: charts, charts: {} };
  }
  return panels[name];
}

function draw(name, model) {
  const panel = panelFor(name);
  for (const chart of model.charts) {
    if (chart.series.length === 0) continue;
    let entry = panel.charts[chart.title];
    if (entry && entry.series !== chart.series.join("\n")) {  // new series (a new class): rebuild
      entry.plot.destroy();
      entry.box.remove();
      entry = undefined;
    }
    if (!entry) entry = panel.charts[chart.title] = makeChart(panel.chartsElement, chart.title, chart.series);
    const data = [model.t].concat(chart.series.map((s) => model.series[s]));
    entry.plot.setData(data);
    // How many values it draws (nulls aside): what a test reads to see the chart has data.
    const points = data.slice(1).reduce((n, column) => n + column.filter((v) => v !== null).length, 0);
    entry.box.dataset.points = String(points);
  }
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    const response = await fetch("/dashboard/series", { cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const document_ = await response.json();
    const names = Object.keys(document_.models).sort();
    for (const name of names) draw(name, document_.models[name]);
    status.textContent = names.length + " model(s), last " + document_.capacity + " s at " +
      document_.interval_s + " s; updated " + new Date().toLocaleTimeString();
  } catch (error) {
    status.textContent = "reconnecting... (" + error.message + ")";
  }
}

refresh();
setInterval(refresh, 1000);
