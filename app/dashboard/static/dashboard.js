// The dashboard view: one push stream of per-second samples (the server aggregates them from the engine's
// stats), drawn with uPlot. Each panel's figure carries `data-latest`, its main series' newest value.
import { apiFetch, sseData, Unauthorized } from "./api.js";

const BLUE = "#2563eb", SKY = "#7dd3fc", GREEN = "#16a34a", LIME = "#86efac", ORANGE = "#ea580c",
  PURPLE = "#7c3aed", GREY = "#6b7385", RED = "#dc2626", AMBER = "#d97706";
const HEIGHT = 200;

// Axis labels: 1.5k, 2M.
const compact = new Intl.NumberFormat(undefined, { notation: "compact", maximumFractionDigits: 1 });
const axisValues = (u, splits) => splits.map((v) => (v == null ? "" : compact.format(v)));
const clock = (u, splits) => splits.map((t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false }));

const pct = (v) => (v == null ? null : 100 * v);
const pick = (key, i) => (s) => (s[key] == null ? null : s[key][i]);
const latencySeries = (key) => [
  { label: "p50", stroke: BLUE, value: pick(key, 0) },
  { label: "p90", stroke: ORANGE, value: pick(key, 1) },
  { label: "p99", stroke: RED, value: pick(key, 2) },
];

// Time-series panels: each series reads its value from a sample; `slo` adds a dashed objective line.
function timePanels(config) {
  const panels = {
    throughput: { series: [
      { label: "output 1 s", stroke: BLUE, value: (s) => s.output_tps },
      { label: "output 1 min", stroke: SKY, value: (s) => s.output_tps_1m, width: 2 },
      { label: "prompt 1 s", stroke: GREEN, value: (s) => s.prompt_tps },
      { label: "prompt 1 min", stroke: LIME, value: (s) => s.prompt_tps_1m, width: 2 },
    ] },
    // A second in which no step decoded (a long prefill step) has no mean: the line spans it.
    batch: { series: [{ label: "decode batch", stroke: PURPLE, value: (s) => s.decode_batch, fill: "#7c3aed22",
      spanGaps: true }],
      range: [0, config.max_num_seqs] },
    kv: { series: [
      { label: "pages used", stroke: BLUE, value: (s) => s.kv_used, fill: "#2563eb22" },
      { label: "pages total", stroke: GREY, value: (s) => s.kv_total, dash: [4, 4] },
      { label: "prefix hit %", stroke: GREEN, value: (s) => pct(s.prefix_hit_rate), scale: "%" },
    ] },
    requests: { series: [
      { label: "running", stroke: BLUE, value: (s) => s.running },
      { label: "waiting", stroke: ORANGE, value: (s) => s.waiting },
      { label: "queue wait ms", stroke: GREY, value: (s) => s.queue_wait_ms, scale: "ms" },
    ] },
    roofline: { series: [
      { label: "compute %", stroke: ORANGE, value: (s) => pct(s.compute_fraction) },
      { label: "memory %", stroke: BLUE, value: (s) => pct(s.memory_fraction) },
      { label: "engine busy %", stroke: GREY, value: (s) => pct(s.busy_fraction), dash: [2, 3] },
    ], range: [0, 100] },
    ttft: { series: latencySeries("ttft_ms"), slo: config.slo_ttft_ms },
    itl: { series: latencySeries("itl_ms"), slo: config.slo_itl_ms },
    e2e: { series: latencySeries("e2e_ms") },
    errors: { series: [
      { label: "400", stroke: AMBER, value: (s) => s.errors["400"] },
      { label: "429", stroke: ORANGE, value: (s) => s.errors["429"] },
      { label: "5xx", stroke: RED, value: (s) => s.errors["5xx"] },
      { label: "aborted", stroke: GREY, value: (s) => s.errors.aborted },
    ] },
  };
  if (config.speculative) {
    panels.spec = { series: [{ label: "accepted %", stroke: GREEN, value: (s) => pct(s.spec_acceptance) }],
      range: [0, 100] };
  }
  if (config.prefix_store) {
    panels.store = { series: [
      { label: "RAM MB", stroke: BLUE, value: (s) => s.store_ram_mb },
      { label: "disk MB", stroke: ORANGE, value: (s) => s.store_disk_mb },
      { label: "found %", stroke: GREEN, value: (s) => pct(s.store_hit_rate), scale: "%" },
    ] };
  }
  for (const panel of Object.values(panels)) {
    if (panel.slo != null) panel.series.push({ label: "SLO", stroke: RED, dash: [6, 4], value: () => panel.slo });
  }
  return panels;
}

function chartWidth(figure) {
  return Math.max(figure.clientWidth - 16, 200);
}

// `view()`: the [from, to] seconds the x axis shows (the chosen span, ending at the newest sample).
function timeChart(figure, panel, view) {
  const scales = { x: { time: true, range: () => view() } };
  if (panel.range) scales.y = { range: panel.range };
  const extra = [...new Set(panel.series.map((s) => s.scale).filter(Boolean))];
  const axes = [{ space: 70, values: clock }, { size: 50, values: axisValues },
    ...extra.map((scale) => ({ scale, side: 1, size: 50, values: axisValues, grid: { show: false } }))];
  const series = [{}, ...panel.series.map((s) => ({
    label: s.label, stroke: s.stroke, width: s.width || 1.5, dash: s.dash, fill: s.fill, scale: s.scale || "y",
    spanGaps: Boolean(s.spanGaps), points: { show: false },
  }))];
  return new uPlot({ width: chartWidth(figure), height: HEIGHT, scales, axes, series, legend: { live: false } },
    [[], ...panel.series.map(() => [])], figure.querySelector(".chart"));
}

