#!/usr/bin/env bash
# From an empty AWS account to a first `eks-manual` run: deployments/README.md's walkthrough as one
# ordered script. Run it from the project root, after `make setup`:
#
#     PREFECT_API_URL=https://prefect.example.com/api PREFECT_API_AUTH_STRING='admin:...' deployments/eks-up.sh
#
# Idempotent: every step asks whether what it makes is there before making it, so a run that stopped
# halfway is finished by running it again. It needs aws, eksctl, kubectl, helm, crane and docker (with
# buildx) on PATH, and the project's .venv. Your values are the variables below; the manifests carry the
# same defaults (account 123456789012, us-west-2, bucket tuneproof-artifacts), which `render` replaces
# on the way to the cluster, so the files in deployments/ stay the ones `tuneproof lint` checked.
# tests/test_eks_up.py runs it against stub commands and asserts the order of their calls.
set -euo pipefail

# ---- your values -----------------------------------------------------------------------------------
AWS_REGION="${AWS_REGION:-us-west-2}"
ACCOUNT_ID="${ACCOUNT_ID:-123456789012}"
CLUSTER="${CLUSTER:-tuneproof}"                  # metadata.name in cluster.yaml
NAMESPACE="${NAMESPACE:-tuneproof}"
BUCKET="${BUCKET:-tuneproof-artifacts}"           # configs/eks.yaml storage.root is s3://$BUCKET/pipeline
GPU_ZONE="${GPU_ZONE:-us-west-2a}"                # cluster.yaml's GPU groups' zone: FSx goes in the same one
FLOW_RUN_REPOSITORY="${FLOW_RUN_REPOSITORY:-tuneproof-flow-run}"
KUBERAY_VERSION="${KUBERAY_VERSION:-1.7.0}"
VENV="${VENV:-.venv}"                             # the project's venv: its prefect and tuneproof commands
TUNEPROOF_GIT_URL="${TUNEPROOF_GIT_URL:-}"        # reachable from the flow-run pods; empty: no deploy (step 9)
# The Prefect server's API and its basic-auth string (the server's PREFECT_SERVER_API_AUTH_STRING):
# exported before the first `prefect` command, so no command falls back to prefect.toml's 127.0.0.1 or
# to an unauthenticated request.
: "${PREFECT_API_URL:?set PREFECT_API_URL to your Prefect server API, e.g. https://prefect.example.com/api}"
: "${PREFECT_API_AUTH_STRING:?set PREFECT_API_AUTH_STRING to the Prefect server auth string (user:password)}"
export PREFECT_API_URL PREFECT_API_AUTH_STRING AWS_REGION
# ------------------------------------------------------------------------------------------------------

DEPLOY=deployments
PREFECT="$VENV/bin/prefect"
TUNEPROOF="$VENV/bin/tuneproof"
FSX_SUBNET=""
FSX_SG=""

log() { printf '\n== %s\n' "$*"; }

# A manifest with this run's values in place of the committed defaults and placeholders.
render() {
  sed -e "s/123456789012/$ACCOUNT_ID/g" \
      -e "s/us-west-2a/$GPU_ZONE/g" \
      -e "s/us-west-2/$AWS_REGION/g" \
      -e "s/tuneproof-artifacts/$BUCKET/g" \
      -e "s/subnet-0123456789abcdef0/${FSX_SUBNET:-subnet-0123456789abcdef0}/g" \
      -e "s/sg-0123456789abcdef0/${FSX_SG:-sg-0123456789abcdef0}/g" \
      "$1"
}

apply() { render "$1" | kubectl apply -f -; }

# A Secret from literal values, created or brought up to date (never printed).
secret() {
  local name=$1
  shift
  kubectl -n "$NAMESPACE" create secret generic "$name" "$@" --dry-run=client -o yaml | kubectl apply -f -
}

step1_cluster() {
  log "1. the cluster, its add-ons (the FSx driver with its pod identity) and node groups"
  if ! eksctl get cluster --name "$CLUSTER" --region "$AWS_REGION" >/dev/null 2>&1; then
    render "$DEPLOY/cluster.yaml" >"$WORK/cluster.yaml"
    eksctl create cluster -f "$WORK/cluster.yaml"
  fi
  aws eks update-kubeconfig --name "$CLUSTER" --region "$AWS_REGION"
}

step2_device_plugins() {
  log "2. device plugins: eksctl installed both (NVIDIA for the GPU type, EFA for efaEnabled); check they run"
  kubectl get nodes -l eks.amazonaws.com/nodegroup=gpu \
    -o custom-columns='NAME:.metadata.name,GPU:.status.allocatable.nvidia\.com/gpu,EFA:.status.allocatable.vpc\.amazonaws\.com/efa'
}

