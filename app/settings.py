"""Every limit and knob of the server, read from the environment (prefix ATTNLAB_) when the app starts."""
from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.costs import cache_budgets  # arithmetic only: costs imports nothing of app/
from app.sources import trusted_networks  # ipaddress only
from models.preparing import DEFAULT_MODELS  # the same list attnlab_prepare.py reads


# The settings by topic: each a mixin that Settings inherits (one class each stays readable; issue 54). A mixin
# alone reads no prefix: only Settings, which sets ATTNLAB_, is ever made.
class ModelSettings(BaseSettings):
    """Which models are served, where their weights are, and how they run (device, dtype, threads, allocator)."""

    # Which registry models are loaded at start-up (before /api/ready turns 200); others load on first use.
    default_models: list[str] = Field(default_factory=lambda: list(DEFAULT_MODELS))  # models/preparing.py
    # Extra text models: {"id": "hub-id-or-local-folder"}; ids only, a request never names a path.
    extra_text_models: dict[str, str] = Field(default_factory=dict)
    extra_image_models: dict[str, str] = Field(default_factory=dict)
    # Extra models of any family: {"id": "hub-id-or-local-folder"}; the adapter is chosen from the config
    # (decoder LM, encoder–decoder, ViT-family or BERT-family), and a load-time probe proves the attention is
    # ours and faithful, or the model is refused with the reason. `attnlab serve --model` adds entries here.
    extra_models: dict[str, str] = Field(default_factory=dict)
    weights_dir: str = "weights"  # prepared weights (dinov2-small) live here; ignored by git
    # Prepare the default models not loaded at start (dinov2-small, whisper-tiny-en, gemma3-270m) while serving, in
    # `attnlab prepare` child processes (app/preparation.py); until each is ready a request for it gets 503 and GET
    # /api/models lists it under `not_ready`. `make run` sets it; `make setup` prepares everything first instead.
    prepare_in_background: bool = False

    # "auto": a GPU when torch sees one, else the CPU (logged at start); "cuda": a GPU or the server does not start.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Weights and activations of the served models. float16/bfloat16 are for GPUs (half the memory, faster
    # matrix units); attention logits and softmax stay float32. Each model reports `dtype_parity`, its max
    # |Δ output| against float32 on its probe input (GET /api/models).
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    torch_threads: int = 0  # 0 = leave torch's default
    # What runs float32 Linear layers on the CPU (models/cpu_linear.py): "auto" measures oneDNN against MKL once at
    # start and takes oneDNN when it needs ≤ 0.9× the time (0.46× on the AMD CI machine); "onednn"; "blas" (MKL).
    cpu_linear: Literal["auto", "onednn", "blas"] = "auto"
    # glibc malloc arenas of the server process: `attnlab serve` / `python -m app.serve` re-execute themselves with
    # MALLOC_ARENA_MAX set to this unless the environment already sets it (or preloads jemalloc); 0 = glibc's default
    # (8 per core: freed memory stayed in per-thread arenas, docs/deploy.md "Memory allocator"). Read at start only.
    malloc_arena_max: int = Field(2, ge=0)
    # The served process calls glibc's malloc_trim(0) this often (seconds; 0 = never): freed pages inside the arenas go
    # back to the kernel (after a long run's buffers were freed, 1.7 GB of RSS did: docs/deploy.md "Memory allocator").
    malloc_trim_interval_s: float = Field(10.0, ge=0)
    # Free heap memory the served process keeps mapped in the arena of the thread that ran each plain response, topped
    # up after it: the next fresh run's kept buffers then take no page faults in the forward (app/allocator.py
    # WarmHeap; minilm at 128 tokens keeps ~8.5 MB a view). 0 = off; glibc only. Read at start only.
    warm_heap_bytes: int = Field(32 * 2**20, ge=0)
    # Inputs of at most this many tokens run on one thread: as fast on such small matrices (measured on the
    # 2-core CI machine, benchmarks/results), and the other cores stay free for HTTP, JSON and a browser.
    single_thread_max_tokens: int = 48
    # The thread of a plain request that finishes while another model request is being handled, and a job's as it
    # hands the model to interactive work, ends its OpenMP team: the process keeps one team, and the next forward is
    # not slowed by an idle one (app/openmp_teams.py: two clients at once 34-44 → 23-28 ms a 128-token minilm
    # forward). One client alone pays nothing.
    openmp_one_team: bool = True



