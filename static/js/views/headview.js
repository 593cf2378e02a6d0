// bertviz-like head view: queries on the left, keys on the right, a line per (query, key) with
// opacity ∝ P. Hovering a token keeps only its lines; clicking a key token toggles its mask.
import { visibleToken } from "../dom.js";

const NS = "http://www.w3.org/2000/svg";
const MIN_WEIGHT = 0.02; // lines below this are not drawn (keeps 512-token views light)
const MAX_TOKENS = 160;

// tokens: the keys (right); queryTokens: the queries (left), the same tokens unless the map is rectangular.
export function drawHeadView(container, matrix, tokens, { masked = new Set(), onToggleKey = null, queryTokens = tokens } = {}) {
  container.replaceChildren();
  const n = Math.max(tokens.length, queryTokens.length);
  if (n > MAX_TOKENS) {
    const note = document.createElement("p");
    note.className = "help";
    note.textContent = `${n} tokens: the head view shows up to ${MAX_TOKENS}; use the heatmap.`;
    container.append(note);
    return;
  }
  const rowH = 18, width = 460, top = 10;
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${top * 2 + n * rowH}`);
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", "head view: attention lines from queries to keys");
  const xl = 150, xr = width - 150;
  const lines = document.createElementNS(NS, "g");
  const y = (i) => top + i * rowH + rowH / 2;
  for (let i = 0; i < queryTokens.length; i++) {
    for (let j = 0; j < tokens.length; j++) {
      const w = matrix[i][j];
      if (w < MIN_WEIGHT) continue;
      const line = document.createElementNS(NS, "line");
      line.setAttribute("x1", xl + 4); line.setAttribute("y1", y(i));
      line.setAttribute("x2", xr - 4); line.setAttribute("y2", y(j));
      line.setAttribute("stroke", "#3b5bdb");
      line.setAttribute("stroke-opacity", Math.min(1, w).toFixed(3));
      line.setAttribute("stroke-width", (0.5 + 3 * w).toFixed(2));
      line.dataset.q = i; line.dataset.k = j;
      lines.append(line);
    }
  }
  svg.append(lines);
  const highlight = (side, index) => {
    for (const line of lines.children) {
      const on = index === null || Number(line.dataset[side]) === index;
      line.style.display = on ? "" : "none";
    }
  };
  const sides = [["q", xl, "end", queryTokens], ["k", xr, "start", tokens]];
  for (const [side, x, anchor, labels] of sides) {
    labels.forEach((tok, i) => {
      const label = document.createElementNS(NS, "text");
      label.setAttribute("x", x); label.setAttribute("y", y(i) + 4);
      label.setAttribute("text-anchor", anchor);
      label.textContent = visibleToken(tok);
      if (side === "k" && masked.has(i)) label.classList.add("masked");
      label.addEventListener("mouseenter", () => highlight(side, i));
      label.addEventListener("mouseleave", () => highlight(side, null));
      if (side === "k" && onToggleKey) label.addEventListener("click", () => onToggleKey(i));
      label.dataset.side = side; label.dataset.index = i;
      svg.append(label);
    });
  }
  container.append(svg);
}