step3_kuberay() {
  log "3. the KubeRay operator $KUBERAY_VERSION"
  helm repo add kuberay https://ray-project.github.io/kuberay-helm/ --force-update
  helm upgrade --install kuberay-operator kuberay/kuberay-operator -n kuberay-system --create-namespace \
    --version "$KUBERAY_VERSION" --wait
}

step4_storage() {
  log "4. the bucket, the task data, FSx's subnet and security group"
  if ! aws s3api head-bucket --bucket "$BUCKET" >/dev/null 2>&1; then
    aws s3 mb "s3://$BUCKET" --region "$AWS_REGION"
  fi
  aws s3 cp data/dates/dates.jsonl "s3://$BUCKET/sources/dates/dates.jsonl"
  local vpc nodes
  vpc=$(aws eks describe-cluster --name "$CLUSTER" --query cluster.resourcesVpcConfig.vpcId --output text)
  nodes=$(aws eks describe-cluster --name "$CLUSTER" --query cluster.resourcesVpcConfig.clusterSecurityGroupId --output text)
  FSX_SUBNET=$(aws ec2 describe-subnets --filters "Name=vpc-id,Values=$vpc" "Name=availability-zone,Values=$GPU_ZONE" \
    "Name=tag:kubernetes.io/role/internal-elb,Values=1" --query 'Subnets[0].SubnetId' --output text)
  FSX_SG=$(aws ec2 describe-security-groups --filters "Name=vpc-id,Values=$vpc" "Name=group-name,Values=tuneproof-fsx" \
    --query 'SecurityGroups[0].GroupId' --output text)
  if [ "$FSX_SG" = None ]; then
    FSX_SG=$(aws ec2 create-security-group --group-name tuneproof-fsx --vpc-id "$vpc" \
      --description "FSx for Lustre: 988 and 1018-1023 from itself and the nodes" --query GroupId --output text)
    # Lustre's servers and clients talk to each other on both ranges: FSx refuses a group that admits
    # only the nodes (it must admit itself too).
    aws ec2 authorize-security-group-ingress --group-id "$FSX_SG" --protocol tcp --port 988 --source-group "$FSX_SG"
    aws ec2 authorize-security-group-ingress --group-id "$FSX_SG" --protocol tcp --port 1018-1023 --source-group "$FSX_SG"
    aws ec2 authorize-security-group-ingress --group-id "$FSX_SG" --protocol tcp --port 988 --source-group "$nodes"
    aws ec2 authorize-security-group-ingress --group-id "$FSX_SG" --protocol tcp --port 1018-1023 --source-group "$nodes"
  fi
}

step5_identities() {
  log "5. IAM: the bucket policies and the four roles that use the bucket (IRSA)"
  ensure_policy tuneproof-s3 s3-policy.json
  ensure_policy tuneproof-canary-s3 s3-canary-policy.json
  local triple
  # account:role:policy. A candidate image runs as tuneproof-canary-ray: its policy writes the canary prefix only.
  for triple in tuneproof-ray:tuneproof-ray-s3:tuneproof-s3 tuneproof-pipeline:tuneproof-pipeline-s3:tuneproof-s3 \
    tuneproof-canary:tuneproof-canary-s3:tuneproof-s3 tuneproof-canary-ray:tuneproof-canary-ray-s3:tuneproof-canary-s3; do
    local account="${triple%%:*}" rest="${triple#*:}"
    if aws iam get-role --role-name "${rest%%:*}" >/dev/null 2>&1; then continue; fi
    # role only: the service accounts themselves are in storage.yaml, rbac.yaml and canary.yaml
    eksctl create iamserviceaccount --cluster "$CLUSTER" --region "$AWS_REGION" --namespace "$NAMESPACE" \
      --name "$account" --role-name "${rest%%:*}" --attach-policy-arn "arn:aws:iam::$ACCOUNT_ID:policy/${rest##*:}" \
      --role-only --approve
  done
}

# ensure_policy NAME FILE: the IAM policy from deployments/FILE (the bucket's name rendered in), once.
ensure_policy() {
  if aws iam get-policy --policy-arn "arn:aws:iam::$ACCOUNT_ID:policy/$1" >/dev/null 2>&1; then return; fi
  render "$DEPLOY/$2" >"$WORK/$2"
  aws iam create-policy --policy-name "$1" --policy-document "file://$WORK/$2"
}

