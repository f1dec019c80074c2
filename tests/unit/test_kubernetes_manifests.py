"""deploy/kubernetes/: valid Kubernetes and KEDA objects that keep the promises
docs/scaling.md ("Autoscaling") makes of them.

No cluster runs here, so the manifests are checked as data, as ``kubectl apply -k`` would
send them (each overlay's resources, its base included). Every built-in kind is
validated against Kubernetes' own OpenAPI schemas (kubernetes-validate, strict: an unknown
field fails), each ScaledObject against KEDA's CRD schema kept in deploy/kubernetes/schemas/,
made strict the same way. Each promise is then a check returning the problems it finds:
it passes on the shipped manifests, and fails on copies broken one way each (``BREAKS``),
so no check passes for want of looking. promtool runs the autoscalers' queries on two
workers' series: they read the database figure once (max, not sum), name their queue, and
give the worked example's replica count.
"""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_tools import prometheus_binary

import bridge.metrics
import bridge.transports
from bridge.config import Settings, load_settings
from bridge.errors import ConfigError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KEDA_SCHEMA = DEPLOY / "schemas" / "keda-scaledobject.json"
ADAPTER_RULES = DEPLOY / "hpa" / "prometheus-adapter-rules.yaml"
KUBERNETES = "1.37.0"  # the newest Kubernetes whose schemas kubernetes-validate 1.37 has
WARM_SHUTDOWN = 600  # s: compose's stop_grace_period, the systemd unit's TimeoutStopSec
SECRET = "phorge-bridge"
# The Secret's keys (base/kustomization.yaml creates it), and values of their shape to check
# the settings with.
SECRET_VALUES = {
    "BRIDGE_DATABASE_URL": "mysql+mysqldb://bridge:x@db.example/phabricator_worker",
    "BRIDGE_BROKER_URL": "amqp://bridge:x@rabbitmq.example//",
    "BRIDGE_CONDUIT_TOKEN": "api-" + "x" * 28,
}
DUE, DISPATCHED, OLDEST = (
    "phorge_bridge_queue_due_tasks",
    "phorge_bridge_queue_dispatched_tasks",
    "phorge_bridge_oldest_due_seconds",
)
SELECTOR = re.compile(r"(\w+)\{([^}]*)\}")  # a metric and its label matchers, in PromQL
PASSWORD_IN_URL = re.compile(r"://[^/@\s:]+:[^/@\s]+@")

Doc = dict[str, Any]
Manifests = dict[str, Any]  # "keda", "hpa": what each layout applies; "adapter": its rules


