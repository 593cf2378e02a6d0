// Attention heatmap of one head: rows are queries, columns are keys (SPEC §1).

// Plotly merges duplicate category labels, so each token label gets its index.
export const tokenLabels = (tokens) => tokens.map((t, i) => `${i}:${t}`);

export function drawHeatmap(el, matrix, tokens, { title = "", zmax = null, colorscale = "Viridis", zmid = null } = {}) {
  const labels = tokenLabels(tokens);
  const trace = {
    type: "heatmap", z: matrix, x: labels, y: labels, colorscale,
    zmin: zmid === null ? 0 : -zmax, zmax: zmax ?? undefined, zmid: zmid ?? undefined,
    hovertemplate: "query %{y}<br>key %{x}<br>P = %{z:.4f}<extra></extra>",
    colorbar: { thickness: 12 },
  };
  const dense = tokens.length > 40;
  const layout = {
    title: { text: title, font: { size: 13 } },
    margin: { l: dense ? 40 : 90, r: 10, t: title ? 30 : 10, b: dense ? 40 : 90 },
    xaxis: { title: { text: "key" }, tickangle: -60, showticklabels: !dense, type: "category" },
    yaxis: { title: { text: "query" }, autorange: "reversed", showticklabels: !dense, type: "category" },
  };
  return Plotly.react(el, [trace], layout, { responsive: true, displaylogo: false });
}