function histogramChart(figure) {
  return new uPlot({
    width: chartWidth(figure), height: HEIGHT,
    scales: { x: { time: false } },
    axes: [{ label: "sequences decoded per step" }, { size: 50, values: axisValues }],
    series: [{}, { label: "steps", stroke: PURPLE, fill: "#7c3aed66", paths: uPlot.paths.bars({ size: [0.8, 40] }),
      points: { show: false } }],
    legend: { show: false },
  }, [[], []], figure.querySelector(".chart"));
}

const fmt = (v, digits = 0) => (v == null ? "–" : Number(v).toLocaleString(undefined, { maximumFractionDigits: digits }));

export class Dashboard {
  constructor(root, status, askForKey) {
    this.root = root;
    this.status = status;
    this.askForKey = askForKey;
    this.samples = [];
    this.charts = null;
    this.span = document.getElementById("range");
    this.span.addEventListener("change", () => this.charts && this.render());
  }

  view() {
    const to = this.samples.length ? this.samples[this.samples.length - 1].t : Date.now() / 1000;
    return [to - Number(this.span.value), to];
  }

  setStatus(state, text) {
    this.status.dataset.state = state;
    this.status.textContent = text;
  }

  async connect() {
    for (;;) {
      try {
        const response = await apiFetch("/dashboard/events");
        if (!response.ok) throw new Error(`HTTP ${response.status}`);
        this.setStatus("live", "live");
        for await (const data of sseData(response)) this.receive(JSON.parse(data));
        this.setStatus("connecting", "reconnecting");
      } catch (error) {
        if (error instanceof Unauthorized) {
          this.setStatus("error", "API key needed");
          await this.askForKey();
          continue;
        }
        this.setStatus("error", `disconnected (${error.message})`);
      }
      await new Promise((resolve) => setTimeout(resolve, 2000));
    }
  }

  receive(message) {
    if (message.config) {
      this.config = message.config;
      this.samples = message.history;
      this.build();
    } else {
      this.samples.push(message.sample);
      const keep = this.config.history_s / this.config.tick_s;
      if (this.samples.length > keep) this.samples.splice(0, this.samples.length - keep);
    }
    this.live = message.live;
    this.render();
  }

  build() {
    if (this.charts) Object.values(this.charts).forEach(({ plot }) => plot.destroy());
    this.panels = timePanels(this.config);
    this.root.querySelector("#panel-spec").hidden = !this.config.speculative;
    this.root.querySelector("#panel-store").hidden = !this.config.prefix_store;
    this.charts = {};
    for (const [name, panel] of Object.entries(this.panels)) {
      const figure = this.root.querySelector(`#panel-${name}`);
      this.charts[name] = { figure, plot: timeChart(figure, panel, () => this.view()) };
    }
    const histogram = this.root.querySelector("#panel-histogram");
    this.charts.histogram = { figure: histogram, plot: histogramChart(histogram) };
    if (!this.resizing) {
      this.resizing = new ResizeObserver(() => this.resize());
      this.resizing.observe(this.root);
      window.addEventListener("resize", () => this.resize());
    }
  }

  resize() {
    for (const { figure, plot } of Object.values(this.charts || {})) {
      if (figure.clientWidth) plot.setSize({ width: chartWidth(figure), height: HEIGHT });
    }
  }

  render() {
    const samples = this.samples;
    const times = samples.map((s) => s.t);
    for (const [name, panel] of Object.entries(this.panels)) {
      const { figure, plot } = this.charts[name];
      const columns = panel.series.map((series) => samples.map(series.value));
      plot.setData([times, ...columns]);
      const latest = columns[0][columns[0].length - 1];
      figure.dataset.latest = latest == null ? "" : String(latest);
    }
    const counts = this.live.decode_batch_histogram;
    const { figure, plot } = this.charts.histogram;
    plot.setData([counts.map((_, i) => i + 1), counts]);
    figure.dataset.latest = String(counts.reduce((a, b) => a + b, 0));
    this.renderTiles(samples[samples.length - 1]);
    this.renderErrors();
  }

  renderTiles(s) {
    if (!s) return;
    const set = (id, text) => { this.root.querySelector(`#${id}`).textContent = text; };
    set("tile-output", `${fmt(s.output_tps)} / ${fmt(s.output_tps_1m)}`);
    set("tile-prompt", `${fmt(s.prompt_tps)} / ${fmt(s.prompt_tps_1m)}`);
    set("tile-batch", fmt(s.decode_batch, 1));
    set("tile-kv", `${fmt(s.kv_used)} / ${fmt(s.kv_total)}`);
    set("tile-requests", `${fmt(s.running)} / ${fmt(s.waiting)}`);
    set("tile-latency", `${fmt(s.ttft_ms && s.ttft_ms[0])} / ${fmt(s.itl_ms && s.itl_ms[0], 1)} ms`);
    set("tile-roofline", `${fmt(pct(s.compute_fraction), 1)}% / ${fmt(pct(s.memory_fraction), 1)}%`);
    const totals = this.live.error_totals;
    set("tile-errors", Object.entries(totals).map(([kind, n]) => `${kind}: ${n}`).join(" · "));
  }

  renderErrors() {
    const rows = this.root.querySelector("#error-rows");
    rows.replaceChildren(...this.live.recent_errors.map((e) => {
      const row = document.createElement("tr");
      for (const text of [new Date(e.unix_s * 1000).toLocaleTimeString(), e.kind, e.status, e.source, e.message]) {
        const cell = document.createElement("td");
        cell.textContent = String(text);
        row.append(cell);
      }
      return row;
    }));
  }
}
