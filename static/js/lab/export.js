// Export: a figure as PNG — a Plotly plot (Plotly.downloadImage), an element holding an <svg> (the head
// view) or a grid of <canvas> thumbnails (the model view) — and the current response as JSON.
import { setStatus } from "../api.js";

// A small "PNG" button that downloads the figure in `plotEl` (see downloadPNG for what it can be).
// filename: a string, or a function asked at each click (the page's model may have changed since).
export function pngButton(plotEl, filename) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "export-png";
  b.textContent = "PNG";
  b.title = "download this figure as PNG";
  b.dataset.figure = plotEl.id;
  b.addEventListener("click", () => downloadPNG(plotEl, typeof filename === "function" ? filename() : filename)
    .catch((err) => setStatus(`PNG export failed: ${err.message}`, { error: true })));
  return b;
}

// title: drawn into the image above the figure (model, layer, head, β…), so the file says what it shows
// without its name.
export function downloadPNG(el, filename, { title = "" } = {}) {
  if (!el) return Promise.reject(new Error("no figure drawn yet"));
  const save = (canvas) => downloadCanvas(title ? titledCanvas(canvas, title) : canvas, filename);
  if (el.classList.contains("js-plotly-plot")) {
    const { width, height } = el.getBoundingClientRect();
    const size = { format: "png", width: Math.max(300, Math.round(width)), height: Math.max(200, Math.round(height)) };
    if (!title) return Plotly.downloadImage(el, { ...size, filename });
    return Plotly.toImage(el, size).then(imageCanvas).then(save);
  }
  if (el.querySelector("canvas[data-layer]")) return save(modelViewCanvas(el));
  const svg = el instanceof SVGSVGElement ? el : el.querySelector("svg");
  if (svg) return svgCanvas(svg).then(save);
  return Promise.reject(new Error("no figure drawn yet"));
}

function imageCanvas(src) {
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => {
      const canvas = document.createElement("canvas");
      canvas.width = img.naturalWidth;
      canvas.height = img.naturalHeight;
      canvas.getContext("2d").drawImage(img, 0, 0);
      resolve(canvas);
    };
    img.onerror = () => reject(new Error("the browser could not draw the figure"));
    img.src = src;
  });
}

// The figure below a white band holding its title (wrapped to the figure's width).
export function titledCanvas(figure, title) {
  const font = Math.max(13, Math.round(figure.width / 60));
  const measure = document.createElement("canvas").getContext("2d");
  measure.font = `600 ${font}px ${EXPORT_FONT}`;
  const lines = [];
  for (const word of title.split(" ")) {
    const last = lines.at(-1);
    if (last !== undefined && measure.measureText(`${last} ${word}`).width < figure.width - 2 * font) lines[lines.length - 1] = `${last} ${word}`;
    else lines.push(word);
  }
  const band = Math.round(font * (0.8 + 1.4 * lines.length));
  const canvas = document.createElement("canvas");
  canvas.width = figure.width;
  canvas.height = figure.height + band;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.fillStyle = "#1d2230";
  ctx.font = measure.font;
  ctx.textBaseline = "top";
  lines.forEach((line, i) => ctx.fillText(line, font, Math.round(font * (0.5 + 1.4 * i))));
  ctx.drawImage(figure, 0, band);
  return canvas;
}

const EXPORT_FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";

// The model view (static/js/views/modelview.js: canvases tagged data-layer/data-head) as one canvas:
// thumbnails scaled up by a whole factor without smoothing (one token = a block of pixels), L/h labels,
// the selected head outlined.
export function modelViewCanvas(container) {
  const thumbs = [...container.querySelectorAll("canvas[data-layer]")];
  const nLayers = 1 + Math.max(...thumbs.map((c) => Number(c.dataset.layer)));
  const nHeads = 1 + Math.max(...thumbs.map((c) => Number(c.dataset.head)));
  const n = Math.max(...thumbs.map((c) => c.width));
  const scale = Math.max(1, Math.floor(128 / n));
  const cell = Math.max(8, Math.min(n * scale, Math.floor(8000 / Math.max(nLayers, nHeads))));
  const gap = Math.max(3, Math.round(cell / 24)), left = 40, top = 24, pad = 10;
  const canvas = document.createElement("canvas");
  canvas.width = pad * 2 + left + nHeads * (cell + gap) - gap;
  canvas.height = pad * 2 + top + nLayers * (cell + gap) - gap;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff";
  ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.fillStyle = "#555";
  ctx.font = `12px ${EXPORT_FONT}`;
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  const x0 = (h) => pad + left + h * (cell + gap), y0 = (l) => pad + top + l * (cell + gap);
  for (let h = 0; h < nHeads; h++) ctx.fillText(`h${h}`, x0(h) + cell / 2, pad + top / 2);
  for (let l = 0; l < nLayers; l++) ctx.fillText(`L${l}`, pad + left / 2, y0(l) + cell / 2);
  ctx.imageSmoothingEnabled = false;
  for (const thumb of thumbs) {
    const l = Number(thumb.dataset.layer), h = Number(thumb.dataset.head);
    ctx.drawImage(thumb, x0(h), y0(l), cell, cell);
    if (thumb.classList.contains("selected")) {
      ctx.strokeStyle = getComputedStyle(thumb).borderTopColor || "#3b5bdb";
      ctx.lineWidth = 2;
      ctx.strokeRect(x0(h) - 1, y0(l) - 1, cell + 2, cell + 2);
    }
  }
  return canvas;
}

