// Shoal's small charts, drawn by hand on canvas (no chart library, nothing fetched).
"use strict";

window.ShoalCharts = (() => {
  // A canvas sized for the screen's pixel ratio; its 2D context works in CSS pixels.
  function context2d(canvas) {
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || canvas.width;
    const height = canvas.clientHeight || canvas.height;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    return { ctx, width, height };
  }

  // The runs of points between gaps (null values), in pixels.
  function runs(times, values, x, y) {
    const found = [];
    let current = [];
    for (let i = 0; i < times.length; i++) {
      const v = values[i];
      if (v === null || v === undefined) {
        if (current.length) found.push(current);
        current = [];
      } else {
        current.push([x(times[i]), y(v)]);
      }
    }
    if (current.length) found.push(current);
    return found;
  }

  // One series over the time range [from, to] inside `box`, scaled to `maxValue`; a run of
  // a single point is a dot; `fill` shades the area under each run.
  function drawSeries(ctx, times, values, from, to, maxValue, box, color, fill) {
    const x = (t) => box.left + ((t - from) / (to - from)) * box.width;
    const y = (v) => box.top + box.height - (Math.min(v, maxValue) / maxValue) * box.height;
    const bottom = box.top + box.height;
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = 1.5;
    for (const run of runs(times, values, x, y)) {
      if (run.length === 1) {
        ctx.fillRect(run[0][0] - 1, run[0][1] - 1, 2, 2);
        continue;
      }
      ctx.beginPath();
      run.forEach(([px, py], i) => (i ? ctx.lineTo(px, py) : ctx.moveTo(px, py)));
      ctx.stroke();
      if (fill) {
        ctx.lineTo(run[run.length - 1][0], bottom);
        ctx.lineTo(run[0][0], bottom);
        ctx.closePath();
        ctx.globalAlpha = 0.12;
        ctx.fill();
        ctx.globalAlpha = 1;
      }
    }
  }

  function maxOf(values) {
    let max = 0;
    for (const v of values) if (v !== null && v !== undefined && v > max) max = v;
    return max;
  }

  // A sparkline: one series over [from, to], its own scale, a base line.
  function sparkline(canvas, times, values, color, from, to, fill) {
    const { ctx, width, height } = context2d(canvas);
    ctx.strokeStyle = "#e3e6ea";
    ctx.lineWidth = 1;
    ctx.beginPath();
    ctx.moveTo(0, height - 0.5);
    ctx.lineTo(width, height - 0.5);
    ctx.stroke();
    drawSeries(ctx, times, values, from, to, (maxOf(values) || 1) * 1.1, { left: 1, top: 2, width: width - 2, height: height - 3 },
      color, fill !== false);
  }

  // Two series over [from, to], the left one on the left axis, the right one on the right axis.
  function timeChart(canvas, times, left, right, from, to, format) {
    const { ctx, width, height } = context2d(canvas);
    const box = { left: 44, top: 6, width: width - 90, height: height - 24 };
    ctx.font = "11px system-ui, sans-serif";
    ctx.fillStyle = "#6b7280";
    ctx.strokeStyle = "#e3e6ea";
    ctx.lineWidth = 1;
    for (let i = 0; i <= 2; i++) {
      const yy = Math.round(box.top + (box.height * i) / 2) + 0.5;
      ctx.beginPath();
      ctx.moveTo(box.left, yy);
      ctx.lineTo(box.left + box.width, yy);
      ctx.stroke();
    }
    const maxLeft = (maxOf(left.values) || 1) * 1.1;
    const maxRight = (maxOf(right.values) || 1) * 1.1;
    ctx.textAlign = "right";
    ctx.fillText(format(maxLeft), box.left - 6, box.top + 8);
    ctx.fillText("0", box.left - 6, box.top + box.height);
    ctx.textAlign = "left";
    ctx.fillText(format(maxRight), box.left + box.width + 6, box.top + 8);
    ctx.fillText("0", box.left + box.width + 6, box.top + box.height);
    ctx.textAlign = "center";
    ctx.fillText("−" + Math.round((to - from) / 60) + " min", box.left + 14, height - 4);
    ctx.fillText("now", box.left + box.width - 10, height - 4);
    drawSeries(ctx, times, left.values, from, to, maxLeft, box, left.color, true);
    drawSeries(ctx, times, right.values, from, to, maxRight, box, right.color, false);
  }

  return { sparkline, timeChart };
})();
