// "§n" in help text built by the scripts → a link to that section of the guide (/guide#sn, docs/science.md),
// the rest kept as text. "§9.2" links #s9-2; "§2–4" links #s2. Used as el("p", {}, ...guideLinks(text)).

const SECTION = /§(\d+)(?:\.(\d+))?(?:[–-]\d+)?/g;

export function guideLinks(text) {
  const parts = [];
  let last = 0;
  for (const match of text.matchAll(SECTION)) {
    if (match.index > last) parts.push(text.slice(last, match.index));
    const link = document.createElement("a");
    link.href = `/guide#s${match[1]}${match[2] ? `-${match[2]}` : ""}`;
    link.textContent = match[0];
    parts.push(link);
    last = match.index + match[0].length;
  }
  if (last < text.length) parts.push(text.slice(last));
  return parts;
}

// Replace a node's content with `text`, its "§n" as links.
export const setHelpText = (node, text) => node.replaceChildren(...guideLinks(text));
