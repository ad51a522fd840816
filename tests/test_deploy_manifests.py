"""deploy/: the fleet's Kubernetes manifests, rendered with ``kubectl kustomize`` and validated
offline against the Kubernetes schema (kubernetes-validate, which ships the schemas; installed
by scripts/setup.sh). Each kv-transfer-config they hold passes kvhal's own checks."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="the manifests' schema check needs kubernetes-validate (scripts/setup.sh)"
)
from kubernetes_validate.utils import SchemaNotFoundError  # noqa: E402

from kvhal.vllm.extra_config import check_extra_config  # noqa: E402

DEPLOY = Path(__file__).parents[1] / "deploy"
KUBECTL = shutil.which("kubectl")
#: The Kubernetes version validated against: the newest whose schemas kubernetes-validate ships.
VERSION = kubernetes_validate.utils.latest_version()
#: Kinds of operators' CRDs, which the Kubernetes schema does not hold.
CRD_KINDS = {"ServiceMonitor"}
TARGETS = ["base", "overlays/redis", "overlays/mooncake"]

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="rendering the manifests needs kubectl")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """deploy/ with the fleet's secret file the docs say to make (never committed)."""
    root = tmp_path_factory.mktemp("deploy") / "deploy"
    shutil.copytree(DEPLOY, root)
    (root / "base" / "fleet-secret.txt").write_text("0123456789abcdef0123456789abcdef\n")
    return root


def render(root: Path, target: str) -> list[dict]:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(root / target)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_the_manifests_render_and_match_the_kubernetes_schema(tree, target):
    docs = render(tree, target)
    kinds = {doc["kind"] for doc in docs}
    assert {"StatefulSet", "Service", "ConfigMap", "Secret"} <= kinds
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            with pytest.raises(SchemaNotFoundError):  # not skipped by mistake: the schema lacks it
                validate(doc)
            continue
        validate(doc)


def test_the_schema_check_fails_a_wrong_manifest(tree):
    """The negative control: a field of the wrong type, and an unknown field, are refused."""
    engine = next(d for d in render(tree, "base") if d["kind"] == "StatefulSet")
    validate(engine)
    wrong = json.loads(json.dumps(engine))
    wrong["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(wrong)
    unknown = json.loads(json.dumps(engine))
    unknown["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(unknown)


def engine_of(docs: list[dict]) -> tuple[dict, dict]:
    """The engines' pod spec and their kv-transfer-config."""
    engine = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "vllm-kvhal")
    config = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("kvhal-config")
    )
    return engine["spec"]["template"]["spec"], json.loads(config["data"]["kv-transfer-config.json"])


@pytest.mark.parametrize("target", TARGETS)
def test_the_engines_survive_an_upgrade(tree, target):
    """What docs/deploy.md promises: kvhal's configuration passes its checks, the host tier can be
    pinned, and a replacement waits for the disk tier's lock longer than the old engine drains."""
    pod, transfer = engine_of(render(tree, target))
    settings = check_extra_config(transfer["kv_connector_extra_config"])
    assert transfer["kv_load_failure_policy"] == "recompute" and transfer["kv_role"] == "kv_both"
    container = pod["containers"][0]
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    extra = transfer["kv_connector_extra_config"]
    assert extra["disk_lock_wait_s"] > pod["terminationGracePeriodSeconds"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert extra["disk_path"] in mounts
    secret_env = {e["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert "KVHAL_REMOTE_SECRET" in secret_env
    stores = [t for t in settings.tiers if hasattr(t, "url")]
    assert len(stores) == (0 if target == "base" else 1)
    if target == "overlays/redis":
        assert stores[0].url.startswith("rediss://"), "the fleet's store is reached over TLS"
