"""The attention request pipeline (issue 32): route → job (app/pipeline/job.py: the request checked once, its run
plan and cost) → runtime (the runs) → maps (app/pipeline/maps.py: the weighting applied before any map is read) →
view (app/pipeline/views.py: one per family) → encoding (app/encoding.py)."""
from app.pipeline.job import AttentionJob, ExtraWork, plain_job, seq2seq_job, whisper_job
from app.pipeline.views import answer

__all__ = ["AttentionJob", "ExtraWork", "answer", "plain_job", "seq2seq_job", "whisper_job"]
