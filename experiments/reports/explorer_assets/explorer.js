// The decoding explorer (experiments.explore): plays one generation per model from the JSON in #data.
// No network: everything it shows is in the page. Errors are written into #errors (tests read them).
"use strict";
(function () {
  var errors = document.getElementById("errors");
  function report(text) { errors.textContent += text + "\n"; document.body.dataset.errors = "1"; }
  window.addEventListener("error", function (e) { report("error: " + e.message); });
  var consoleError = console.error;
  console.error = function () { report("console.error: " + Array.prototype.join.call(arguments, " ")); consoleError.apply(console, arguments); };

  var DATA = JSON.parse(document.getElementById("data").textContent);
  var state = { model: 0, step: 0, layer: 0, head: 0, timer: null };
  var $ = function (id) { return document.getElementById(id); };
  function el(tag, cls, text) { var e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; }

  function decode(b64) {
    var s = atob(b64), out = new Uint8Array(s.length);
    for (var i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
    return out;
  }
  DATA.models.forEach(function (m) {
    if (m.attention) m.attention.bytes = decode(m.attention.q);
    if (m.policy) ["computed", "keys", "layers"].forEach(function (k) { if (m.policy[k]) m.policy[k].bytes = decode(m.policy[k].bits); });
  });
  // Bit `index` (C order) of a packed bool array {shape, bits} (least significant bit first).
  function bit(mask, index) { return (mask.bytes[index >> 3] >> (index & 7)) & 1; }
  function computedAt(m, t, p) { return bit(m.policy.computed, t * m.tokens.length + p); }
  // Whether layer l's (shown layers) head h read key s at step t (true without a key subset).
  function keyRead(m, t, l, h, s) {
    var k = m.policy && m.policy.keys;
    if (!k) return true;
    var sh = k.shape, hh = sh[2] === 1 ? 0 : h;
    return bit(k, ((t * sh[1] + l) * sh[2] + hh) * sh[3] + s) === 1;
  }

  function model() { return DATA.models[state.model]; }
  // Score of key s at step t, layer l, head h (head n_heads = the head mean): stored gamma-0.5 encoded bytes.
  function score(m, t, l, h, s) {
    var a = m.attention, sh = a.shape, q = a.bytes[((t * sh[1] + l) * sh[2] + h) * sh[3] + s] / 255;
    return q * q * a.max[l * sh[2] + h];
  }
  function level(m, t, l, h, s) {
    var a = m.attention, sh = a.shape;
    return a.bytes[((t * sh[1] + l) * sh[2] + h) * sh[3] + s];
  }
  function magma(v) {  // v in [0, 255] -> an rgb string on a dark-to-bright scale
    var x = v / 255, r = Math.round(255 * Math.min(1, 1.6 * x)), g = Math.round(255 * Math.max(0, 1.5 * x - 0.5)),
        b = Math.round(255 * (x < 0.5 ? 0.3 + 0.8 * x : Math.max(0, 1.4 - 1.6 * x + 0.4 * x * x)));
    return "rgb(" + r + "," + g + "," + b + ")";
  }

  function readHash() {
    var h = location.hash.replace(/^#/, "");
    h.split("&").forEach(function (kv) {
      var p = kv.split("="), v = decodeURIComponent(p[1] || "");
      if (p[0] === "model") { DATA.models.forEach(function (m, i) { if (m.label === v) state.model = i; }); }
      if (p[0] === "step") state.step = parseInt(v, 10) || 0;
      if (p[0] === "layer") state.layer = parseInt(v, 10) || 0;
      if (p[0] === "head") state.head = v === "mean" ? -1 : (parseInt(v, 10) || 0);
    });
  }

  function stateOf(m, t, p) {  // display class of position p after the t-th step shown
    if (p < m.prompt_length) return "prompt";
    if (m.revoked && m.revoked[t].indexOf(p) >= 0) return "revoked";
    if (m.drafted && m.drafted[t].indexOf(p) >= 0) return "drafted";
    var d = m.decode_step[p], s = m.steps[t];
    if (d < 0 || d > s) return "masked";
    return d === s ? "fresh" : "decoded";
  }
  function textOf(m, t, p) {
    var c = stateOf(m, t, p);
    if (c === "masked") return m.vocab[m.canvas[t][p]] !== undefined ? m.vocab[m.canvas[t][p]] : "·";
    if (c === "revoked") return m.vocab[m.canvas[t][p]] !== undefined ? m.vocab[m.canvas[t][p]] : "?";
    if (c === "drafted") return m.draft_text[t][m.drafted[t].indexOf(p)];
    return m.tokens[p];
  }

  function buildControls() {
    var sel = $("model");
    DATA.models.forEach(function (m, i) { var o = el("option", null, m.label); o.value = i; sel.appendChild(o); });
    sel.onchange = function () { state.model = +sel.value; state.step = 0; state.layer = 0; state.head = 0; render(); };
    $("slider").oninput = function () { state.step = +$("slider").value; render(); };
    $("layer").onchange = function () { state.layer = +$("layer").value; render(); };
    $("head").onchange = function () { state.head = +$("head").value; render(); };
    $("play").onclick = function () {
      if (state.timer) { clearInterval(state.timer); state.timer = null; $("play").textContent = "▶ play"; return; }
      var m = model();
      if (state.step >= m.steps.length - 1) state.step = 0;
      $("play").textContent = "❚❚ pause";
      state.timer = setInterval(function () {
        if (state.step >= model().steps.length - 1) { $("play").onclick(); return; }
        state.step += 1; render();
      }, 450);
    };
  }

  function renderHeader(m) {
    $("model").value = state.model;
    $("meta").textContent = m.label + " · " + m.sampler + " · item " + m.item + (m.correct === undefined ? "" : (m.correct ? " · correct" : " · wrong")) +
      " · " + m.steps.length + " steps shown (of the generation's decoded steps)";
    var pm = $("policy-meta");
    pm.hidden = !m.policy;
    if (m.policy) {
      var n = 0;
      for (var p = 0; p < m.tokens.length; p++) n += computedAt(m, state.step, p);
      pm.textContent = "compute policy " + m.policy.text + " · this step computed " + n + " of " + m.tokens.length +
        " positions' queries · keys read per computed query " + m.policy.keys_read[state.step].toFixed(1) +
        " (mean over layers) · " + m.policy.notes[state.step];
      pm.dataset.computed = n;
    }
    $("prompt").textContent = m.prompt;
    $("completion").textContent = m.completion;
    var slider = $("slider");
    slider.max = m.steps.length - 1; slider.value = state.step;
    $("step-label").textContent = "step " + state.step + " of " + m.steps.length + " (sampler step " + m.steps[state.step] + ")";
    document.body.dataset.step = state.step; document.body.dataset.steps = m.steps.length; document.body.dataset.model = m.label;
    var layer = $("layer"), head = $("head");
    layer.innerHTML = ""; head.innerHTML = "";
    m.layers.forEach(function (l, i) { var o = el("option", null, "layer " + l); o.value = i; layer.appendChild(o); });
    for (var h = 0; h < m.n_heads; h++) { var o = el("option", null, "head " + h); o.value = h; head.appendChild(o); }
    var mean = el("option", null, "head mean"); mean.value = m.n_heads; head.appendChild(mean);
    layer.value = state.layer; head.value = state.head;
  }

  function renderCanvas(m) {
    var box = $("canvas-tokens"); box.innerHTML = "";
    for (var p = 0; p < m.tokens.length; p++) {
      var c = stateOf(m, state.step, p), span = el("span", "tok " + c, textOf(m, state.step, p));
      span.dataset.pos = p; span.dataset.state = c; span.title = "position " + p + (p >= m.prompt_length ? ", decoded at step " + m.decode_step[p] : " (prompt)");
      box.appendChild(span);
    }
  }

  function renderAttention(m) {
    var strip = $("strip"), t = state.step, l = state.layer, h = state.head;
    strip.innerHTML = "";
    var sinks = m.sinks[t][l][h] || [];
    $("attention-title").textContent = "Incoming attention at step " + t + ", layer " + m.layers[l] + ", " +
      (h === m.n_heads ? "head mean (sinks: a sink in any head)" : "head " + h) + " — " + sinks.length + " sinks (ε-rule)";
    var read = 0;
    for (var s = 0; s < m.tokens.length; s++) {
      var kept = keyRead(m, t, l, h, s);
      read += kept ? 1 : 0;
      var cell = el("div", "cell" + (sinks.indexOf(s) >= 0 ? " sink" : "") + (s === m.prompt_length ? " promptend" : "") +
                    (kept ? "" : " dropped"));
      cell.appendChild(el("div", "mark", sinks.indexOf(s) >= 0 ? "▼" : ""));
      var b = el("div", "box"); b.style.background = magma(level(m, t, l, h, s));
      b.title = "key " + s + " " + textOf(m, t, s) + ": score " + score(m, t, l, h, s).toFixed(2) + (kept ? "" : " (not read: the policy dropped it)");
      cell.appendChild(b);
      cell.appendChild(el("div", "lab", textOf(m, t, s)));
      if (m.policy) {
        var c = computedAt(m, t, s), q = el("div", "q" + (c ? " computed" : ""));
        q.title = c ? "query computed at this step" : "read from the cache at this step";
        cell.appendChild(q);
        cell.dataset.computed = c;
        cell.dataset.read = kept ? 1 : 0;
      }
      cell.appendChild(el("div", "pos", s % 5 === 0 ? String(s) : ""));
      cell.dataset.pos = s;
      strip.appendChild(cell);
    }
    if (m.policy && m.policy.keys) $("attention-title").textContent += " — " + read + " of " + m.tokens.length + " keys read (policy)";
    $("policy-legend").hidden = !m.policy;
    $("policy-legend-keys").hidden = !(m.policy && m.policy.keys);
    renderPolicyLayers(m);
    var cv = $("heatmap"), T = m.steps.length, S = m.tokens.length, px = 15, row = Math.max(6, Math.min(24, Math.floor(200 / T)));
    cv.width = S * px; cv.height = T * row;
    var ctx = cv.getContext("2d");
    for (var tt = 0; tt < T; tt++) for (var ss = 0; ss < S; ss++) {
      ctx.fillStyle = magma(level(m, tt, l, h, ss)); ctx.fillRect(ss * px, tt * row, px, row);
    }
    ctx.fillStyle = "rgba(255,255,255,0.7)";  // keys the policy's layer (and head) did not read at that step
    if (m.policy && m.policy.keys) for (tt = 0; tt < T; tt++) for (ss = 0; ss < S; ss++) {
      if (!keyRead(m, tt, l, h, ss)) ctx.fillRect(ss * px, tt * row, px, row);
    }
    ctx.strokeStyle = DATA.palette.sink; ctx.lineWidth = 1;
    for (tt = 0; tt < T; tt++) (m.sinks[tt][l][h] || []).forEach(function (ss) { ctx.strokeRect(ss * px + 4.5, tt * row + 1.5, px - 9, row - 3); });
    ctx.strokeStyle = DATA.palette.fresh; ctx.lineWidth = 2; ctx.strokeRect(1, t * row + 1, S * px - 2, row - 1);
    ctx.strokeStyle = DATA.palette.promptend; ctx.setLineDash([3, 3]); ctx.beginPath();
    ctx.moveTo(m.prompt_length * px, 0); ctx.lineTo(m.prompt_length * px, T * row); ctx.stroke(); ctx.setLineDash([]);
  }

  function renderPolicyLayers(m) {  // per-layer policies: layer x position strip of the step's recomputed positions
    var panel = $("policy-layers-panel"), lay = m.policy && m.policy.layers;
    panel.hidden = !lay;
    if (!lay) return;
    var t = state.step, L = lay.shape[1], S = lay.shape[2], px = 15, row = 10, counts = [];
    var cv = $("policy-layers"); cv.width = S * px; cv.height = L * row;
    var ctx = cv.getContext("2d");
    for (var l = 0; l < L; l++) {
      var n = 0;
      for (var s = 0; s < S; s++) {
        var on = bit(lay, (t * L + l) * S + s);
        n += on;
        ctx.fillStyle = on ? "#333" : "#eee"; ctx.fillRect(s * px + 1, l * row + 1, px - 2, row - 2);
      }
      counts.push("layer " + l + ": " + n);
    }
    $("policy-layer-counts").textContent = "recomputed positions — " + counts.join(" · ");
  }

  function renderOrder(m) {
    var box = $("order"); box.innerHTML = "";
    var gen = [];
    var lastStep = m.steps[m.steps.length - 1];  // positions decoded after the last step shown never ran (ARM past EOS)
    for (var p = m.prompt_length; p < m.tokens.length; p++) if (m.decode_step[p] >= 0 && m.decode_step[p] <= lastStep) gen.push(p);
    gen.sort(function (a, b) { return (m.decode_step[a] - m.decode_step[b]) || (a - b); });
    gen.forEach(function (p) {
      var c = stateOf(m, state.step, p), span = el("span", "tok " + c);
      span.appendChild(el("span", null, m.tokens[p]));
      span.appendChild(el("small", null, "pos " + p + " · step " + m.decode_step[p]));
      box.appendChild(span);
    });
  }

  function renderMasking(m) {
    var panel = $("masking-panel"), mk = DATA.masking;
    if (!mk || !mk.models[m.label]) { panel.style.display = "none"; return; }
    panel.style.display = "";
    $("masking-title").textContent = "The same item (" + mk.models[m.label].item + ") with the previous step's top-K sinks masked";
    var table = $("masking"); table.innerHTML = "";
    var head = el("tr"); ["masked sinks", "completion", "correct", "NFE"].forEach(function (x) { head.appendChild(el("th", null, x)); });
    table.appendChild(head);
    mk.models[m.label].rows.forEach(function (r) {
      var tr = el("tr");
      tr.appendChild(el("td", null, r.k === 0 ? "none" : "top-" + r.k));
      tr.appendChild(el("td", null, r.text));
      tr.appendChild(el("td", null, r.correct === undefined ? "–" : (r.correct ? "yes" : "no")));
      tr.appendChild(el("td", null, r.nfe === undefined ? "–" : String(r.nfe)));
      table.appendChild(tr);
    });
  }

  function renderPanels() {  // extra panels (later captures): grids of numbers with row and column labels
    var box = $("extra"); box.innerHTML = "";
    (DATA.panels || []).forEach(function (p) {
      var div = el("div", "panel"); div.appendChild(el("h2", null, p.title));
      if (p.note) div.appendChild(el("div", "note", p.note));
      if (p.kind === "grid") {
        var table = el("table", "masking"), max = 0;
        p.values.forEach(function (r) { r.forEach(function (v) { max = Math.max(max, Math.abs(v)); }); });
        var hr = el("tr"); hr.appendChild(el("th", null, ""));
        p.cols.forEach(function (c) { hr.appendChild(el("th", null, c)); }); table.appendChild(hr);
        p.values.forEach(function (r, i) {
          var tr = el("tr"); tr.appendChild(el("th", null, p.rows[i]));
          r.forEach(function (v) { var td = el("td", null, v.toFixed(3)); td.style.background = magma(max ? 255 * Math.sqrt(Math.abs(v) / max) : 0); td.style.color = "#fff"; tr.appendChild(td); });
          table.appendChild(tr);
        });
        div.appendChild(table);
      } else { report("unknown panel kind " + p.kind); }
      box.appendChild(div);
    });
  }

  function render() {
    var m = model();
    state.step = Math.max(0, Math.min(state.step, m.steps.length - 1));
    state.layer = Math.max(0, Math.min(state.layer, m.layers.length - 1));
    if (state.head < 0 || state.head > m.n_heads) state.head = m.n_heads;
    renderHeader(m); renderCanvas(m); renderAttention(m); renderOrder(m); renderMasking(m);
    var rects = Array.prototype.map.call(document.querySelectorAll("#canvas-tokens .tok"), function (e) {
      var r = e.getBoundingClientRect(); return [Math.round(r.left), Math.round(r.top), Math.round(r.width), Math.round(r.height)];
    });
    $("layout").textContent = JSON.stringify(rects);
  }

  try {
    document.documentElement.style.setProperty("--masked", DATA.palette.masked);
    document.documentElement.style.setProperty("--decoded", DATA.palette.decoded);
    document.documentElement.style.setProperty("--fresh", DATA.palette.fresh);
    document.documentElement.style.setProperty("--sink", DATA.palette.sink);
    document.documentElement.style.setProperty("--promptend", DATA.palette.promptend);
    $("title").textContent = DATA.title;
    buildControls(); readHash(); renderPanels(); render();
    window.addEventListener("hashchange", function () { readHash(); render(); });
    document.body.dataset.ready = "1";
  } catch (e) { report("error: " + e.message); }
})();