// Style properties a stylesheet may set on SVG content; copied inline so the serialized SVG, drawn as
// an image (no page CSS reaches it), looks like the page.
const SVG_STYLE_PROPS = [
  "fill", "fill-opacity", "stroke", "stroke-width", "stroke-opacity", "opacity", "display", "visibility",
  "font-family", "font-size", "font-weight", "font-style", "text-decoration", "text-anchor", "dominant-baseline",
];

// An <svg> drawn into a canvas (its viewBox at `pixelRatio`×, white background) through an <img> of its markup.
export function svgCanvas(svg, pixelRatio = 2.5) {
  const clone = svg.cloneNode(true);
  const originals = [svg, ...svg.querySelectorAll("*")];
  const copies = [clone, ...clone.querySelectorAll("*")];
  originals.forEach((el, i) => {
    const computed = getComputedStyle(el);
    const style = SVG_STYLE_PROPS.map((prop) => `${prop}:${computed.getPropertyValue(prop)}`).join(";");
    copies[i].setAttribute("style", style);
  });
  // The drawing's own extent (its viewBox) rather than the box it is centred in on the page.
  const viewBox = svg.viewBox?.baseVal, box = svg.getBoundingClientRect();
  const [width, height] = viewBox?.width ? [viewBox.width, viewBox.height] : [box.width || 600, box.height || 400];
  clone.setAttribute("xmlns", "http://www.w3.org/2000/svg");
  clone.setAttribute("width", width);
  clone.setAttribute("height", height);
  const markup = new XMLSerializer().serializeToString(clone);
  return new Promise((resolve, reject) => {
    const img = new Image();
    img.onload = () => {
      const canvas = document.createElement("canvas");
      canvas.width = Math.round(width * pixelRatio);
      canvas.height = Math.round(height * pixelRatio);
      const ctx = canvas.getContext("2d");
      ctx.fillStyle = "#fff";
      ctx.fillRect(0, 0, canvas.width, canvas.height);
      ctx.drawImage(img, 0, 0, canvas.width, canvas.height);
      resolve(canvas);
    };
    img.onerror = () => reject(new Error("the browser could not draw the SVG"));
    img.src = `data:image/svg+xml;charset=utf-8,${encodeURIComponent(markup)}`;
  });
}

function downloadCanvas(canvas, filename) {
  return new Promise((resolve, reject) => {
    canvas.toBlob((blob) => {
      if (!blob) return reject(new Error("the browser could not encode the PNG"));
      downloadBlob(blob, filename.endsWith(".png") ? filename : `${filename}.png`);
      resolve();
    }, "image/png");
  });
}

export function downloadBlob(blob, filename) {
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = filename;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

// Put a PNG button into each element marked data-png-for="<plot id>" (e.g. a panel heading).
// prefix: a string or a function (asked at each click: "attnlab-<the model shown now>").
export function installPngButtons(root = document, prefix = "attnlab") {
  for (const slot of root.querySelectorAll("[data-png-for]")) {
    if (slot.querySelector(".export-png")) continue;
    const plot = document.getElementById(slot.dataset.pngFor);
    if (plot) slot.append(pngButton(plot, () => `${typeof prefix === "function" ? prefix() : prefix}-${plot.id}`));
  }
}

export function downloadJSON(payload, filename) {
  // a field read in the binary form holds a Float32Array (api.js postBinary): written as a list of numbers
  const blob = new Blob([JSON.stringify(payload, (_key, value) => (ArrayBuffer.isView(value) ? Array.from(value) : value), 1)],
    { type: "application/json" });
  downloadBlob(blob, filename.endsWith(".json") ? filename : `${filename}.json`);
}