class InputLimits(BaseSettings):
    """What one request may ask for: text, tokens, maps, windows, runs, analysis, uploads and images."""

    # Limits on input.
    max_text_chars: int = 20_000
    # Text tokens per input (a model's own context caps it further): inputs over full_map_tokens run blockwise and
    # keep an atlas instead of every attention map (docs/science.md §10). On a GPU, max_tokens_gpu applies instead
    # (None: the model's own context, 8,192 for smollm2-135m).
    max_tokens: int = 4096
    max_tokens_gpu: int | None = None
    # Runs over this many tokens keep q̂/k̂ and summaries (overview, received, entropy, distance) instead of P; their
    # responses carry `attention: null` and an overview; POST /api/runs/{run_id}/window gives exact windows.
    full_map_tokens: int = Field(512, ge=2)
    # The same for images: the image page draws full maps (up to dinov2-small at 448 px, 1,025 tokens)
    full_map_tokens_image: int = Field(1025, ge=2)
    # Query rows per block of the blockwise attention; None: 128 on a CPU (cache-sized blocks, DESIGN's 2-core figures),
    # 1,024 on a GPU (fewer kernel launches: 8,192 tokens on an H100 took 1.68 s with 128, 0.93 s with 1,024)
    atlas_block_rows: int | None = Field(None, ge=1)
    # A long input's overview: at most this many blocks a side, kept per head (4·B² bytes: at 128, 71 MB for the 270
    # heads of smollm2-135m, at 256 four times that; a 4,096-token run then keeps about 600 MB in all)
    overview_blocks: int = Field(128, ge=2, le=1024)
    max_window_cells: int = Field(262_144, ge=1)  # one window of POST /api/runs/{run_id}/window: rows × cols
    # What one window or row of a kept run may COMPUTE, not only return: each row over all T_k keys, per pass and per
    # layer and head asked (docs/api.md "Runs"); past it 413 naming `rows`, `layers` or `heads`. 2^26 admits every
    # row of a 4,096-token run with `minus` (3 s on the shared 2-core CI machine at load 3.5) and all 270 heads of
    # smollm2-135m at any length.
    max_computed_numbers: int = Field(64 * 2**20, ge=1)
    # What one run may keep on a GPU (its atlas stays in device memory): max_run_bytes applies on a CPU. 8,192
    # tokens of smollm2-135m keep about 2 GB there (q̂, k̂, overview, one 1,024-row block, the mask).
    max_run_bytes_gpu: int = Field(8 * 1024**3, ge=1)
    max_interventions: int = 64
    max_samples: int = 16
    max_thumbnail_size: int = Field(64, ge=2)  # thumbnail_size: each head pooled to at most n × n (L·H·n² bytes)
    # 128 tokens × every head of smollm2-135m (30 × 9) is 4,423,680 numbers: one request, 17.7 MB in the binary form
    max_response_numbers: int = 4_500_000
    # Attention maps one model run may record (L·H·T_q·T_k float32 per run): a bigger run is refused with 413
    # before it starts. 512 tokens of the 30 × 9-head smollm2-135m take 283 MB.
    max_run_bytes: int = 512 * 1024 * 1024
    max_new_tokens: int = 64  # the longest continuation POST /api/text/generate may ask for
    # Patching, lens, faithfulness (app/pipeline/): prompts longer than analysis_max_tokens are refused
    # (422); a scan runs patched copies of the corrupted prompt in batches of about patching_batch_tokens tokens
    # (copies × prompt tokens) per forward; the clean runs' head outputs and residual streams that patch_heads and
    # patch_residual take are kept in a store of their own, up to patch_sources_bytes and patch_sources_runs runs
    # (least recently used first out; an evicted source is a 410).
    analysis_max_tokens: int = Field(128, ge=2)
    patching_batch_tokens: int = Field(2048, ge=1)
    # A patching set (`pairs` or a template's `fillers`): at most this many pairs (413 naming the field); each pair
    # costs a whole head scan, and the cost check still bounds the set's model time
    patching_max_pairs: int = Field(32, ge=1)
    patch_sources_bytes: int = Field(256 * 1024 * 1024, ge=0)
    patch_sources_runs: int = Field(32, ge=1)
    max_upload_bytes: int = 10 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    # Image decodes running at once (a 40-megapixel decode holds a few hundred MB while it runs); an upload
    # that finds no free slot within decode_wait_s is answered 503 + Retry-After.
    max_concurrent_decodes: int = Field(2, ge=1)
    decode_wait_s: float = Field(10.0, ge=0)
    image_cache_items: int = 256
    # decoded uploads kept (RGB, shorter side ≤ 1024 px); None = a share of memory_budget_bytes (app/costs.py)
    image_cache_bytes: int | None = None



