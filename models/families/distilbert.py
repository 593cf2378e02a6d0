"""DistilBERT (Sanh et al. 2019): a BERT-shaped encoder of 6 layers without token types, whose attention module names
its projections q_lin/k_lin/v_lin/out_lin. Its transformers module runs attention through the AttentionInterface, so
the BERT adapter serves it (its tokenizer sends no token_type_ids); what is its own is where W_O is (`out_lin`, for
value weighting, lenses and head patching) and how it is recognised. Added through the registry (issue 54)."""
from __future__ import annotations

from models.families import encoder
from models.families.base import Family

FAMILY = Family(
    name="distilbert", kind="text", what="DistilBERT encoders (distilbert)",
    recognises=lambda config, source: config.model_type == "distilbert",
    load=encoder.load, describe=encoder.describe, adapter=encoder.adapter, output_projection="out_lin")
