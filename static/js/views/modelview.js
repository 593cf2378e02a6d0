// Grid of every layer × head as canvas thumbnails (cheap to draw for 72+ heads); click selects.
import { viridis } from "../colors.js";
import { keepFocus, keyActivate, markRefocus } from "../dom.js";

export function drawModelView(container, thumbs, { layer, head, onSelect, entropy = null }) {
  const nLayers = thumbs.length, nHeads = thumbs[0].length;
  container.replaceChildren();
  container.style.gridTemplateColumns = `28px repeat(${nHeads}, 1fr)`;
  container.append(axis(""));
  for (let h = 0; h < nHeads; h++) container.append(axis(`h${h}`));
  for (let l = 0; l < nLayers; l++) {
    container.append(axis(`L${l}`));
    for (let h = 0; h < nHeads; h++) {
      const canvas = drawThumb(thumbs[l][h]);
      canvas.dataset.layer = l; canvas.dataset.head = h;
      canvas.title = `layer ${l}, head ${h}` + (entropy ? `, mean entropy ${entropy[l][h].toFixed(3)}` : "");
      if (l === layer && h === head) canvas.classList.add("selected");
      canvas.addEventListener("click", () => onSelect(l, h));
      keyActivate(canvas, () => { markRefocus(container); onSelect(l, h); }, canvas.title);
      // one tab stop for the grid (the selected head); ← → ↑ ↓ move the selection, Enter picks a cell
      canvas.tabIndex = l === layer && h === head ? 0 : -1;
      container.append(canvas);
    }
  }
  if (!container.dataset.arrowsBound) {
    container.dataset.arrowsBound = "1";
    container.addEventListener("keydown", (e) => { if (e.key.startsWith("Arrow")) markRefocus(container); });
  }
  keepFocus(container, "canvas.selected");
}

function axis(text) {
  const el = document.createElement("div");
  el.className = "axis";
  el.textContent = text;
  return el;
}

// rows × cols: cross-attention thumbnails are rectangular (target queries × source keys).
function drawThumb(matrix) {
  const n = matrix.length, m = matrix[0]?.length ?? 0;
  const canvas = document.createElement("canvas");
  canvas.width = m; canvas.height = n;
  const ctx = canvas.getContext("2d");
  const image = ctx.createImageData(m, n);
  let max = 1e-12;
  for (const row of matrix) for (const v of row) if (v > max) max = v;
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < m; j++) {
      const [r, g, b] = viridis(matrix[i][j] / max);
      const o = 4 * (i * m + j);
      image.data[o] = r; image.data[o + 1] = g; image.data[o + 2] = b; image.data[o + 3] = 255;
    }
  }
  ctx.putImageData(image, 0, 0);
  return canvas;
}
