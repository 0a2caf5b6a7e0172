"""Reading the linted files: objects, their kinds and subjects, the offline schemas, and the accessors every
check shares (a group's pod spec, its containers, a template's variable defaults).

- schema: core kinds against Kubernetes v1.34's schemas and RayCluster against the KubeRay CRD's
  openAPIV3Schema, both vendored in tuneproof/schemas/ and strict (unknown fields are errors, as
  with `kubectl apply --validate=strict`); a kind with no offline schema is a warning. A RayCluster's
  list-type map (or set) holding a key twice is an error too: the API server refuses it for a custom
  resource, and JSON Schema has no word for it (built-in kinds only warn, so theirs are not checked).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import jsonschema
import yaml

from tuneproof.control.kube_checks import worker_groups
from tuneproof.core.files import MAX_MANIFEST_BYTES, parse_yaml_all, read_regular
from tuneproof.core.findings import Finding

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"
KUBERNETES_SCHEMA = SCHEMA_DIR / "kubernetes-v1.34.json"
RAYCLUSTER_SCHEMA = SCHEMA_DIR / "raycluster-v1.json"
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json", ".sh")
FILE_KINDS = ("IAMPolicy", "ShellScript", "Requirements")
"""Files that are not Kubernetes objects but decide what the cluster gets: an IAM policy document, a shell
script's commands (deployments/eks-up.sh), a pip requirements file (the flow-run image's)."""
PLACEHOLDER_VARIABLE = re.compile(r"^\{\{\s*[\w.]+\s*\}\}$")


@dataclass(frozen=True)
class Doc:
    """One object read from a file: a Kubernetes object or a Prefect base job template."""

    file: str
    obj: dict

    @property
    def kind(self) -> str:
        if is_job_template(self.obj):
            return "PrefectBaseJobTemplate"
        if is_iam_policy(self.obj):
            return "IAMPolicy"
        return "PrefectProject" if is_prefect_project(self.obj) else self.obj.get("kind", "")

    @property
    def metadata(self) -> dict:
        meta = self.obj.get("metadata")
        return meta if isinstance(meta, dict) else {}  # a malformed one is the schema check's to report

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", "?"))

    @property
    def namespace(self) -> str | None:
        return self.metadata.get("namespace")

    @property
    def subject(self) -> str:
        if self.kind.startswith("Prefect"):
            return f"{self.file}: " + ("Prefect base job template" if is_job_template(self.obj) else "Prefect project")
        if self.kind in FILE_KINDS:
            return f"{self.file}: {self.kind}"
        return f"{self.file}: {self.kind}/{self.name}"


def load_documents(paths: list[str]) -> tuple[list[Doc], list[Finding]]:
    docs, findings = [], []
    for file in manifest_files(paths):
        try:
            objects = _parse(file)
        except UnicodeDecodeError as e:  # a ValueError too: named before the general case below
            findings.append(Finding(str(file), "content", f"not UTF-8 (byte {e.start})", "UTF-8 YAML or JSON"))
            continue
        except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: bad JSON, an int over 4,300 digits
            findings.append(Finding(str(file), "content", "unparseable", "YAML or JSON", str(e).splitlines()[0]))
            continue
        except OSError as e:
            findings.append(Finding(str(file), "file", f"unreadable: {e.strerror or e}", "a readable file"))
            continue
        for obj in objects:
            if isinstance(obj, dict) and str(obj.get("kind", "")).endswith("List") and "items" in obj:
                # _parse expands every well-formed List: one left over has items that are not a list.
                findings.append(
                    Finding(str(file), "items", type(obj["items"]).__name__, "a list of Kubernetes objects")
                )
                continue
            typed = (
                isinstance(obj, dict) and isinstance(obj.get("kind"), str) and isinstance(obj.get("apiVersion"), str)
            )
            known = is_job_template(obj) or is_prefect_project(obj) or is_iam_policy(obj) or typed
            if not isinstance(obj, dict) or not known:
                findings.append(
                    Finding(
                        str(file),
                        "document",
                        type(obj).__name__,
                        "a Kubernetes object (apiVersion, kind), a Prefect base job template or a Prefect project file",
                    )
                )
                continue
            docs.append(Doc(str(file), obj))
    return docs, findings


def manifest_files(paths: list[str]) -> list[Path]:
    files = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if is_linted(p) and p.is_file())
            if not found:
                # A mistyped or empty folder would otherwise lint nothing and print "ok".
                raise FileNotFoundError(
                    f"lint: no manifests in folder {raw} (files ending {', '.join(MANIFEST_SUFFIXES)}, "
                    "or requirements*.txt)"
                )
            files += found
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"lint: no such file or folder: {raw}")
    return files


def is_linted(path: Path) -> bool:
    return path.suffix in MANIFEST_SUFFIXES or (path.name.startswith("requirements") and path.suffix == ".txt")


def _parse(file: Path) -> list:
    text = read_regular(file, MAX_MANIFEST_BYTES).decode("utf-8")
    if file.suffix == ".sh":
        return [{"kind": "ShellScript", "apiVersion": "", "commands": shell_commands(text)}]
    if file.suffix == ".txt":
        return [{"kind": "Requirements", "apiVersion": "", "pins": requirement_pins(text)}]
    raw = [json.loads(text)] if file.suffix == ".json" else [d for d in parse_yaml_all(text) if d is not None]
    objects: list = []
    for obj in raw:
        kind = obj.get("kind") if isinstance(obj, dict) else None
        is_list = isinstance(kind, str) and kind.endswith("List") and isinstance(obj.get("items"), list)
        objects += obj["items"] if is_list else [obj]
    return objects


def is_job_template(obj: dict) -> bool:
    return isinstance(obj, dict) and "job_configuration" in obj and "variables" in obj


def is_prefect_project(obj: dict) -> bool:
    """prefect.yaml: a deployments list and no Kubernetes kind."""
    return isinstance(obj, dict) and isinstance(obj.get("deployments"), list) and "kind" not in obj


def is_iam_policy(obj: dict) -> bool:
    """An IAM policy document: a Version and a list of Statements."""
    return isinstance(obj, dict) and isinstance(obj.get("Statement"), list) and "Version" in obj and "kind" not in obj


def shell_commands(text: str) -> list[dict]:
    """Every simple command of a shell script: {line, argv}, the argv as written (variables unexpanded).

    Enough for the scripts in deployments/: continuation lines are joined, `$(...)`, pipes, `&&`, `||`, `;` and
    `if`/`!`/`then` split or drop, and a line shlex cannot read (a heredoc body) is skipped."""
    commands = []
    logical = re.sub(r"\\\n\s*", " ", text).splitlines()
    for number, line in enumerate(logical, 1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        argv: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "|", "&&", "||", "then", "do", "else", "{", "}") or word.endswith(")"):
                if word.endswith(")") and word not in (";", "|", "&&", "||"):
                    argv.append(word.rstrip(")"))
                if argv:
                    commands.append({"line": number, "argv": argv})
                argv = []
            elif "$(" in word:
                if argv:
                    commands.append({"line": number, "argv": argv})
                argv = [word.split("$(", 1)[1]] if word.split("$(", 1)[1] else []
            elif not argv and word in ("if", "!", "while", "until", "local", "elif"):
                continue
            else:
                argv.append(word)
    return commands


def requirement_pins(text: str) -> dict[str, str]:
    """{distribution (lower case): version} of every `name==version` line."""
    pins = {}
    for line in text.splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[re.split(r"[\[;]", name)[0].strip().lower()] = version.split(";")[0].strip()
    return pins


def schema_findings(doc: Doc) -> list[Finding]:
    if doc.kind.startswith("Prefect") or doc.kind in FILE_KINDS:
        return []  # a base job template is validated as the Job it renders, in job_template_findings
    if str(doc.obj.get("apiVersion", "")).startswith("eksctl.io/"):
        return []  # `eksctl create cluster --dry-run -f` validates it; lint checks the fields it reads (eks.py)
    validator = schema_validator(doc.obj.get("apiVersion", ""), doc.kind)
    if validator is None:
        return [
            Finding(
                doc.subject,
                "apiVersion/kind",
                f"{doc.obj.get('apiVersion')}/{doc.kind}",
                "a kind with an offline schema",
                "not schema-checked",
                "warning",
            )
        ]
    findings = [
        schema_finding(doc.subject, e) for e in sorted(validator.iter_errors(doc.obj), key=lambda e: list(e.path))
    ]
    if doc.kind == "RayCluster":
        findings += list_key_findings(doc.subject, doc.obj, _raycluster_schema())
    return findings


def list_key_findings(subject: str, value, schema: dict, path: tuple = ()) -> list[Finding]:
    """Entries of a list-type map whose x-kubernetes-list-map-keys repeat an earlier entry's (a key the entry
    omits counts as its schema default, as the API server defaults it first), and repeated entries of a
    list-type set: a CRD's API server refuses both ("Duplicate value")."""
    if isinstance(value, dict):
        properties, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        return [
            finding
            for key, sub in value.items()
            if isinstance(sub_schema := properties.get(key, extra), dict)
            for finding in list_key_findings(subject, sub, sub_schema, (*path, key))
        ]
    if not isinstance(value, list):
        return []
    findings = _repeated_entries(subject, value, schema, path)
    items = schema.get("items")
    if isinstance(items, dict):
        findings += [f for i, item in enumerate(value) for f in list_key_findings(subject, item, items, (*path, i))]
    return findings