step6_images() {
  log "6. the flow-run image, built for the nodes' architecture (linux/amd64) whatever builds it"
  local registry="$ACCOUNT_ID.dkr.ecr.$AWS_REGION.amazonaws.com"
  if ! aws ecr describe-repositories --repository-names "$FLOW_RUN_REPOSITORY" >/dev/null 2>&1; then
    aws ecr create-repository --repository-name "$FLOW_RUN_REPOSITORY"
  fi
  aws ecr get-login-password --region "$AWS_REGION" | docker login --username AWS --password-stdin "$registry"
  local base image
  base=$(crane digest --platform linux/amd64 python:3.11-slim-bookworm)
  image="$registry/$FLOW_RUN_REPOSITORY:$(git rev-parse --short HEAD)"
  docker buildx build --platform linux/amd64 -f "$DEPLOY/flow-run-image/Dockerfile" \
    --build-arg "PYTHON_IMAGE=python:3.11-slim-bookworm@$base" -t "$image" --push .
  echo "flow-run image: $image@$(crane digest "$image")  (prefect.yaml, both job templates, flow-run-admission.yaml)"
}

step7_cluster_objects() {
  log "7. namespace, Ray tokens (standing and canary), storage, RBAC, NetworkPolicy, the RayCluster"
  "$TUNEPROOF" lint "$DEPLOY/"
  apply "$DEPLOY/namespace.yaml"
  local token
  # Two tokens, each its own random value: the canary's clusters and flow runs (kube_canary.py,
  # prefect-k8s-canary-job-template.json) never hold the standing cluster's. Never rotated by a rerun.
  for token in tuneproof-ray-auth tuneproof-canary-ray-auth; do
    if ! kubectl -n "$NAMESPACE" get secret "$token" >/dev/null 2>&1; then
      secret "$token" --from-literal=auth_token="$(openssl rand -hex 32)"
    fi
  done
  apply "$DEPLOY/storage.yaml"
  apply "$DEPLOY/rbac.yaml"
  apply "$DEPLOY/networkpolicy.yaml"            # before the RayCluster: its pods are never reachable from elsewhere
  apply "$DEPLOY/raycluster.yaml"
  kubectl -n "$NAMESPACE" wait raycluster/tuneproof --for=jsonpath='{.status.state}'=ready --timeout=30m
  # The Ray and torch the image really carries, in a pod the restricted namespace admits.
  local ray_image
  ray_image=$(kubectl -n "$NAMESPACE" get raycluster tuneproof -o jsonpath='{.spec.headGroupSpec.template.spec.containers[0].image}')
  kubectl -n "$NAMESPACE" run ray-version --rm -i --restart=Never --image="$ray_image" --overrides="$(version_pod)" \
    -- python -c 'import ray, torch; print(ray.__version__, torch.__version__)'
}

# The version check's pod: non-root, no privilege, RuntimeDefault seccomp (the namespace refuses anything else).
version_pod() {
  cat <<'EOF'
{"spec": {"nodeSelector": {"eks.amazonaws.com/nodegroup": "system"},
  "securityContext": {"runAsNonRoot": true, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
  "containers": [{"name": "ray-version", "env": [{"name": "HOME", "value": "/tmp"}],
    "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}]}}
EOF
}

step8_workers() {
  log "8. the Prefect API credential, the work pools, then the workers that poll them"
  secret prefect-api-auth --from-literal=auth-string="$PREFECT_API_AUTH_STRING"
  pool tuneproof-eks "$DEPLOY/prefect-k8s-base-job-template.json"
  pool tuneproof-eks-canary "$DEPLOY/prefect-k8s-canary-job-template.json"
  apply "$DEPLOY/flow-run-admission.yaml"       # cluster-scoped: needs a cluster admin
  apply "$DEPLOY/prefect-worker.yaml"
  apply "$DEPLOY/canary.yaml"
}

# A Kubernetes work pool with this base job template: created, or updated to it.
pool() {
  if "$PREFECT" work-pool inspect "$1" >/dev/null 2>&1; then
    "$PREFECT" work-pool update "$1" --base-job-template "$2"
  else
    "$PREFECT" work-pool create "$1" --type kubernetes --base-job-template "$2"
  fi
}

step9_deploy() {
  log "9. deploy at this commit and start the first run"
  if [ -z "$TUNEPROOF_GIT_URL" ]; then
    echo "TUNEPROOF_GIT_URL is unset: not deploying (the flow-run pods clone the project from it)"
    return
  fi
  TUNEPROOF_GIT_COMMIT=$(git rev-parse HEAD)   # pushed: the pods clone exactly this commit
  export TUNEPROOF_GIT_URL TUNEPROOF_GIT_COMMIT
  "$PREFECT" --no-prompt deploy --name eks-manual --name eks-nightly
  "$PREFECT" deployment run 'tuneproof-pipeline/eks-manual'
}

main() {
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  step1_cluster
  step2_device_plugins
  step3_kuberay
  step4_storage
  step5_identities
  step6_images
  step7_cluster_objects
  step8_workers
  step9_deploy
}

main "$@"
