// Small DOM helpers shared by every page and the lab (one meaning per name).

export const byId = (id) => document.getElementById(id);

// A new element: el("button", {type: "button", textContent: "go"}, child, "text", …).
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  node.append(...children);
  return node;
}

export function button(text, onClick, props = {}) {
  const b = el("button", { type: "button", textContent: text, ...props });
  b.addEventListener("click", onClick);
  return b;
}

// Fill a <select> with [value, label] pairs (rebuilt only when the options change) and select `value`.
export function setOptions(select, options, value = null) {
  const key = JSON.stringify(options);
  if (select.dataset.options !== key) {
    select.replaceChildren(...options.map(([v, label]) => new Option(label, v)));
    select.dataset.options = key;
  }
  if (value !== null && value !== undefined) select.value = String(value);
}

// Models the server lists under `not_ready` (GET /api/models: being prepared, or their preparation failed), added to a
// model <select> as options that cannot be chosen, after the models it serves.
export function addNotReady(select, notReady = []) {
  for (const m of notReady) {
    if ([...select.options].some((o) => o.value === m.id)) continue;
    const option = new Option(`${m.id} (${m.state === "preparing" ? "being prepared…" : "preparation failed"})`, m.id);
    option.disabled = true;
    option.title = m.state === "preparing" ? "its weights are being prepared on the server: reload the page in a moment"
      : `its preparation failed: ${m.error ?? ""} (log: ${m.log ?? "the server's log"})`;
    select.append(option);
  }
}

// [[0, "layer 0"], [1, "layer 1"], …]
export const numbered = (n, prefix) => Array.from({ length: n }, (_, i) => [i, `${prefix} ${i}`]);

// A <dl> filled with (term, value) rows.
export function fillList(dl, rows) {
  dl.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", { textContent: k }), el("dd", { textContent: v })]));
}

// Arrow keys outside form fields: ← → move the head, ↑ ↓ the layer.
export function onArrowKeys(move) {
  document.addEventListener("keydown", (e) => {
    if (["INPUT", "TEXTAREA", "SELECT"].includes(document.activeElement?.tagName)) return;
    const moves = { ArrowLeft: [0, -1], ArrowRight: [0, 1], ArrowUp: [-1, 0], ArrowDown: [1, 0] };
    if (!moves[e.key] || e.shiftKey) return; // Shift + arrows are the image overlay's patch cursor
    e.preventDefault();
    move(...moves[e.key]);
  });
}

// Keyboard for a clickable element that is not a button: in the tab order, Enter or Space does what a click does.
export function keyActivate(node, action, label = null) {
  node.tabIndex = 0;
  node.setAttribute("role", "button");
  if (label) node.setAttribute("aria-label", label);
  node.addEventListener("keydown", (e) => {
    if (e.key !== "Enter" && e.key !== " ") return;
    e.preventDefault();
    action(e);
  });
}

// After a redraw replaced the element that had the focus (chosen with the keyboard), give it to its successor.
export function keepFocus(container, selector) {
  if (container.dataset.refocus !== "1") return;
  delete container.dataset.refocus;
  container.querySelector(selector)?.focus();
}
export const markRefocus = (container) => { container.dataset.refocus = "1"; };

// A token as the user should read it: leading spaces and newlines made visible (the next-token panel).
export const showToken = (t) => JSON.stringify(t).slice(1, -1).replace(/^ /, "␣").replace(/ $/, "␣") || "∅";

// A token on a chip, an axis or a label: one that would draw as nothing or break the line (white space only,
// a newline, a tab) is spelled as showToken does ("\n", "␣"); every other token as it is.
export const visibleToken = (t) => (/^\s*$/.test(t) || /[\n\r\t]/.test(t) ? showToken(t) : t);

// "1 head", "9 heads": a count with its noun in the right number.
export const count = (n, noun, plural = `${noun}s`) => `${Number(n).toLocaleString("en")} ${Number(n) === 1 ? noun : plural}`;
