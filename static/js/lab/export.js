// Export: any Plotly figure as PNG (Plotly.downloadImage), the current response as JSON.

// A small "PNG" button that downloads the figure in `plotEl` (a .js-plotly-plot element).
export function pngButton(plotEl, filename) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = "export-png";
  b.textContent = "PNG";
  b.title = "download this figure as PNG";
  b.dataset.figure = plotEl.id;
  b.addEventListener("click", () => downloadPNG(plotEl, filename));
  return b;
}

export function downloadPNG(plotEl, filename) {
  if (!plotEl || !plotEl.classList.contains("js-plotly-plot")) return Promise.reject(new Error("no figure drawn yet"));
  const { width, height } = plotEl.getBoundingClientRect();
  return Plotly.downloadImage(plotEl, {
    format: "png", filename, width: Math.max(300, Math.round(width)), height: Math.max(200, Math.round(height)),
  });
}

// Put a PNG button into each element marked data-png-for="<plot id>" (e.g. a panel heading).
export function installPngButtons(root = document, prefix = "attnlab") {
  for (const slot of root.querySelectorAll("[data-png-for]")) {
    if (slot.querySelector(".export-png")) continue;
    const plot = document.getElementById(slot.dataset.pngFor);
    if (plot) slot.append(pngButton(plot, `${prefix}-${plot.id}`));
  }
}

export function downloadJSON(payload, filename) {
  const blob = new Blob([JSON.stringify(payload, null, 1)], { type: "application/json" });
  const url = URL.createObjectURL(blob);
  const a = document.createElement("a");
  a.href = url;
  a.download = filename.endsWith(".json") ? filename : `${filename}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
