// plotly.js on demand. Evaluating it takes 1–2 s on a slow CPU (benchmarks/results), so the text page
// paints its first heatmap without it and loads it right after. Pages that include its <script> tag
// already have window.Plotly.
const PLOTLY_URL = "/static/vendor/plotly.min.js";
let loading = null;

// Mode bars: only the buttons that serve these pages (zoom, pan, reset; each figure has its own PNG button).
// Hidden until hover, the rest were invisible tab stops (about 8 per figure) and a "Share chart" button.
// A figure that needs more (the image overlay's box select for masking) names them in its own config.
export const MODEBAR_REMOVE = [
  "sendDataToCloud", "editInChartStudio", "toImage", "select2d", "lasso2d", "zoomIn2d", "zoomOut2d", "autoScale2d",
  "hoverClosestCartesian", "hoverCompareCartesian", "toggleSpikelines", "toggleHover", "resetViews",
];

export function configurePlotly(P = window.Plotly) {
  P?.setPlotConfig?.({ displaylogo: false, showSendToCloud: false, showEditInChartStudio: false, modeBarButtonsToRemove: MODEBAR_REMOVE });
  return P;
}
configurePlotly();

export function loadPlotly() {
  if (window.Plotly) return Promise.resolve(window.Plotly);
  loading ??= new Promise((resolve, reject) => {
    const script = document.createElement("script");
    script.src = PLOTLY_URL;
    script.onload = () => resolve(configurePlotly(window.Plotly));
    script.onerror = () => { loading = null; reject(new Error(`could not load ${PLOTLY_URL}`)); };
    document.head.append(script);
  });
  return loading;
}
