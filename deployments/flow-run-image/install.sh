#!/bin/sh
# Install the flow-run image's Python packages into the Python first on PATH.
#
#   sh deployments/flow-run-image/install.sh
#
# The Dockerfile runs this into /opt/venv; tests/test_flow_run_env.py runs the same file into a
# fresh venv, so the environment the test imports the flow in is built by these exact commands.
# --no-deps: requirements.txt is the complete set with exact pins, nothing is resolved here.
set -eu
here=$(dirname "$0")
python -m pip install --quiet --no-deps -r "$here/requirements.txt"
python -m pip check