class SpeechLimits(BaseSettings):
    """Speech uploads and transcripts."""

    # Speech (/audio, app/routes/audio.py; models/audio.py decodes with PyAV). An upload over max_audio_bytes, or that
    # decodes to more than max_audio_s (Whisper's 30 s window; counted while decoding, so a small file that would
    # decode to hours stops there), is refused with 413; channels and sample rates outside these, 400.
    max_audio_bytes: int = Field(10 * 1024 * 1024, ge=1024)
    max_audio_s: float = Field(30.0, gt=0, le=30.0)
    max_audio_channels: int = Field(8, ge=1)
    min_audio_sample_rate: int = Field(8000, ge=1000)
    max_audio_sample_rate: int = Field(192_000, ge=8000)
    audio_cache_items: int = Field(64, ge=1)  # decoded clips kept (16 kHz mono float32: 1.9 MB per 30 s)
    max_transcript_tokens: int = Field(224, ge=1, le=440)  # greedy transcript length (Whisper's own sample_len)



class FleetSettings(BaseSettings):
    """Replicas: the shared upload store, the registry of run owners, fleet-wide job leases and the drain."""

    # Shared upload store for replicas (app/imagestore.py): uploaded bytes in Redis, so any replica behind a load
    # balancer can serve any image id; None = this process's memory only (the default).
    redis_url: str | None = None  # e.g. "redis://redis:6379/0"
    redis_ttl_s: int = Field(3600, ge=1)  # an upload lives this long after its upload or its last read from Redis
    redis_max_item_bytes: int = Field(10 * 1024 * 1024, ge=1024)  # per upload; the total is Redis's maxmemory
    redis_timeout_s: float = Field(1.0, gt=0)  # connect/read timeout: a down Redis answers 503 fast
    redis_key_prefix: str = "attnlab:image:"
    # A fleet of replicas (app/fleet.py, docs/deploy.md "Fleet"): a run id names the replica that computed it
    # (`<replica_name>.<hex>`); each replica registers `replica_url` (the URL the others reach it at) in Redis with a
    # TTL of replica_ttl_s, refreshed every third of it, and forwards a run's requests to its owner. None: a random
    # name per process / not registered (a single process, or replicas that only share uploads).
    replica_name: str | None = Field(None, pattern=r"^[a-z0-9]{4,16}$")
    replica_url: str | None = None  # e.g. "http://10.0.0.7:8000" (Kubernetes: from the pod IP)
    replica_ttl_s: float = Field(15.0, ge=1)
    forward_timeout_s: float = Field(960.0, gt=0)  # a forwarded request's read timeout (> job_timeout_s: jobs stream)
    # Replicas sharing Redis keep one running job per client over the whole fleet (app/fleetjobs.py): the running job
    # holds its client's lease in Redis, renewed every third of this; a replica that dies leaves it for this long at most.
    job_lease_ttl_s: float = Field(10.0, ge=1, le=300)
    # SIGTERM drains for this long at most (0: no drain, the plain shutdown_grace_s stop): /api/ready and new work
    # answer 503 at once (nginx and Kubernetes move on), running jobs may finish, pinned runs are still served (also
    # forwarded from other replicas); then the process stops as with shutdown_grace_s.
    drain_s: float = Field(0.0, ge=0)