def load_docs(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomize(directory: Path) -> list[Doc]:
    """The objects ``kubectl apply -k directory`` applies."""
    docs = []
    for entry in load_docs(directory / "kustomization.yaml")[0]["resources"]:
        path = directory / entry
        docs += kustomize(path) if path.is_dir() else load_docs(path)
    return docs


def manifests() -> Manifests:
    return {
        "keda": kustomize(DEPLOY / "keda"),
        "hpa": kustomize(DEPLOY / "hpa"),
        "adapter": load_docs(ADAPTER_RULES)[0],
    }


def of_kind(docs: list[Doc], kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: Doc) -> Doc:
    [main] = deployment["spec"]["template"]["spec"]["containers"]
    return main


def option(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def workers(docs: list[Doc]) -> dict[str, Doc]:
    return {
        name: d
        for name, d in of_kind(docs, "Deployment").items()
        if container(d)["command"][:4] == ["celery", "-A", "bridge", "worker"]
    }


def queues(deployment: Doc) -> list[str]:
    return (option(container(deployment)["command"], "-Q") or "").split(",")


def env_of(deployment: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container(deployment).get("env", [])}


def layouts(m: Manifests) -> list[tuple[str, list[Doc]]]:
    return [(layout, m[layout]) for layout in ("keda", "hpa")]


def environment(deployment: Doc, docs: list[Doc]) -> dict[str, str]:
    """The container's BRIDGE_* environment as the kubelet composes it, secrets stood in."""
    env: dict[str, str] = {}
    maps = of_kind(docs, "ConfigMap")
    for source in container(deployment).get("envFrom", []):
        env |= maps[source["configMapRef"]["name"]]["data"] if "configMapRef" in source else {}
    for name, entry in env_of(deployment).items():
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        env[name] = SECRET_VALUES.get(ref["key"], "") if ref else entry["value"]
    return env


def settings(docs: list[Doc]) -> Settings:
    [maps] = of_kind(docs, "ConfigMap").values()
    return load_settings({**maps["data"], **SECRET_VALUES})


# -- the promises: each returns the problems it finds -------------------------------------


def check_workers_are_supervised(m: Manifests) -> list[str]:
    problems = []
    for layout, docs in layouts(m):
        for name, worker in workers(docs).items():
            where = f"{layout}: {name}"
            main, pod = container(worker), worker["spec"]["template"]["spec"]
            alive = option(main["command"], "--liveness-file")
            for probe in ("startupProbe", "livenessProbe"):
                command = main.get(probe, {}).get("exec", {}).get("command", [])
                if command[:2] != ["phorge-bridge", "health"] or "--max-age" not in command:
                    problems.append(f"{where}: its {probe} does not run phorge-bridge health")
                elif alive is None or option(command, "--liveness-file") != alive:
                    problems.append(f"{where}: its {probe} reads another file than {alive}")
            mounts = {v["mountPath"] for v in main.get("volumeMounts", [])}
            if main.get("securityContext", {}).get("readOnlyRootFilesystem") and (
                alive is None or str(Path(alive).parent) not in mounts
            ):
                problems.append(f"{where}: {alive} is on the read-only root filesystem")
            if pod.get("terminationGracePeriodSeconds", 30) < WARM_SHUTDOWN:
                problems.append(f"{where}: a warm shutdown gets less than {WARM_SHUTDOWN} s")
    return problems


def check_metrics_are_served_by_workers_only(m: Manifests) -> list[str]:
    problems = []
    for layout, docs in layouts(m):
        for name, d in of_kind(docs, "Deployment").items():
            where, env = f"{layout}: {name}", env_of(d)
            ports = {p["name"]: p["containerPort"] for p in container(d).get("ports", [])}
            annotations = d["spec"]["template"]["metadata"].get("annotations", {})
            if name not in workers(docs):
                if ports or {"BRIDGE_METRICS_PORT", "BRIDGE_METRICS_ADDRESS"} & env.keys():
                    problems.append(f"{where}: it is no worker, and listens")
                continue
            port = env.get("BRIDGE_METRICS_PORT", {}).get("value")
            if port is None or port != str(ports.get("metrics")):
                problems.append(f"{where}: BRIDGE_METRICS_PORT is not its metrics port")
            if annotations.get("prometheus.io/port") != port:
                problems.append(f"{where}: Prometheus is told another port than {port}")
            if env.get("BRIDGE_METRICS_ADDRESS", {}).get("value") != "0.0.0.0":
                problems.append(f"{where}: its metrics do not listen on the pod's address")
        for name, config in of_kind(docs, "ConfigMap").items():
            if any(key.startswith("BRIDGE_METRICS_") for key in config["data"]):
                problems.append(f"{layout}: ConfigMap {name} turns metrics on in every pod")
    return problems


def check_secrets_come_from_the_secret(m: Manifests) -> list[str]:
    problems = []
    for layout, docs in layouts(m):
        for d in docs:
            if d["kind"] == "Secret":
                problems.append(f"{layout}: a Secret is shipped: {d['metadata']['name']}")
            if PASSWORD_IN_URL.search(json.dumps(d)):
                problems.append(f"{layout}: {d['kind']} {d['metadata']['name']}: a password")
        for name, config in of_kind(docs, "ConfigMap").items():
            problems += [
                f"{layout}: ConfigMap {name} holds {key}"
                for key in config["data"]
                if key in SECRET_VALUES
            ]
        for name, d in of_kind(docs, "Deployment").items():
            env = env_of(d)
            for key in SECRET_VALUES:
                wanted = {"secretKeyRef": {"name": SECRET, "key": key}}
                if env.get(key, {}).get("valueFrom") != wanted:
                    problems.append(f"{layout}: {name}: {key} is not the Secret's")
            for source in container(d).get("envFrom", []):
                if source.keys() - {"configMapRef", "secretRef"}:
                    problems.append(f"{layout}: {name}: envFrom {source}")
    return problems


def check_settings_are_valid_and_every_queue_consumed(m: Manifests) -> list[str]:
    problems = []
    for layout, docs in layouts(m):
        for name, d in of_kind(docs, "Deployment").items():
            try:
                load_settings(environment(d, docs))
            except ConfigError as exc:
                problems.append(f"{layout}: {name}: {exc}")
        try:
            known = settings(docs)
        except ConfigError as exc:
            problems.append(f"{layout}: the ConfigMap: {exc}")
            continue
        wanted = {*known.router.queues, known.control_queue}
        consumed = {q: n for n, d in workers(docs).items() for q in queues(d)}
        problems += [f"{layout}: no worker consumes {q}" for q in wanted - consumed.keys()]
        problems += [
            f"{layout}: {consumed[q]}: {q} is no queue of the bridge"
            for q in consumed.keys() - wanted
        ]
    return problems


def check_beat_never_runs_zero(m: Manifests) -> list[str]:
    problems = []
    for layout, docs in layouts(m):
        beats = [
            d
            for d in of_kind(docs, "Deployment").values()
            if container(d)["command"][:4] == ["celery", "-A", "bridge", "beat"]
        ]
        if len(beats) != 1:
            problems.append(f"{layout}: {len(beats)} beat Deployments")
            continue
        [beat] = beats
        if beat["spec"].get("replicas") != 2:
            problems.append(f"{layout}: beat runs {beat['spec'].get('replicas', 1)}, not 2")
        strategy = beat["spec"].get("strategy", {})
        unavailable = strategy.get("rollingUpdate", {}).get("maxUnavailable", "25%")
        if strategy.get("type") != "RollingUpdate" or unavailable not in (0, "0%"):
            problems.append(f"{layout}: a rollout of beat may stop both")
    return problems


def check_the_control_worker_is_never_scaled(m: Manifests) -> list[str]:
    problems = []
    for layout, docs in layouts(m):
        control = settings(docs).control_queue
        scaled = {
            d["spec"]["scaleTargetRef"]["name"]
            for d in docs
            if d["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")
        }
        for name, d in workers(docs).items():
            if control in queues(d) and (name in scaled or d["spec"].get("replicas", 1) < 1):
                problems.append(f"{layout}: {name} consumes {control} and may stop")
    return problems


def queries(query: str) -> list[tuple[str, str, str]]:
    """Each selector of a PromQL query: (what stands before it, metric, label matchers)."""
    return [(query[: s.start()], s[1], s[2]) for s in SELECTOR.finditer(query)]


def metrics_sources() -> list[Path]:
    """Where the bridge declares its metrics: ``bridge.metrics`` and each transport's."""
    package = Path(bridge.metrics.__file__).parent
    transports = Path(bridge.transports.__file__).parent
    return sorted(package.glob("*.py")) + sorted(transports.glob("*/metrics.py"))


def query_problems(where: str, query: str, matchers: str) -> list[str]:
    problems = []
    exported = "".join(path.read_text() for path in metrics_sources())
    for before, metric, labels in queries(query):
        if not before.endswith("max("):
            problems.append(f"{where}: {metric} is not taken as max over workers")
        if labels != matchers:
            problems.append(f"{where}: {metric}{{{labels}}}, not {{{matchers}}}")
        if f'"{metric}"' not in exported:
            problems.append(f"{where}: the bridge exports no {metric}")
    return problems if queries(query) else [f"{where}: no metric in {query!r}"]


def scaler(docs: list[Doc], target: str) -> Doc | None:
    return next((d for d in docs if d["spec"]["scaleTargetRef"]["name"] == target), None)


def keda_triggers(scaled: Doc) -> dict[str, str]:
    """A ScaledObject's prometheus triggers: query -> threshold."""
    return {t["metadata"]["query"]: t["metadata"]["threshold"] for t in scaled["spec"]["triggers"]}


def check_each_queue_is_scaled_by_its_own_figures(m: Manifests) -> list[str]:
    problems = []
    docs = m["keda"]
    objects = list(of_kind(docs, "ScaledObject").values())
    control = settings(docs).control_queue
    for name, worker in workers(docs).items():
        if control not in queues(worker) and scaler(objects, name) is None:
            problems.append(f"keda: no ScaledObject scales {name}")
    for scaled in objects:
        where, spec = f"keda: ScaledObject {scaled['metadata']['name']}", scaled["spec"]
        target = workers(docs).get(spec["scaleTargetRef"]["name"])
        if target is None or spec["scaleTargetRef"].get("kind", "Deployment") != "Deployment":
            problems.append(f"{where}: scales no worker Deployment of the manifests")
            continue
        [queue] = queues(target)
        seen = set()
        for trigger in spec["triggers"]:
            query = trigger["metadata"]["query"]
            problems += query_problems(where, query, f'queue="{queue}"')
            seen |= {metric for _, metric, _ in queries(query)}
            if not float(trigger["metadata"]["threshold"]) > 0:
                problems.append(f"{where}: threshold {trigger['metadata']['threshold']}")
        if seen != {DUE, DISPATCHED, OLDEST}:
            problems.append(f"{where}: scales on {sorted(seen)}")
        grace = target["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        if spec.get("minReplicaCount", 0) == 0 and spec.get("cooldownPeriod", 300) <= grace:
            problems.append(f"{where}: scales to zero sooner than a warm shutdown ends")
    return problems


def check_the_hpas_read_what_keda_reads(m: Manifests) -> list[str]:
    problems = []
    rules = {r["name"]["as"]: r["metricsQuery"] for r in m["adapter"]["externalRules"]}
    for name, query in rules.items():
        problems += query_problems(f"adapter: {name}", query, "<<.LabelMatchers>>")
    objects = list(of_kind(m["keda"], "ScaledObject").values())
    for hpa in of_kind(m["hpa"], "HorizontalPodAutoscaler").values():
        where, spec = f"hpa: {hpa['metadata']['name']}", hpa["spec"]
        target = workers(m["hpa"]).get(spec["scaleTargetRef"]["name"])
        scaled = scaler(objects, spec["scaleTargetRef"]["name"])
        if target is None or scaled is None:
            problems.append(f"{where}: scales no worker that a ScaledObject scales")
            continue
        [queue] = queues(target)
        read = {}
        for metric in spec["metrics"]:
            external = metric["external"]
            if external["metric"].get("selector") != {"matchLabels": {"queue": queue}}:
                problems.append(f"{where}: {external['metric']['name']} not of queue {queue}")
            query = rules.get(external["metric"]["name"], "")
            read[query.replace("<<.LabelMatchers>>", f'queue="{queue}"')] = external["target"][
                "averageValue"
            ]
        if read != keda_triggers(scaled):
            problems.append(f"{where}: reads {read}, its ScaledObject {keda_triggers(scaled)}")
        if (spec["minReplicas"], spec["maxReplicas"]) != (
            max(1, scaled["spec"].get("minReplicaCount", 0)),
            scaled["spec"]["maxReplicaCount"],
        ):
            problems.append(f"{where}: its replica bounds are not its ScaledObject's")
    return problems


CHECKS = [
    check_workers_are_supervised,
    check_metrics_are_served_by_workers_only,
    check_secrets_come_from_the_secret,
    check_settings_are_valid_and_every_queue_consumed,
    check_beat_never_runs_zero,
    check_the_control_worker_is_never_scaled,
    check_each_queue_is_scaled_by_its_own_figures,
    check_the_hpas_read_what_keda_reads,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_the_manifests_keep_their_promise(check: Callable[[Manifests], list[str]]):
    assert check(manifests()) == []


# -- each check catches the break it guards against ----------------------------------------

DROP = object()


def put(m: Manifests, where: str, path: str, value: Any = DROP) -> None:
    """Set (or drop) the field at ``path`` (dotted, list indexes as numbers) of the object
    ``Kind/name``, of the KEDA layout unless it is an HPA."""
    kind, name = where.split("/")
    node: Any = of_kind(m["hpa" if kind == "HorizontalPodAutoscaler" else "keda"], kind)[name]
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    key: Any = int(last) if isinstance(node, list) else last
    if value is DROP:
        del node[key]
    else:
        node[key] = value


POD = "spec.template.spec"
MAIN = f"{POD}.containers.0"
SEARCH, PHORGE = "Deployment/phorge-bridge-search", "Deployment/phorge-bridge-phorge"
BEAT, CONTROL = "Deployment/phorge-bridge-beat", "Deployment/phorge-bridge-control"
CONFIG = "ConfigMap/phorge-bridge"
SO_SEARCH, SO_PHORGE = "ScaledObject/phorge-bridge-search", "ScaledObject/phorge-bridge-phorge"
HPA_SEARCH = "HorizontalPodAutoscaler/phorge-bridge-search"


def set_env(m: Manifests, where: str, name: str, value: str | None) -> None:
    main = container(of_kind(m["keda"], "Deployment")[where.split("/")[1]])
    main["env"] = [e for e in main["env"] if e["name"] != name]
    main["env"] += [{"name": name, "value": value}] if value is not None else []


def edit_query(m: Manifests, where: str, old: str, new: str) -> None:
    for trigger in of_kind(m["keda"], "ScaledObject")[where.split("/")[1]]["spec"]["triggers"]:
        trigger["metadata"]["query"] = trigger["metadata"]["query"].replace(old, new)


def adapter_sums(m: Manifests) -> None:
    rule = m["adapter"]["externalRules"][0]
    rule["metricsQuery"] = rule["metricsQuery"].replace("max(", "sum(")


Break = Callable[[Manifests], object]
BREAKS: dict[str, tuple[Callable[[Manifests], list[str]], Break]] = {
    "no liveness probe": (
        check_workers_are_supervised,
        lambda m: put(m, SEARCH, f"{MAIN}.livenessProbe"),
    ),
    "the probe reads another file": (
        check_workers_are_supervised,
        lambda m: put(m, PHORGE, f"{MAIN}.livenessProbe.exec.command.3", "/tmp/other"),
    ),
    "the liveness file on the read-only root": (
        check_workers_are_supervised,
        lambda m: put(m, CONTROL, f"{MAIN}.volumeMounts"),
    ),
    "no grace period for a warm shutdown": (
        check_workers_are_supervised,
        lambda m: put(m, SEARCH, f"{POD}.terminationGracePeriodSeconds"),
    ),
    "metrics on 127.0.0.1 only": (
        check_metrics_are_served_by_workers_only,
        lambda m: set_env(m, SEARCH, "BRIDGE_METRICS_ADDRESS", None),
    ),
    "beat listens": (
        check_metrics_are_served_by_workers_only,
        lambda m: set_env(m, BEAT, "BRIDGE_METRICS_PORT", "9808"),
    ),
    "metrics on in every pod": (
        check_metrics_are_served_by_workers_only,
        lambda m: put(m, CONFIG, "data.BRIDGE_METRICS_PORT", "9808"),
    ),
    "an inline password": (
        check_secrets_come_from_the_secret,
        lambda m: set_env(m, SEARCH, "BRIDGE_DATABASE_URL", "mysql://bridge:hunter2@db/x"),
    ),
    "a password in the ConfigMap": (
        check_secrets_come_from_the_secret,
        lambda m: put(m, CONFIG, "data.BRIDGE_BROKER_URL", "amqp://bridge:hunter2@mq//"),
    ),
    "a Secret shipped": (
        check_secrets_come_from_the_secret,
        lambda m: m["keda"].append(
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET}, "data": {}}
        ),
    ),
    "a secret missing from a pod": (
        check_secrets_come_from_the_secret,
        lambda m: set_env(m, BEAT, "BRIDGE_CONDUIT_TOKEN", None),
    ),
    "a malformed setting": (
        check_settings_are_valid_and_every_queue_consumed,
        lambda m: put(m, CONFIG, "data.BRIDGE_ROUTES", "PhabricatorSearchWorker"),
    ),
    "a misspelt setting": (
        check_settings_are_valid_and_every_queue_consumed,
        lambda m: set_env(m, SEARCH, "BRIDGE_METRIC_PORT", "9808"),
    ),
    "a routed queue without a worker": (
        check_settings_are_valid_and_every_queue_consumed,
        lambda m: put(m, CONFIG, "data.BRIDGE_ROUTES", "*Search*=search,*Mail*=mail"),
    ),
    "a worker on a queue nothing is routed to": (
        check_settings_are_valid_and_every_queue_consumed,
        lambda m: put(m, CONFIG, "data.BRIDGE_DEFAULT_QUEUE", "default"),
    ),
    "one beat": (
        check_beat_never_runs_zero,
        lambda m: put(m, BEAT, "spec.replicas", 1),
    ),
    "a beat rollout through zero": (
        check_beat_never_runs_zero,
        lambda m: put(m, BEAT, "spec.strategy.rollingUpdate.maxUnavailable", 1),
    ),
    "the control worker under KEDA": (
        check_the_control_worker_is_never_scaled,
        lambda m: put(m, SO_SEARCH, "spec.scaleTargetRef.name", "phorge-bridge-control"),
    ),
    "a sum over workers": (
        check_each_queue_is_scaled_by_its_own_figures,
        lambda m: edit_query(m, SO_SEARCH, "max(", "sum("),
    ),
    "another queue's figures": (
        check_each_queue_is_scaled_by_its_own_figures,
        lambda m: edit_query(m, SO_PHORGE, 'queue="phorge"', 'queue="search"'),
    ),
    "a misspelt metric": (
        check_each_queue_is_scaled_by_its_own_figures,
        lambda m: edit_query(m, SO_SEARCH, DISPATCHED, "phorge_bridge_queue_dispatched"),
    ),
    "the backlog without its dispatched tasks": (
        check_each_queue_is_scaled_by_its_own_figures,
        lambda m: edit_query(m, SO_SEARCH, DISPATCHED, DUE),
    ),
    "a target that does not exist": (
        check_each_queue_is_scaled_by_its_own_figures,
        lambda m: put(m, SO_SEARCH, "spec.scaleTargetRef.name", "phorge-bridge-serch"),
    ),
    "a queue without a ScaledObject": (
        check_each_queue_is_scaled_by_its_own_figures,
        lambda m: m["keda"].remove(of_kind(m["keda"], "ScaledObject")["phorge-bridge-phorge"]),
    ),
    "zero before a warm shutdown ends": (
        check_each_queue_is_scaled_by_its_own_figures,
        lambda m: put(m, SO_SEARCH, "spec.cooldownPeriod", 60),
    ),
    "an HPA out of step with KEDA": (
        check_the_hpas_read_what_keda_reads,
        lambda m: put(m, HPA_SEARCH, "spec.metrics.0.external.target.averageValue", "100"),
    ),
    "an HPA on another queue": (
        check_the_hpas_read_what_keda_reads,
        lambda m: put(
            m,
            HPA_SEARCH,
            "spec.metrics.1.external.metric.selector",
            {"matchLabels": {"queue": "phorge"}},
        ),
    ),
    "the adapter sums over workers": (check_the_hpas_read_what_keda_reads, adapter_sums),
}


@pytest.mark.parametrize("name", BREAKS)
def test_each_check_catches_what_it_guards_against(name: str):
    check, breaks = BREAKS[name]
    broken = copy.deepcopy(manifests())
    breaks(broken)
    assert check(broken), name


def test_every_check_has_a_break():
    assert {check for check, _ in BREAKS.values()} == set(CHECKS)


# -- the schemas -------------------------------------------------------------------------------


def built_in() -> list[Doc]:
    seen: dict[str, Doc] = {}
    for _, docs in layouts(manifests()):
        seen |= {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}
    return [d for d in seen.values() if d["kind"] != "ScaledObject"]


@pytest.mark.parametrize("doc", built_in(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_built_in_kind_is_valid_kubernetes(doc: Doc):
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_kubernetes_validate_refuses_an_unknown_field():
    doc = copy.deepcopy(of_kind(manifests()["keda"], "Deployment")["phorge-bridge-search"])
    container(doc)["livenessprobe"] = container(doc).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="livenessprobe"):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def strict(schema: Any) -> Any:
    """KEDA's schema as ``kubectl apply`` (strict field validation) holds objects to it: an
    unknown field fails rather than being pruned."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def keda_errors(doc: Doc) -> list[str]:
    schema = json.loads(KEDA_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(strict(schema))
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]


def test_the_keda_schema_is_kedas_crd_and_names_its_source():
    schema = json.loads(KEDA_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    source = schema["$comment"]
    assert "kedacore/keda" in source and "config/crd/bases/keda.sh_scaledobjects.yaml" in source
    assert re.search(r"\bcommit [0-9a-f]{40}\b", source) and "Apache License 2.0" in source
    assert schema["properties"]["spec"]["required"] == ["scaleTargetRef", "triggers"]


@pytest.mark.parametrize("name", sorted(of_kind(manifests()["keda"], "ScaledObject")))
def test_each_scaledobject_is_valid_by_kedas_schema(name: str):
    doc = of_kind(manifests()["keda"], "ScaledObject")[name]
    assert doc["apiVersion"] == "keda.sh/v1alpha1"
    assert keda_errors(doc) == []


def test_kedas_schema_refuses_an_unknown_field_and_a_number_for_a_string():
    doc = copy.deepcopy(of_kind(manifests()["keda"], "ScaledObject")["phorge-bridge-search"])
    doc["spec"]["cooldownPeriods"] = doc["spec"].pop("cooldownPeriod")
    doc["spec"]["triggers"][0]["metadata"]["threshold"] = 240  # trigger metadata is strings
    errors = keda_errors(doc)
    assert any("cooldownPeriods" in e for e in errors), errors
    assert any("240 is not of type 'string'" in e for e in errors), errors


# -- the queries, run -------------------------------------------------------------------------

# Two workers serving metrics, each exporting the same database figures: 10,000 search
# rows due, 2 dispatched, the oldest due for 300 s; nothing of the default queue yet.
SERIES = {DUE: 10_000, DISPATCHED: 2, OLDEST: 300}


def expected(query: str) -> float:
    """What a query should give on SERIES: one worker's figures, not their sum."""
    return sum(SERIES[m] for _, m, labels in queries(query) if 'queue="search"' in labels)


def test_the_queries_read_one_workers_figures_and_reach_the_maximum(tmp_path: Path):
    m = manifests()
    objects = of_kind(m["keda"], "ScaledObject").values()
    tested = {q: expected(q) for d in objects for q in keda_triggers(d)}
    for rule in m["adapter"]["externalRules"]:  # as the adapter sends them for queue=search
        query = rule["metricsQuery"].replace(
            "<<.LabelMatchers>>", 'queue="search",namespace="phorge"'
        )
        tested[query] = expected(query)
    series = [
        {
            "series": f'{metric}{{instance="{pod}:9808",namespace="phorge",queue="search"}}',
            "values": str(v),
        }
        for metric, v in SERIES.items()
        for pod in ("control-0", "search-0")
    ]
    test = {
        "rule_files": [],
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {"expr": q, "eval_time": "0m", "exp_samples": [{"labels": "{}", "value": v}]}
                    for q, v in tested.items()
                ],
            }
        ],
    }
    (tmp_path / "queries.test.yml").write_text(yaml.safe_dump(test))
    done = subprocess.run(
        [prometheus_binary("promtool"), "test", "rules", str(tmp_path / "queries.test.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The worked example (docs/scaling.md, "Autoscaling"): no search worker yet and
    # 10,000 due rows; replicas = ceil(value / threshold), the larger trigger's, capped.
    search = of_kind(m["keda"], "ScaledObject")["phorge-bridge-search"]
    asked = max(math.ceil(expected(q) / float(t)) for q, t in keda_triggers(search).items())
    assert asked > search["spec"]["maxReplicaCount"] > search["spec"]["minReplicaCount"] == 0


def test_every_file_is_applied_and_kustomize_can_build_each_layout():
    listed = {KEDA_SCHEMA, ADAPTER_RULES}
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        here = kustomization.parent
        listed.add(kustomization)
        for entry in load_docs(kustomization)[0]["resources"]:
            path = (here / entry).resolve()
            assert path.exists(), f"{kustomization}: {entry}"
            # kustomize: "cycle detected: candidate root ... contains visited root ..."
            assert not here.is_relative_to(path), f"{kustomization}: {entry} contains it"
            listed.add(path)
    for overlay in ("keda", "hpa"):  # each applies the workloads too
        assert "../base" in load_docs(DEPLOY / overlay / "kustomization.yaml")[0]["resources"]
    assert {p for p in DEPLOY.rglob("*") if p.is_file()} <= listed


def test_the_secret_command_creates_every_key_the_pods_need():
    text = (DEPLOY / "base" / "kustomization.yaml").read_text()
    assert f"kubectl create secret generic {SECRET}" in text
    assert all(f"--from-literal={key}=" in text for key in SECRET_VALUES)