def _repeated_entries(subject: str, entries: list, schema: dict, path: tuple) -> list[Finding]:
    list_type, keys = schema.get("x-kubernetes-list-type"), schema.get("x-kubernetes-list-map-keys") or []
    if list_type not in ("map", "set"):
        return []
    defaults = {k: s.get("default") for k, s in ((schema.get("items") or {}).get("properties") or {}).items()}
    seen: set[str] = set()
    findings = []
    for i, entry in enumerate(entries):
        key = (
            {k: entry.get(k, defaults.get(k)) for k in keys}
            if list_type == "map" and isinstance(entry, dict)
            else entry
        )
        text = json.dumps(key, sort_keys=True)
        if text in seen:
            findings.append(
                Finding(
                    subject,
                    dotted((*path, i)),
                    key,
                    f"entries with unique {', '.join(keys)}" if list_type == "map" else "unique entries",
                    f"x-kubernetes-list-type {list_type}: the API server refuses a repeated "
                    + ("key" if list_type == "map" else "entry")
                    + " (Duplicate value), so the cluster never gets this object",
                )
            )
        seen.add(text)
    return findings


@cache
def schema_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    if api_version == "ray.io/v1" and kind == "RayCluster":
        return jsonschema.Draft202012Validator(_raycluster_schema())
    bundle = _kubernetes_bundle()
    key = f"{api_version}/{kind}"
    if key not in bundle["$defs"]:
        return None
    pointer = key.replace("~", "~0").replace("/", "~1")
    return jsonschema.Draft202012Validator({**bundle, "$ref": f"#/$defs/{pointer}"})


