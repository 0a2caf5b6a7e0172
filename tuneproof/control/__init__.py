"""The control plane's library: what the Prefect side needs beyond the job-side core.

The run record, the model registry, Kubernetes reads and checks, code identity, resume evidence,
run diffs. No Prefect here either: tasks/ and flows/ wrap these, and the app (CLI) reads them.
Imports point down only: control -> core.
"""
