"""The attention request pipeline (issue 32): route → job (app/pipeline/job.py: the request checked once, its run
plan and cost) → runtime (the runs) → maps (app/pipeline/maps.py: the weighting applied before any map is read) →
view (app/pipeline/views.py: one per family) → encoding (app/encoding.py). The job's kind and its view are the model
family's (Family.job, Family.view: models/families/)."""
from app.pipeline.job import (JOB_BUILDERS, AttentionJob, ExtraWork, PageInput, PlainJob, Seq2SeqJob, SpeechJob,
                              build_job)
from app.pipeline.views import answer

__all__ = ["JOB_BUILDERS", "AttentionJob", "ExtraWork", "PageInput", "PlainJob", "Seq2SeqJob", "SpeechJob", "answer",
           "build_job"]