@lru_cache(maxsize=1)
def _kubernetes_bundle() -> dict:
    return json.loads(KUBERNETES_SCHEMA.read_text())


@lru_cache(maxsize=1)
def _raycluster_schema() -> dict:
    return json.loads(RAYCLUSTER_SCHEMA.read_text())


def schema_finding(subject: str, error: jsonschema.ValidationError) -> Finding:
    seen = error.instance if not isinstance(error.instance, (dict, list)) else type(error.instance).__name__
    expected = f"{error.validator}: {json.dumps(error.validator_value)[:120]}"
    return Finding(subject, dotted(error.absolute_path) or "<root>", seen, expected, error.message[:300])


def dotted(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def ray_groups(raycluster: dict) -> list[tuple[str, dict]]:
    """(field prefix, group spec) for the head group and every worker group."""
    head = (raycluster.get("spec") or {}).get("headGroupSpec") or {}
    return [
        ("spec.headGroupSpec", head),
        *((f"spec.workerGroupSpecs[{g.get('groupName')}]", g) for g in worker_groups(raycluster)),
    ]


def group_pod_spec(group: dict) -> dict:
    return (group.get("template") or {}).get("spec") or {}


def all_containers(pod_spec: dict) -> list[dict]:
    return [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]


def env_values(container: dict) -> dict:
    return {e.get("name"): e.get("value") for e in container.get("env") or []}


def volume_named(pod_spec: dict, name: str | None) -> dict:
    return next((v for v in pod_spec.get("volumes") or [] if v.get("name") == name), {})


def volume_kind(volume: dict) -> str:
    return next((k for k in volume if k != "name"), "unknown")


def template_defaults(doc: Doc) -> dict:
    """The base job template's variable defaults: what a deployment gets for what it does not set."""
    return {k: v.get("default") for k, v in ((doc.obj.get("variables") or {}).get("properties") or {}).items()}


def drop_placeholders(node):
    """The template with every whole-value '{{ var }}' removed: what is fixed whatever the variables are."""
    if isinstance(node, dict):
        return {
            k: drop_placeholders(v)
            for k, v in node.items()
            if not (isinstance(v, str) and PLACEHOLDER_VARIABLE.match(v))
        }
    if isinstance(node, list):
        return [drop_placeholders(x) for x in node if not (isinstance(x, str) and PLACEHOLDER_VARIABLE.match(x))]
    return node


def unique(findings: list[Finding]) -> list[Finding]:
    return list(dict.fromkeys(findings))


def pinned_value(schema: dict):
    return schema["const"] if "const" in schema else (schema.get("enum") or [None])[0]


def as_list(value) -> list:
    """A JSON field that may hold one value or a list of them (IAM's Action and Resource), as a list."""
    return value if isinstance(value, list) else [value]
