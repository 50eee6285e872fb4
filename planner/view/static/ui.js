/* vbs-serve page: each model's plans (Fig. 9, Table III), its time per sample against memory
 * (Fig. 7) and its live traffic, drawn as plain SVG from the service's JSON endpoints.
 *
 * Two sources of data, one drawing code: ServiceSource reads the running service (GET /models,
 * /models/{name}/tree, /models/{name}/curves, /plan, /models/{name}/stats), asking for the API
 * key once when the service answers 401; StaticSource reads the plans embedded by
 * `vbs show --html` and looks them up as PlanTable.find does (the last breakpoint at or below
 * the budget), answering in /plan's shape. No library, no build step, nothing fetched from
 * elsewhere: the page works offline.
 */
'use strict';
(function () {
  const STRATEGIES = ['vbs', 'paper', 'greedy', 'fbs', 'fbs-best'];
  const COLORS = {vbs: '#1f4e9e', paper: '#a8480a', greedy: '#1b6b34', fbs: '#6a2a80',
                  'fbs-best': '#a0101c'};
  const DASHES = {vbs: '', paper: '7 3', greedy: '2 3', fbs: '9 3 2 3', 'fbs-best': '4 2'};
  const PHASE_FILLS = ['#1f4e9e', '#2f66b8'];
  const RUNTIME_SHORT = {onnxruntime: 'ort', cudagraph: 'graph', torch: 'torch'};  // a unit's runtime, beside its name
  const SLIDER_STEPS = 200;
  const LIVE_EVERY_MS = 1500;
  const MODELS_EVERY_MS = 5000;
  const KEY_STORE = 'vbs-api-key';
  const SVG_NS = 'http://www.w3.org/2000/svg';

  // ------------------------------------------------------------------ formatting

  function fmtBytes(n) {
    if (n === null || n === undefined) return '-';
    const sign = n < 0 ? '-' : '';
    let v = Math.abs(n);
    const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    for (let i = 0; i < units.length; i++) {
      if (v < 1024 || i === units.length - 1) {
        return i === 0 ? `${sign}${Math.floor(v)} B` : `${sign}${v.toFixed(2)} ${units[i]}`;
      }
      v /= 1024;
    }
    return String(n);
  }

  function fmtSeconds(s) {
    if (s === null || s === undefined) return '-';
    if (s >= 1) return `${s.toFixed(3)} s`;
    if (s >= 1e-3) return `${(s * 1e3).toFixed(3)} ms`;
    return `${(s * 1e6).toFixed(1)} µs`;
  }

  /* How many times faster ours is: as `vbs plan` measured both where it ran both, else as
     predicted (planner.solver.compare.speedup, which /plan answers with). */
  function speedup(ours, other) {
    if (!(ours.feasible && other.feasible)) return null;
    const measured = ours.measured_time_total_s != null && other.measured_time_total_s != null;
    const a = measured ? ours.measured_time_total_s : ours.time_total_s;
    const b = measured ? other.measured_time_total_s : other.time_total_s;
    return a > 0 ? b / a : null;
  }

  function fmtClock(unix) {
    return unix ? new Date(unix * 1000).toLocaleString() : '-';
  }

  // ------------------------------------------------------------------ DOM

  function el(tag, attrs, ...kids) {
    return build(document.createElement(tag), attrs, kids);
  }

  function svgEl(tag, attrs, ...kids) {
    return build(document.createElementNS(SVG_NS, tag), attrs, kids);
  }

  function build(node, attrs, kids) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'text') node.textContent = v;
      else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? '' : String(v));
    }
    for (const kid of kids) {
      if (kid === null || kid === undefined) continue;
      node.append(typeof kid === 'string' ? document.createTextNode(kid) : kid);
    }
    return node;
  }

  const $ = (sel, root) => (root || document).querySelector(sel);
  const wait = ms => new Promise(resolve => setTimeout(resolve, ms));

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function describeError(err) {
    if (err instanceof ApiError) {
      return err.status ? `The service answered ${err.status}: ${err.message}` : err.message;
    }
    return `Something went wrong in this page: ${err && err.message ? err.message : err}`;
  }

  // ------------------------------------------------------------------ the running service

  class ServiceSource {
    constructor() {
      this.live = true;
      this.base = location.pathname.replace(/\/ui\/?$/, '/');
      this.key = sessionStorage.getItem(KEY_STORE) || null;
      this.asking = null;
    }

    describe() {
      return `Live from the service at ${location.host}; plans from its tables, traffic every ` +
             `${LIVE_EVERY_MS / 1000} s.`;
    }

    async get(path) {
      for (;;) {
        const key = this.key;
        const headers = {Accept: 'application/json'};
        if (key) headers.Authorization = `Bearer ${key}`;
        let response;
        try {
          response = await fetch(this.base + path, {headers, cache: 'no-store'});
        } catch (err) {
          throw new ApiError(0, `The service did not answer ${path} (${err.message}): is it ` +
                                'still running?');
        }
        let body = null;
        try { body = await response.json(); } catch (_) { body = null; }
        const message = body && typeof body.error === 'string' ? body.error : null;
        if (response.status === 401) {
          if (this.key !== key) continue;  // a key was entered meanwhile: try it
          await this.askKey(message || 'this service needs its API key', Boolean(key));
          continue;
        }
        if (!response.ok) {
          throw new ApiError(response.status, message || `${response.status} ${response.statusText}`);
        }
        return body;
      }
    }

    /* One prompt for every request that needs the key; resolves when a key is entered. */
    askKey(why, refused) {
      if (this.asking) return this.asking;
      const form = $('#key-form');
      const input = $('#api-key');
      const error = $('#key-error');
      error.hidden = !refused;
      error.textContent = refused ? `The service refused that key: ${why}` : '';
      form.hidden = false;
      input.focus();
      this.asking = new Promise(resolve => {
        form.onsubmit = event => {
          event.preventDefault();
          const value = input.value.trim();
          if (!value) return;
          this.key = value;
          try { sessionStorage.setItem(KEY_STORE, value); } catch (_) { /* private mode */ }
          input.value = '';
          form.hidden = true;
          error.hidden = true;
          this.asking = null;
          resolve();
        };
      });
      return this.asking;
    }

    models() { return this.get('models'); }
    tree(name) { return this.get(`models/${encodeURIComponent(name)}/tree`); }
    curves(name, r) { return this.get(`models/${encodeURIComponent(name)}/curves?batch=${r}`); }
    stats(name) { return this.get(`models/${encodeURIComponent(name)}/stats`); }
    plan(name, budget, r) {
      return this.get(`plan?model=${encodeURIComponent(name)}&mem=${budget}&batch=${r}` +
                      '&program=true');
    }
  }

  // ------------------------------------------------------------------ a file, no service

  class StaticSource {
    constructor(data) {
      this.live = false;
      this.title = data.title;
      this.books = new Map(data.books.map(b => [b.name, b]));
    }

    describe() {
      return 'A static file written by `vbs show --html`: the plans of its tables, no live ' +
             'traffic (open the service\'s /ui for that).';
    }

    book(name) {
      const b = this.books.get(name);
      if (!b) throw new ApiError(404, `model: no model '${name}' in this file`);
      return b;
    }

    async models() {
      return {models: [...this.books.values()].map(b => ({
        name: b.name, model: b.meta.model || b.name, state: 'ready', batch_max: b.batch_max,
        sizes: b.sizes, input_shape: b.meta.input_shape || null, device: b.meta.device || null,
        dtype: b.meta.dtype || null, fingerprint: b.fingerprint,
        table: {solver: b.table_solver, objective: b.objective, version: null}}))};
    }

    async tree(name) { return {model: name, root: this.book(name).tree}; }

    row(b, s, r) {
      const row = b.strategies[s].rows[String(r)];
      if (!row) throw new ApiError(400, `batch: this file holds request sizes ${b.sizes.join(', ')}`);
      return row;
    }

    async curves(name, r) {
      const b = this.book(name);
      const strategies = {};
      let low = Infinity, high = -Infinity;
      for (const s of Object.keys(b.strategies)) {
        const plans = b.strategies[s].plans;
        const row = this.row(b, s, r);
        strategies[s] = row.peaks.map((bytes, k) => ({
          bytes, time_per_sample_s: plans[row.plans[k]].time_per_sample_s,
          plan_id: plans[row.plans[k]].plan_id}));
        if (row.peaks.length) {
          low = Math.min(low, row.peaks[0]);
          high = Math.max(high, row.peaks[row.peaks.length - 1]);
        }
      }
      return {model: name, batch: r, table_solver: b.table_solver, baseline: b.baseline,
              low_bytes: low, high_bytes: high, strategies};
    }

    answer(b, s, r, budget) {
      const strategy = b.strategies[s];
      const row = this.row(b, s, r);
      let k = -1;  // the last breakpoint at or below the budget (PlanTable.find)
      for (let lo = 0, hi = row.peaks.length - 1; lo <= hi;) {
        const mid = (lo + hi) >> 1;
        if (row.peaks[mid] <= budget) { k = mid; lo = mid + 1; } else { hi = mid - 1; }
      }
      if (k < 0) {
        const need = row.peaks.length ? row.peaks[0] : null;
        const reason = need === null
          ? `${s} has no plan of ${r} samples: plan with a larger table (more slots) or send fewer samples`
          : `no ${s} plan of ${r} samples fits in ${budget} bytes: it needs at least ${need} ` +
            `bytes, ${need - budget} more; free memory or send fewer samples`;
        return {feasible: false, solver: s, reason, needs_bytes: need};
      }
      const p = strategy.plans[row.plans[k]];
      return {
        feasible: true, solver: s, plan_id: p.plan_id, time_total_s: p.time_total_s,
        time_per_sample_s: p.time_per_sample_s, throughput_per_s: p.throughput_per_s,
        measured_time_total_s: p.measured_time_total_s ?? null,
        measured_time_per_sample_s: p.measured_time_per_sample_s ?? null,
        peak_bytes: p.peak_bytes, model_peak_bytes: p.model_peak_bytes, calls: p.calls,
        shape: p.shape,
        breakpoint_bytes: p.peak_bytes, unused_bytes: budget - p.peak_bytes,
        units: p.units.map(([u, batches, need, runtime, precision]) => ({
          unit: strategy.units[u], batches, need_bytes: need, unused_bytes: budget - need,
          runtime, precision: precision || 'float32'}))};
    }

    async plan(name, budget, r) {
      const b = this.book(name);
      const served = b.table_solver;
      const ours = this.answer(b, served, r, budget);
      const out = {model: name, fingerprint: b.fingerprint, table_solver: served,
                   objective: b.objective, batch: r, memory_budget: budget, plan: ours,
                   gain: {}, baseline: b.baseline, memory_source: 'query'};
      for (const s of Object.keys(b.strategies)) {
        if (s === served) continue;
        const other = this.answer(b, s, r, budget);
        out[s] = other;
        out.gain[s] = speedup(ours, other);
      }
      return out;
    }

    async stats() { return null; }
  }

  // ------------------------------------------------------------------ one model

  class ModelView {
    constructor(source, info, index) {
      this.source = source;
      this.info = info;
      this.name = info.name;
      this.id = `m${index}`;
      this.batch = null;
      this.curves = null;
      this.tree = null;
      this.answer = null;
      this.free = null;
      this.seq = 0;
      this.started = false;
      this.root = this.layout();
    }

    layout() {
      const id = this.id;
      const info = this.info;
      this.error = el('p', {class: 'error', role: 'alert', 'data-role': 'error', hidden: true});
      this.slider = el('input', {type: 'range', id: `${id}-mem`, 'data-role': 'memory',
                                 'aria-describedby': `${id}-mem-out`, disabled: true,
                                 oninput: () => this.update()});
      this.sliderText = el('output', {id: `${id}-mem-out`, for: `${id}-mem`,
                                      'data-role': 'memory-text'});
      this.select = el('select', {id: `${id}-batch`, 'data-role': 'batch', disabled: true,
                                  onchange: () => this.setBatch(Number(this.select.value))});
      this.toFree = el('button', {type: 'button', 'data-role': 'to-free', disabled: true,
                                  hidden: !this.source.live, onclick: () => this.budgetToFree()},
                       'Budget = memory free now');
      this.summary = el('div', {class: 'summary', 'data-role': 'summary', 'aria-live': 'polite'});
      this.planNote = el('p', {class: 'note', 'data-role': 'plan-note', hidden: true});
      this.planSvg = svgEl('svg', {class: 'chart', 'data-role': 'plan-chart', role: 'img',
                                   'aria-label': `Batch size of every phase of every unit of ${this.name}`});
      this.curveSvg = svgEl('svg', {class: 'chart', 'data-role': 'curve-chart', role: 'img',
                                    'aria-label': `Time per sample against memory for ${this.name}`});
      this.legend = el('p', {class: 'legend', 'data-role': 'legend'});
      this.liveError = el('p', {class: 'error', role: 'alert', 'data-role': 'live-error', hidden: true});
      this.liveValues = {};
      const items = [['free', 'Memory free now'], ['last-plan', 'Plan of the last batch'],
                     ['throughput', 'Throughput'], ['queue', 'Queue'],
                     ['latency', 'Latency p50 / p99'], ['oom', 'OOM retries'],
                     ['table', 'Table'], ['loaded', 'Table loaded'], ['served', 'Samples served']];
      const dl = el('dl', {});
      for (const [key, label] of items) {
        const dd = el('dd', {'data-role': `live-${key}`, text: '-'});
        this.liveValues[key] = dd;
        dl.append(el('dt', {text: label}), dd);
      }
      const live = el('section', {class: 'live', 'data-role': 'live', 'aria-labelledby': `${id}-live`},
        el('h3', {id: `${id}-live`, text: 'Live'}),
        this.source.live ? null : el('p', {class: 'note', 'data-role': 'live-note',
          text: 'A static file has no live figures: open /ui on the service for them.'}),
        this.liveError, this.source.live ? dl : null);
      this.facts = el('span', {class: 'facts'});
      // shown once the model is ready: a loading or failed model shows its message alone
      this.body = el('div', {class: 'model-body', hidden: true},
        el('div', {class: 'controls'},
          el('label', {for: `${id}-mem`, text: 'Memory budget'}), this.slider, this.sliderText,
          el('label', {for: `${id}-batch`, text: 'Request size'}), this.select, this.toFree),
        this.summary,
        el('div', {class: 'grid'},
          el('figure', {'aria-labelledby': `${id}-plan-cap`},
            el('figcaption', {id: `${id}-plan-cap`,
              text: 'Batch size of every phase of every unit (Fig. 9) and memory left unused (Table III)'}),
            el('div', {class: 'plan-scroll'}, this.planSvg)),
          el('div', {},
            el('figure', {'aria-labelledby': `${id}-curve-cap`},
              el('figcaption', {id: `${id}-curve-cap`,
                text: 'Time per sample against memory, vbs and the baselines (Fig. 7)'}),
              this.curveSvg, this.legend),
            live)));
      return el('section', {class: 'model', 'data-model': this.name, 'aria-labelledby': `${id}-title`},
        el('div', {class: 'model-head'}, el('h2', {id: `${id}-title`, text: this.name}), this.facts),
        this.error, this.planNote, this.body);
    }

    showError(err) {
      this.error.textContent = describeError(err);
      this.error.hidden = false;
    }

    clearError() {
      this.error.hidden = true;
      this.error.textContent = '';
    }

    setInfo(info) {
      this.info = info;
      const parts = [info.model !== info.name ? info.model : null,
                     info.input_shape ? `input ${info.input_shape.join('×')}` : null,
                     [info.device, info.dtype].filter(Boolean).join(' ') || null,
                     info.table ? (info.table.kind === 'interim'
                       ? `interim table (the whole model in ONNX Runtime): ${planningText(info.planning)}`
                       : `table ${info.table.solver}` +
                         (info.table.version ? ` v${info.table.version}` : '')) : null,
                     typeof info.memory_share_bytes === 'number'
                       ? `memory share ${fmtBytes(info.memory_share_bytes)}` : null,
                     info.state && info.state !== 'ready' ? info.state : null,
                     typeof info.kept_bytes === 'number' && info.state === 'ready'
                       ? `keeps ${fmtBytes(info.kept_bytes)}` : null];
      this.facts.textContent = parts.filter(Boolean).join(' · ');
      this.root.dataset.tableKind = info.table ? info.table.kind || 'planned' : '';
      if (this.started) return;
      // a model unloaded (loaded on demand) still has its tables: its plans are drawn
      if (info.state === 'ready' || (info.table && info.state !== 'failed')) {
        this.started = true;
        this.planNote.hidden = true;
        this.body.hidden = false;
        this.start();
      } else if (info.state === 'failed') {
        this.showError(new ApiError(0, `Model ${info.name} failed to load: ${info.error || 'see the service log'}`));
      } else if (info.state === 'unloaded' || info.state === 'unloading') {
        this.error.hidden = true;
        this.planNote.hidden = false;
        this.planNote.textContent = `Model ${info.name} is not loaded: it loads on its first ` +
          `request (or POST /v2/repository/models/${info.name}/load), and this page goes on ` +
          'then.' + (info.reason ? ` ${info.reason}` : '');
      } else {
        this.error.hidden = true;
        this.planNote.hidden = false;
        this.planNote.textContent = `Model ${info.name} is loading (profiling and planning ` +
          'happen once per model); this page goes on when it is ready.' +
          (info.error ? ` ${info.error}` : '');
      }
    }

    async start() {
      try {
        this.tree = (await this.source.tree(this.name)).root;
        const sizes = this.info.sizes ||
          Array.from({length: this.info.batch_max}, (_, i) => i + 1);
        this.select.replaceChildren(...sizes.map(r => el('option', {value: r, text: String(r)})));
        this.select.value = String(sizes[sizes.length - 1]);
        this.select.disabled = false;
        await this.setBatch(sizes[sizes.length - 1]);
        if (this.source.live) this.poll();
      } catch (err) {
        this.showError(err);
        this.started = false;  // the next look at /models tries again
      }
    }

    async setBatch(r) {
      this.batch = r;
      try {
        this.curves = await this.source.curves(this.name, r);
      } catch (err) {
        this.showError(err);
        return;
      }
      const {low_bytes: low, high_bytes: high} = this.curves;
      const step = Math.max(1, Math.ceil((high - low) / SLIDER_STEPS));
      const previous = this.slider.disabled ? high : Number(this.slider.value);
      this.slider.min = String(low);
      this.slider.max = String(low + step * Math.ceil((high - low) / step));
      this.slider.step = String(step);
      this.slider.value = String(Math.min(Math.max(previous, low), Number(this.slider.max)));
      this.slider.disabled = false;
      await this.update();
    }

    budgetToFree() {
      if (this.free === null || this.slider.disabled) return;
      this.slider.value = String(this.free);  // the range clamps it to its ends
      this.update();
    }

    async update() {
      if (this.batch === null || this.slider.disabled) return;
      const budget = Number(this.slider.value);
      const r = this.batch;
      const seq = ++this.seq;
      this.sliderText.textContent = fmtBytes(budget);
      this.slider.setAttribute('aria-valuetext', `${fmtBytes(budget)} (${budget} bytes)`);
      let answer;
      try {
        answer = await this.source.plan(this.name, budget, r);
      } catch (err) {
        if (seq === this.seq) this.showError(err);
        return;
      }
      if (seq !== this.seq) return;  // the slider moved on meanwhile
      this.clearError();
      this.answer = answer;
      this.renderSummary(answer);
      this.renderPlan(answer);
      this.drawCurves();
      this.summary.dataset.budget = String(budget);
      this.summary.dataset.batch = String(r);
      if (answer.table_version !== undefined) this.summary.dataset.tableVersion = String(answer.table_version);
    }

    strategies(answer) {
      const served = answer.table_solver;
      return [served, ...STRATEGIES.filter(s => s !== served && answer[s])];
    }

    renderSummary(answer) {
      const plan = answer.plan;
      const served = answer.table_solver;
      const headline = el('p', {class: 'headline'});
      if (plan.feasible) {
        const gain = answer.gain[answer.baseline];
        headline.append('Plan ', el('code', {'data-role': 'plan-id', text: plan.plan_id}),
          ` (${served}, ${answer.batch} samples): `,
          el('strong', {'data-role': 'time-per-sample', text: fmtSeconds(plan.time_per_sample_s)}),
          ` per sample, ${plan.throughput_per_s ? plan.throughput_per_s.toFixed(1) : '-'} samples/s; ` +
          `allocates ${fmtBytes(plan.peak_bytes)} of the ${fmtBytes(answer.memory_budget)} budget` +
          (plan.calls ? `; its runs make ${plan.calls} ONNX Runtime call${plan.calls > 1 ? 's' : ''}` : '') +
          (gain ? `; ${gain.toFixed(2)}× as fast as ${answer.baseline}.` : '.'));
        if (plan.calls) {
          headline.append(el('br'), 'What each call runs (first..last unit: batch sizes): ',
                          el('code', {'data-role': 'runs', text: plan.shape}));
        }
      } else {
        headline.append(el('strong', {'data-role': 'infeasible',
                                      text: `No ${served} plan fits: ${plan.reason}`}));
      }
      const rows = this.strategies(answer).map(s => {
        const o = s === served ? plan : answer[s];
        const gain = s === served ? null : answer.gain[s];
        return el('tr', {'data-strategy': s},
          el('td', {}, el('span', {class: 'swatch', style: `border-color:${COLORS[s] || '#333'}`}), s),
          el('td', {'data-role': 'time', text: o.feasible ? fmtSeconds(o.time_per_sample_s) : 'does not fit'}),
          el('td', {'data-role': 'measured',
                    text: o.feasible && o.measured_time_per_sample_s != null
                      ? fmtSeconds(o.measured_time_per_sample_s) : '-'}),
          el('td', {text: o.feasible && o.throughput_per_s ? o.throughput_per_s.toFixed(1) : '-'}),
          el('td', {text: o.feasible ? fmtBytes(o.peak_bytes) : `needs ${fmtBytes(o.needs_bytes)}`}),
          el('td', {'data-role': 'plan-id', text: o.feasible ? o.plan_id : '-'}),
          el('td', {text: gain ? `${gain.toFixed(2)}×` : '-'}));
      });
      const table = el('table', {class: 'strategies'},
        el('caption', {class: 'note', text: 'Every strategy at this budget: predicted from the ' +
                       'profile, and measured where `vbs plan` ran the plan (gains measured where both were)'}),
        el('thead', {}, el('tr', {},
          ...['strategy', 'time per sample', 'measured', 'samples/s', 'allocates', 'plan', `${served} gain`]
            .map(t => el('th', {scope: 'col', text: t})))),
        el('tbody', {}, ...rows));
      this.summary.replaceChildren(headline, table);
    }

    /* The rows of the plan chart: the tree's units in order, each block's branches under it. */
    rows(plan) {
      const uses = new Map(plan.units.map(u => [u.unit, u]));
      const rows = [];
      const walk = (node, depth) => {
        if (node.kind === 'series') {
          node.children.forEach(child => walk(child, depth));
        } else if (node.kind === 'parallel') {
          rows.push({kind: 'block', name: node.name, depth, use: uses.get(node.name), join: node.join});
          uses.delete(node.name);
          node.branches.forEach((branch, i) => {
            rows.push({kind: 'branch', name: `branch ${i + 1} (${branch.name})`, depth: depth + 1});
            walk(branch, depth + 2);
          });
        } else {
          rows.push({kind: node.kind, name: node.name, depth, use: uses.get(node.name)});
          uses.delete(node.name);
        }
      };
      if (this.tree) walk(this.tree, 0);
      for (const use of uses.values()) rows.push({kind: 'layer', name: use.unit, depth: 0, use});
      return rows;
    }

    renderPlan(answer) {
      const svg = this.planSvg;
      const plan = answer.plan;
      svg.replaceChildren();
      if (!plan.feasible) {
        this.planNote.hidden = false;
        this.planNote.textContent = `Nothing to draw: ${plan.reason}`;
        svg.setAttribute('width', '0');
        svg.setAttribute('height', '0');
        return;
      }
      this.planNote.hidden = true;
      const r = answer.batch;
      const budget = answer.memory_budget;
      const rows = this.rows(plan);
      const rowH = 18, head = 36, indent = 12;
      const nameW = Math.min(320, Math.max(140, ...rows.map(x => x.depth * indent + x.name.length * 7.2 + 12)));
      const barW = 360, gap = 18, unusedW = 150, textW = 90;
      const width = nameW + barW + gap + unusedW + textW;
      const height = head + rows.length * rowH + 6;
      svg.setAttribute('width', String(width));
      svg.setAttribute('height', String(height));
      svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
      svg.append(
        svgEl('text', {x: 0, y: 14, class: 'axis-title', fill: '#1a1a1a', 'font-size': 12, 'font-weight': 600}, 'unit'),
        svgEl('text', {x: nameW, y: 14, fill: '#1a1a1a', 'font-size': 12, 'font-weight': 600},
              `phases: samples per step, of ${r}`),
        svgEl('text', {x: nameW + barW + gap, y: 14, fill: '#1a1a1a', 'font-size': 12, 'font-weight': 600},
              'memory left unused'),
        svgEl('text', {x: nameW + barW + gap, y: 29, fill: '#4d4d4d', 'font-size': 11},
              `of the ${fmtBytes(budget)} budget`));
      rows.forEach((row, i) => {
        const y = head + i * rowH;
        const label = row.kind === 'block' ? `${row.name} (join: ${row.join})` : row.name;
        if (row.kind === 'branch') {
          svg.append(svgEl('g', {class: 'branch-row', 'data-branch': row.name},
            svgEl('text', {x: row.depth * indent, y: y + 13, fill: '#4d4d4d', 'font-size': 12,
                           'font-style': 'italic'}, row.name)));
          return;
        }
        const use = row.use;
        if (!use) return;
        const runtime = use.runtime || 'torch';
        const name = svgEl('text', {x: row.depth * indent, y: y + 13, fill: '#1a1a1a', 'font-size': 12,
                                    'font-weight': row.kind === 'block' ? 600 : 400, class: 'unit-name'},
                           label);
        const int8 = use.precision === 'int8';  // its ONNX Runtime graph quantized
        name.append(svgEl('tspan', {fill: '#4d4d4d', 'font-size': 10, 'font-weight': 400,
                                    class: 'unit-runtime'},
                          ` ${RUNTIME_SHORT[runtime] || runtime}${int8 ? ' int8' : ''}`));
        const g = svgEl('g', {class: 'unit-row', 'data-unit': use.unit, 'data-kind': row.kind,
                              'data-batches': use.batches.join(','), 'data-unused': use.unused_bytes,
                              'data-depth': row.depth, 'data-runtime': runtime,
                              'data-precision': use.precision || 'float32'},
          svgEl('title', {}, `${use.unit}: phases of ${use.batches.join(', ')} samples on ${runtime}` +
                `${int8 ? ' in int8' : ''}; ` +
                `holds at most ${fmtBytes(use.need_bytes)}, ${fmtBytes(use.unused_bytes)} of the budget unused`),
          name);
        let x = nameW;
        use.batches.forEach((c, k) => {
          const w = c / r * barW;
          const fill = PHASE_FILLS[k % PHASE_FILLS.length];
          const phase = svgEl('g', {class: 'phase', 'data-samples': c},
            svgEl('rect', {x: x.toFixed(2), y: y + 2, width: Math.max(0.5, w - 1).toFixed(2),
                           height: rowH - 4, fill}));
          if (w >= 16) {
            phase.append(svgEl('text', {x: (x + w / 2).toFixed(2), y: y + 13, fill: '#ffffff',
                                        'font-size': 11, 'text-anchor': 'middle', 'data-bg': fill}, String(c)));
          }
          g.append(phase);
          x += w;
        });
        const ux = nameW + barW + gap;
        const frac = budget > 0 ? Math.max(0, use.unused_bytes) / budget : 0;
        g.append(svgEl('rect', {class: 'unused', x: ux, y: y + 4, width: (frac * unusedW).toFixed(2),
                                height: rowH - 8, fill: '#5f6b7a'}),
                 svgEl('text', {x: ux + unusedW + 6, y: y + 13, fill: '#1a1a1a', 'font-size': 11,
                                class: 'unused-text'}, fmtBytes(use.unused_bytes)));
        svg.append(g);
      });
    }

    drawCurves() {
      const svg = this.curveSvg;
      const data = this.curves;
      svg.replaceChildren();
      if (!data) return;
      const W = 620, H = 350, ml = 78, mr = 24, mt = 44, mb = 56;
      svg.setAttribute('width', String(W));
      svg.setAttribute('height', String(H));
      svg.setAttribute('viewBox', `0 0 ${W} ${H}`);
      const low = data.low_bytes, high = data.high_bytes;
      const span = Math.max(1, high - low);
      const x0 = Math.max(0, low - span * 0.03), x1 = high + span * 0.08;
      const strategies = Object.keys(data.strategies);
      const times = strategies.flatMap(s => data.strategies[s].map(p => p.time_per_sample_s));
      // Time from a little below the fastest plan: the curves' differences are what matter;
      // the axis says where it starts.
      const tHi = Math.max(...times, 1e-12), tLo0 = Math.min(...times, tHi);
      const tMax = tHi + (tHi - tLo0) * 0.08 || tHi * 1.08;
      const tMin = tHi > tLo0 ? Math.max(0, tLo0 - (tHi - tLo0) * 0.15) : 0;
      const X = b => ml + (b - x0) / (x1 - x0) * (W - ml - mr);
      const Y = t => H - mb - (t - tMin) / (tMax - tMin) * (H - mt - mb);
      const axis = '#1a1a1a';
      svg.append(svgEl('line', {x1: ml, y1: H - mb, x2: W - mr, y2: H - mb, stroke: axis}),
                 svgEl('line', {x1: ml, y1: mt, x2: ml, y2: H - mb, stroke: axis}));
      for (let i = 0; i <= 4; i++) {
        const b = x0 + (x1 - x0) * i / 4;
        const t = tMin + (tMax - tMin) * i / 4;
        svg.append(
          svgEl('line', {x1: X(b), y1: H - mb, x2: X(b), y2: H - mb + 4, stroke: axis}),
          svgEl('text', {x: X(b), y: H - mb + 17, 'text-anchor': i === 4 ? 'end' : 'middle',
                         'font-size': 11, fill: axis},
                fmtBytes(Math.round(b))),
          svgEl('line', {x1: ml - 4, y1: Y(t), x2: ml, y2: Y(t), stroke: axis}),
          svgEl('text', {x: ml - 7, y: Y(t) + 4, 'text-anchor': 'end', 'font-size': 11, fill: axis},
                fmtSeconds(t)));
      }
      svg.append(
        svgEl('text', {x: (ml + W - mr) / 2, y: H - 12, 'text-anchor': 'middle', 'font-size': 12, fill: axis},
              `memory budget (${data.batch} samples per request)`),
        svgEl('text', {x: 14, y: (mt + H - mb) / 2, 'text-anchor': 'middle', 'font-size': 12, fill: axis,
                       transform: `rotate(-90 14 ${(mt + H - mb) / 2})`}, 'time per sample'));
      for (const s of strategies) {
        const points = data.strategies[s];
        if (!points.length) continue;
        const color = COLORS[s] || '#333333';
        let d = `M${X(points[0].bytes).toFixed(1)},${Y(points[0].time_per_sample_s).toFixed(1)}`;
        points.forEach((p, k) => {
          const next = k + 1 < points.length ? points[k + 1].bytes : x1;
          d += ` H${X(next).toFixed(1)}`;
          if (k + 1 < points.length) d += ` V${Y(points[k + 1].time_per_sample_s).toFixed(1)}`;
        });
        const g = svgEl('g', {class: 'curve', 'data-strategy': s},
          svgEl('path', {d, fill: 'none', stroke: color, 'stroke-width': s === data.table_solver ? 2.5 : 1.6,
                         'stroke-dasharray': DASHES[s] || null}));
        for (const p of points) {
          g.append(svgEl('circle', {class: 'point', 'data-strategy': s, 'data-bytes': p.bytes,
                                    cx: X(p.bytes).toFixed(1), cy: Y(p.time_per_sample_s).toFixed(1),
                                    r: 3.2, fill: color},
            svgEl('title', {}, `${s}: ${fmtSeconds(p.time_per_sample_s)} per sample from ` +
                               `${fmtBytes(p.bytes)} (plan ${p.plan_id})`)));
        }
        svg.append(g);
      }
      const marker = (cls, bytes, label, color, dash) => {
        const offScale = bytes > x1;
        const x = X(Math.min(Math.max(bytes, x0), x1));
        svg.append(svgEl('g', {class: cls, 'data-bytes': bytes},
          svgEl('line', {x1: x, y1: mt - 4, x2: x, y2: H - mb, stroke: color, 'stroke-width': 2,
                         'stroke-dasharray': dash}),
          // labels above the plot, where no curve runs
          svgEl('text', {x: x > W - 200 ? x - 4 : x + 4, y: cls === 'budget-marker' ? 14 : 30,
                         'font-size': 11, fill: color,
                         'text-anchor': x > W - 200 ? 'end' : 'start'},
                `${label} ${fmtBytes(bytes)}${offScale ? ' (off the scale →)' : ''}`)));
      };
      if (this.answer) marker('budget-marker', this.answer.memory_budget, 'budget', '#1a1a1a', null);
      if (this.free !== null) marker('free-marker', this.free, 'free now', '#8a1010', '5 3');
      this.legend.replaceChildren(...strategies.map(s => el('span', {class: 'legend-item'},
        el('span', {class: 'swatch', style: `border-color:${COLORS[s] || '#333'};` +
                                            `border-top-style:${DASHES[s] ? 'dashed' : 'solid'}`}),
        `${s}${s === data.table_solver ? ' (served)' : ''}  `)));
    }

    async poll() {
      for (;;) {
        try {
          const stats = await this.source.stats(this.name);
          this.liveError.hidden = true;
          this.renderLive(stats);
        } catch (err) {
          this.liveError.textContent = describeError(err);
          this.liveError.hidden = false;
        }
        await wait(LIVE_EVERY_MS);
      }
    }

    renderLive(s) {
      const v = this.liveValues;
      const set = (key, text) => { v[key].textContent = text; };
      set('free', fmtBytes(s.memory_free_bytes) +
          (s.memory_limit_bytes ? ` (limit ${fmtBytes(s.memory_limit_bytes)})` : ''));
      const last = s.last_batch;
      set('last-plan', last
        ? `${last.plan_id} (${last.solver}): ${last.batch} of ${last.samples} samples` +
          (last.pieces > 1 ? ` in ${last.pieces} pieces` : '') +
          `, chosen for ${fmtBytes(last.budget_bytes)}, allocates ${fmtBytes(last.peak_bytes)}, ` +
          `at ${fmtClock(last.at)}`
        : 'no batch yet');
      set('throughput', `${s.samples_per_s.toFixed(1)} samples/s (${s.requests} requests ` +
          `in the last ${s.window_s} s)`);
      set('queue', `${s.queue} waiting${s.running ? ', a batch running' : ''}`);
      set('latency', `${fmtSeconds(s.latency_p50_s)} / ${fmtSeconds(s.latency_p99_s)}`);
      set('oom', `${s.oom_retries_total} (batches split for memory: ${s.batch_splits_total})`);
      const t = s.table;
      set('table', t.kind === 'interim'
        ? `interim (${t.plans} plans: the whole model in ONNX Runtime, until ${t.id} is planned ` +
          'and swapped in)'
        : `v${t.version} (${t.solver}, ${t.plans} plans, ${t.id})`);
      set('loaded', fmtClock(t.loaded_at) + (t.stored_at ? `; planned ${t.stored_at}` : ''));
      set('served', String(s.samples_total));
      this.root.dataset.liveSamples = String(s.samples_total);
      if (this.curves && this.curves.table_version !== undefined &&
          t.version !== this.curves.table_version && !this.reloading) {
        // a new table was swapped in: its curves and the plan at this budget may differ
        this.reloading = true;
        this.setBatch(this.batch).finally(() => { this.reloading = false; });
      }
      const moved = this.free !== s.memory_free_bytes;
      this.free = s.memory_free_bytes;
      this.toFree.disabled = false;
      if (moved) this.drawCurves();
    }
  }

  /* What a model's planning beside serving is doing (GET /models: `planning`), in words. */
  function planningText(p) {
    if (!p) return 'not being planned';
    if (p.state === 'planning') return `vbs plan profiling and planning it (${Math.round(p.elapsed_s)} s)`;
    if (p.state === 'published') return 'planned, its table being swapped in';
    if (p.state === 'failed') return `planning failed: ${p.error || 'see the service log'}`;
    return `planning ${p.state}`;
  }

  // ------------------------------------------------------------------ memory shares

  /* The memory arbiter's shares, when GET /models carries them: `memory`, a list with one
   * entry per device ({device, mode, budget_bytes, leased_bytes, shares: {model: bytes},
   * leases: {model: bytes}}). Absent or empty, the section stays hidden. */
  function devicesOf(listing) {
    const memory = Array.isArray(listing.memory) ? listing.memory
      : listing.memory && typeof listing.memory === 'object' ? [listing.memory] : [];
    return memory.map(d => ({
      device: d.device || 'device', mode: d.mode || null,
      budget: typeof d.budget_bytes === 'number' ? d.budget_bytes : null,
      leased: typeof d.leased_bytes === 'number' ? d.leased_bytes : null,
      leases: d.leases || {},
      shares: Object.entries(d.shares || {}).filter(([, b]) => typeof b === 'number')
        .map(([name, bytes]) => ({name, bytes}))})).filter(d => d.shares.length);
  }

  function renderShares(listing) {
    const devices = devicesOf(listing);
    const section = $('#shares');
    if (!devices.length) { section.hidden = true; return; }
    const parts = devices.map(d => {
      const total = Math.max(d.budget || 0, d.shares.reduce((a, x) => a + x.bytes, 0), 1);
      const W = 620, H = 26;
      const svg = svgEl('svg', {class: 'chart', role: 'img', width: W, height: H,
                                viewBox: `0 0 ${W} ${H}`, 'data-device': d.device,
                                'aria-label': `Each model's share of ${d.device} memory`});
      let x = 0;
      d.shares.forEach((item, i) => {
        const w = item.bytes / total * W;
        svg.append(svgEl('rect', {class: 'share', 'data-model': item.name, 'data-bytes': item.bytes,
                                  x: x.toFixed(2), y: 0, width: w.toFixed(2), height: H,
                                  fill: PHASE_FILLS[i % 2], stroke: '#ffffff'},
                         svgEl('title', {}, `${item.name}: ${fmtBytes(item.bytes)}`)));
        x += w;
      });
      const head = el('p', {}, el('strong', {text: d.device}),
        d.mode ? ` (${d.mode})` : '',
        d.budget !== null ? `: ${fmtBytes(d.budget)} free for plans` : '',
        d.leased !== null ? `, ${fmtBytes(d.leased)} leased now` : '');
      const list = el('ul', {}, ...d.shares.map(item => el('li', {'data-model': item.name,
        text: `${item.name}: share ${fmtBytes(item.bytes)}` +
              (d.budget ? ` (${(100 * item.bytes / d.budget).toFixed(0)}%)` : '') +
              (typeof d.leases[item.name] === 'number'
                ? `, leased now ${fmtBytes(d.leases[item.name])}` : '')})));
      return el('div', {class: 'device'}, head, svg, list);
    });
    $('#shares-body').replaceChildren(...parts);
    section.hidden = false;
  }

  // ------------------------------------------------------------------ the page

  function alertBox(err) {
    const box = $('#alert');
    if (err) {
      box.textContent = describeError(err);
      box.hidden = false;
    } else {
      box.hidden = true;
      box.textContent = '';
    }
  }

  async function main() {
    const embedded = document.getElementById('vbs-data');
    const source = embedded ? new StaticSource(JSON.parse(embedded.textContent)) : new ServiceSource();
    if (embedded && source.title) document.title = source.title;
    $('#source').textContent = source.describe();
    let listing;
    for (;;) {
      try {
        listing = await source.models();
        break;
      } catch (err) {
        alertBox(err);
        await wait(MODELS_EVERY_MS);
      }
    }
    alertBox(null);
    const views = new Map();
    const container = $('#models');
    const refresh = list => {
      list.models.forEach((info, i) => {
        let view = views.get(info.name);
        if (!view) {
          view = new ModelView(source, info, i);
          views.set(info.name, view);
          container.append(view.root);
        }
        view.setInfo(info);
      });
      if (!list.models.length) {
        alertBox(new ApiError(0, 'The service serves no model: start it with --model NAME (or VBS_MODELS).'));
      }
      renderShares(list);
    };
    refresh(listing);
    if (!source.live) return;
    for (;;) {
      await wait(MODELS_EVERY_MS);
      try {
        refresh(await source.models());
        alertBox(null);
      } catch (err) {
        alertBox(err);
      }
    }
  }

  // an inline copy (vbs show --html) runs before the body is parsed; the served file is deferred
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', main);
  else main();
})();