class JobSettings(BaseSettings):
    """The queue and its jobs: depth, timeouts, per-client and per-address caps, heartbeats, re-attaching."""

    # Runtime.
    queue_depth: int = 32  # requests waiting for a model at once before 503
    request_timeout_s: float = 60.0
    # A job (a request sent with Accept: text/event-stream: it streams progress and is told its ETA first, docs/api.md
    # "Jobs") is bounded by this instead of request_timeout_s, and refused with 413 only when its estimate exceeds it.
    job_timeout_s: float = Field(900.0, gt=0)
    # Jobs one client may have queued or running at once (app/jobs.py); one more is answered 429 + Retry-After at once,
    # so one client cannot fill the queue and lock the others out (turns go round the clients: app/scheduler.py).
    max_queued_jobs_per_client: int = Field(4, ge=1)
    # The same for all the clients of one source address together (a client id is free to mint: a new header value
    # is a new client): 429 + Retry-After past it. The address is the socket peer, or what a proxy listed in
    # trusted_proxies forwarded (X-Forwarded-For). A classroom behind one NAT address needs a higher number.
    max_queued_jobs_per_address: int = Field(16, ge=1)
    # Jobs queued or running on this replica at once, from everyone: one more is 503 + Retry-After (the replica is
    # full: nginx tries the next one), so the queue ahead of a newcomer stays bounded whoever sent it.
    max_queued_jobs: int = Field(64, ge=1)
    # Proxies (addresses or networks, e.g. ["127.0.0.1", "10.0.0.0/8"]) whose X-Forwarded-For is believed for a
    # request's source address (max_queued_jobs_per_address): the rightmost address in it that is not a trusted proxy.
    # Empty: the socket peer is the source, whatever the header says.
    trusted_proxies: list[str] = Field(default_factory=list, max_length=256)
    # A job's stream sends something at least this often: an SSE comment (": keep-alive") while it waits or between
    # events, so proxies (nginx's proxy_read_timeout) and clients never see a silent stream. A job not accepted within
    # this starts its stream with them too (a refusal after that is the stream's error event, with its status).
    job_heartbeat_s: float = Field(10.0, gt=0, le=60)
    # A job whose every stream dropped (a network blip, a proxy's cut, a page reload) keeps running this long, waiting
    # for its client to re-attach (GET /api/jobs/{job_id}/events, docs/api.md "Re-attaching to a job"); then it is
    # cancelled as if its client had left. 0: cancelled at once, at its next layer. DELETE /api/jobs/{job_id} cancels
    # at once (the page's Cancel).
    job_reattach_grace_s: float = Field(15.0, ge=0, le=600)
    # Events a job keeps for re-attaching (its latest ones; the done or error event always), until result_pin_s after
    # it ended. A client that re-attaches after more than this many events missed gets an `event: gap` first, then the
    # kept ones: progress is cumulative, and the done event carries the whole answer.
    job_event_buffer: int = Field(256, ge=8, le=100_000)
    # ...and at most this many bytes of them while the job runs (a generate with every head's attention sends ~19 MB a
    # step): past it the oldest are dropped first (a re-attach then gets `event: gap` naming what it missed). Counted
    # in memory_budget_bytes as the job's own (app/memory.py); the last event is always kept.
    job_event_buffer_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024)
    # The ended jobs' kept events (their done events carry whole answers) take at most this many bytes together: past
    # it the events of the jobs that ended first are dropped before result_pin_s, and re-attaching to them is a 404
    # ("expired"). 0: an ended job keeps nothing (a re-attach after the end sends the job again).
    job_events_max_bytes: int = Field(256 * 1024 * 1024, ge=0)

    @field_validator("trusted_proxies")
    @classmethod
    def _trusted_proxies(cls, value: list[str]) -> list[str]:
        trusted_networks(tuple(value))  # a bad entry fails at start, naming it
        return value


