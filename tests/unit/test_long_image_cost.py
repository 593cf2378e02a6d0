"""The cost estimate of a long image counts its rollout (app/costs.py, VitAdapter.summary_macs): over
full_map_tokens_image the rollout rebuilds every row of every layer from q̂/k̂, L·H·T²·d multiply-adds counted 1.5×
(at 896 px on dinov2-small it took about half the run's time). A short image takes the rollout from its kept maps."""
from __future__ import annotations

import pytest
from fastapi import HTTPException

from app.admission import check_request_cost
from types import SimpleNamespace

from app.costs import CostMeasures, forward_macs, model_shape
from app.settings import Settings
from models.adapters.vit import VitAdapter
from tests.api.test_images_api import build_tiny_vit


def test_long_image_rollout_counts_in_the_cost_estimate(tmp_path):
    adapter = VitAdapter("tiny-dino-cost", str(build_tiny_vit(tmp_path / "dino", kind="dinov2")), device="cpu")
    n, info = 37, adapter.info  # 48 px: 6 × 6 patches + CLS
    forward = forward_macs(model_shape(adapter), n, n)
    adapter.full_map_tokens = 8
    rollout = adapter.summary_macs(n)
    assert rollout == 1.5 * info.layers * info.heads * n**2 * info.head_dim
    # a throughput at which the forward alone fits in 1 s and the forward with the rollout does not
    settings = Settings(default_models=[], request_timeout_s=1.0, compute_gmacs_per_s=(forward + rollout / 2) / 1e9)
    runtime = SimpleNamespace(settings=settings, measures=CostMeasures())  # the default rate: nothing measured
    with pytest.raises(HTTPException) as refused:
        check_request_cost(adapter, runtime, n, 1, 0)
    assert refused.value.status_code == 413 and "request_timeout_s" in refused.value.detail
    adapter.full_map_tokens = 10**6  # the same image kept whole: its rollout comes from the maps
    assert adapter.summary_macs(n) == 0.0
    check_request_cost(adapter, runtime, n, 1, 0)
