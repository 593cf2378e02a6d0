// plotly.js on demand. Evaluating it takes 1–2 s on a slow CPU (benchmarks/results), so the text page
// paints its first heatmap without it and loads it right after. Pages that include its <script> tag
// already have window.Plotly.
const PLOTLY_URL = "/static/vendor/plotly.min.js";
let loading = null;

export function loadPlotly() {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  loading ??= new Promise((resolve, reject) => {
    const script = document.createElement("script");
    script.src = PLOTLY_URL;
    script.onload = () => resolve(window.Plotly);
    script.onerror = () => { loading = null; reject(new Error(`could not load ${PLOTLY_URL}`)); };
    document.head.append(script);
  });
  return loading;
}