class RunStoreSettings(BaseSettings):
    """Kept runs: the wait for room in the memory budget, pins, the RAM and disk tiers (app/runstore.py)."""

    # The longest a request waits for room in memory_budget_bytes (app/memory.py) before it is refused (503) with the
    # reason; a request whose room could not free up before its deadline is refused at once.
    memory_wait_s: float = Field(120.0, ge=0)
    # A run stays pinned in the result cache this long after it was answered or last read by its run id (a window, a
    # row): its client's next step finds it, and a compare keeps both runs. Pinned bytes count against
    # memory_budget_bytes; a request that does not fit beside them waits (app/memory.py).
    result_pin_s: float = Field(120.0, ge=0)
    # The memory accountant also reads the process's RSS: where it shows more in use than its books (kept runs +
    # reserved peaks: what the allocator keeps after a run, an estimate that fell short), new work waits for that too.
    # Off only where one process holds many apps (the test suite).
    memory_watch_rss: bool = True
    result_cache_items: int = 64
    result_cache_bytes: int | None = None  # None = a share of memory_budget_bytes (app/costs.py)
    # On a GPU a run's atlas stays in device memory, so the result cache is sized against the GPU's memory instead:
    # None = a quarter of the device's total (an 8,192-token smollm2-135m run keeps about 0.9 GB; with the host budget
    # of ~0.7 GB it was evicted as soon as it was stored, and its run_id answered 404 at once).
    result_cache_bytes_gpu: int | None = Field(None, ge=1)
    # The run store's disk tier (app/runstore_disk.py): runs that leave RAM (the result cache's bytes above) are written
    # to local disk and read back memory-mapped, so a pinned run is never dropped for lack of memory and its windows
    # cost milliseconds. Unpinned runs are dropped when this budget is full, pinned ones never (with the disk full of
    # pinned runs, they stay in RAM and count in memory_budget_bytes: work that does not fit beside them is refused at
    # once, 503 + Retry-After, app/memory.py); one run larger than it is refused before it runs (413 naming
    # run_store_disk_bytes). 0 = no disk tier (runs leaving RAM are dropped, as before). 8 GiB holds about twenty
    # 4,096-token smollm2-135m runs (~0.4 GB each).
    run_store_disk_bytes: int = Field(8 * 2**30, ge=0)
    # Where the disk tier's files go: a directory of this process's own is made inside it (None: the system's temp
    # directory) and removed when the process exits. A killed process leaves its attnlab-runs-* directory behind;
    # the next server to spill into the same place removes those whose process is gone.
    run_store_dir: str | None = None
    # The disk tier never takes the filesystem's free space below this: with less, runs leaving RAM are treated as
    # with the tier full (unpinned ones dropped, pinned ones kept in RAM) instead of failing every write on the disk.
    run_store_min_free_bytes: int = Field(2 * 2**30, ge=0)
    # Runs waiting for the disk tier's writer beside the one it writes. A request that makes room waits for a place in
    # this queue, never for a write; each queued run stays counted in RAM until written, so this bounds the overshoot.
    run_store_write_queue: int = Field(4, ge=1, le=64)



