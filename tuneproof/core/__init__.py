"""The job-side core: what Ray jobs (training/, eval/) import, and nothing else.

Config, storage, stage results and summaries, and the pure checks over facts jobs collect. It is
shipped as part of every job's working_dir with training/ and eval/, so it imports only what the
published Ray Train image has (pydantic, yaml, fsspec/s3fs, pyarrow, torch, transformers) and never
Prefect, the Ray job client or anything under tuneproof.control / tuneproof.app.
"""
