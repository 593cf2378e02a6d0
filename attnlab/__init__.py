"""attnlab in Python: `Lab`, a client over the lab's HTTP API (docs/notebook.md), its interventions and results.

    from attnlab import Lab, Temperature
    lab = Lab.start()                       # or Lab("http://127.0.0.1:8000")
    r = lab.attention("The capital of France is", model="smollm2-135m",
                      interventions=[Temperature(0.5, layers=[10])], compare=True)
    r.attention                             # numpy (layers, heads, T, T)

The client needs the standard library and numpy only (tqdm and xarray when installed); the server is the same
package's `app` (`attnlab serve`).
"""
from attnlab.client import Lab
from attnlab.errors import LabError
from attnlab.interventions import (AblateHeads, Causal, Intervention, MaskKeys, PatchHeads, PatchResidual,
                                   PerturbKeys, PerturbQueries, Positions, Temperature)
from attnlab.results import (AttentionResult, AudioAttentionResult, Clip, Continuation, FaithfulnessResult,
                             LensResult, PatchingResult, Picture, Result, Window)

__all__ = [
    "Lab", "LabError",
    "Intervention", "Temperature", "MaskKeys", "Causal", "AblateHeads", "PerturbKeys", "PerturbQueries",
    "PatchHeads", "PatchResidual", "Positions",
    "Result", "AttentionResult", "Window", "Continuation", "PatchingResult", "LensResult", "FaithfulnessResult",
    "AudioAttentionResult", "Clip", "Picture",
]