class HardeningSettings(BaseSettings):
    """HTTP: origins, hosts, body and header limits, slow clients, shutdown and timings."""

    # HTTP.
    cors_origins: list[str] = Field(default_factory=list)  # none: same origin only
    trusted_hosts: list[str] = Field(default_factory=lambda: ["*"])

    # ---- Hardening (issue 12): bodies, slow clients, shutdown, work budgets; app/lifecycle.py, app/serve.py.
    max_json_bytes: int = Field(1024 * 1024, ge=1024)  # a JSON body over this: 413 (before it is read when declared)
    body_timeout_s: float = Field(10.0, gt=0)  # the whole JSON body must arrive within this, else 408
    upload_timeout_s: float = Field(60.0, gt=0)  # the same for an image upload (up to max_upload_bytes)
    header_timeout_s: float = Field(10.0, gt=0)  # a connection whose request line + headers take longer is closed
    max_connections: int = Field(512, ge=8)  # open connections + requests (uvicorn's limit_concurrency); past it 503
    shutdown_grace_s: float = Field(5.0, ge=0)  # after SIGTERM, running requests get this long, then 503 + exit
    expose_timings: bool = False  # Server-Timing header and `elapsed_s`: they reveal cache hits (other clients' inputs)
    # image requests over this many tokens ((size/patch)² + prefix): 413. 4,097 = dinov2-small at 896 px, which runs
    # over full_map_tokens_image: one head's overview at a time on the image page, exact windows on zoom
    max_image_tokens: int = Field(4097, ge=2)
    max_image_aspect_ratio: float = Field(20.0, ge=1)  # uploads longer than this × their shorter side: 422



class CostSettings(BaseSettings):
    """Header sizes, whole streams, the cost estimate and the memory budget (app/costs.py, app/memory.py)."""

    # ---- Second probe (issue 19): header sizes, whole streams, request cost, memory, cache scope.
    max_header_bytes: int = Field(64 * 1024, ge=1024)  # request line + headers of one request; past it 431 (app/serve.py)
    max_header_line_bytes: int = Field(8 * 1024, ge=256)  # one header line or the request line; past it 431
    generate_timeout_s: float = Field(120.0, gt=0)  # a whole /api/text/generate stream; past it, an error event
    # The cost estimate (app/costs.py): a request whose model runs are estimated to need more than
    # request_timeout_s (a stream: generate_timeout_s) is refused with 413 before it starts. Each model's
    # throughput is measured from its own runs; this is the assumption until a model has run. 48 is about 2/3 of
    # what smollm2-135m's long first view reaches on the 2-core CI machine (4,096 tokens: 1.1e12 multiply-adds in
    # ~16 s), so a first long view (and its compare) is admitted before the model has timed runs of its own.
    compute_gmacs_per_s: float = Field(48.0, gt=0)
    # When the start-up timing forwards of the default text models run (Runtime.time_model; about 12 CPU-s of a
    # 29 CPU-s start on the 2-core machine): before /api/ready turns 200, or just after it (`make run`: the server is
    # ready sooner; until the runs end, a first request's estimate uses compute_gmacs_per_s and waits its turn).
    startup_timing: Literal["before_ready", "after_ready"] = "before_ready"
    # What the whole process may use (models + torch + in-flight runs + image decodes + caches): the result
    # and image caches are sized from it when result_cache_bytes/image_cache_bytes are None. deploy/k8s sets the
    # pod's memory limit ~15 % above it. memory_reserved_bytes: the models and torch's own working memory.
    memory_budget_bytes: int = Field(3584 * 2**20, ge=512 * 2**20)
    memory_reserved_bytes: int = Field(1536 * 2**20, ge=0)
    # "shared": one result cache for everyone (a repeated input is fast for every client, so response times show
    # what others asked); "client": cache entries are scoped to the client (cookie attnlab_client, or the header
    # X-Attnlab-Client), so no client can time another's inputs. See docs/deploy.md.
    result_cache_scope: Literal["shared", "client"] = "shared"


class Settings(ModelSettings, InputLimits, SpeechLimits, FleetSettings, JobSettings, RunStoreSettings,
               HardeningSettings, CostSettings):
    """Every setting, read from ATTNLAB_<NAME> (names and defaults are the mixins' fields)."""

    model_config = SettingsConfigDict(env_prefix="ATTNLAB_", env_file=None)

    @model_validator(mode="after")
    def _size_caches(self) -> "Settings":
        results, images = cache_budgets(self)
        if self.result_cache_bytes is None:
            self.result_cache_bytes = results
        if self.image_cache_bytes is None:
            self.image_cache_bytes = images
        return self


@lru_cache
def get_settings() -> Settings:
    return Settings()
