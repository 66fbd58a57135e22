"""k8s/: every kustomization renders, every object validates (the RayService against KubeRay's CRD
schema, core kinds against Kubernetes' own), the embedded Serve config is serve_config.yaml's and
deploys as Serve and Pagoda read it, its replicas fit the worker groups, the image's pins agree."""

import importlib
import importlib.util
import json
import re
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.specifiers import SpecifierSet
from ray.serve.schema import ServeDeploySchema

from cluster.serve.app import check_app_args
from cluster.serve.placement import app_demands, unplaced

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
CRD = Path(__file__).parent / "kuberay" / "ray.io_rayservices.yaml"  # KubeRay's, as in ../shared/kuberay/
KUBERNETES_VERSION = "1.33.0"  # the oldest Kubernetes these manifests promise to validate against
KUSTOMIZATIONS = ["base", "overlays/cpu-dev", "overlays/gpu", "overlays/gpu-disaggregated"]
OVERLAYS = KUSTOMIZATIONS[1:]


def load_render():
    spec = importlib.util.spec_from_file_location("k8s_render", K8S / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """`kubectl kustomize` of each kustomization: its objects."""
    out = {}
    for name in KUSTOMIZATIONS:
        result = subprocess.run(["kubectl", "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        out[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


def rayservice(objects: list[dict]) -> dict:
    [service] = [o for o in objects if o["kind"] == "RayService"]
    return service


def pod_templates(service: dict) -> dict[str, dict]:
    cluster = service["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]["template"],
            **{g["groupName"]: g["template"] for g in cluster.get("workerGroupSpecs", [])}}


def strict(schema):
    """The CRD's schema, refusing fields it does not name (as `kubectl apply` does with strict
    field validation), except where it says unknown fields are kept."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def rayservice_schema() -> jsonschema.protocols.Validator:
    """A validator of the CRD's schema, the schema checked once (jsonschema.validate checks it
    again on every call: ~2 s each for this one)."""
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml: 0.25 s, not 2
    [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(v1["schema"]["openAPIV3Schema"])
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


def test_the_generated_serve_configs_are_current():
    render = load_render()
    for directory in render.kustomization_dirs():
        generated = (directory / render.GENERATED).read_text()
        assert generated == render.generated_patch(directory), f"run: python k8s/render.py ({directory.name} is stale)"


def test_the_serve_config_is_serve_config_yaml_with_the_stated_patches_only(rendered):
    render = load_render()
    source = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    base = yaml.safe_load(rayservice(rendered["base"])["spec"]["serveConfigV2"])
    assert base == render.merge(source, yaml.safe_load((K8S / "base" / render.PATCH).read_text()))
    # what Kubernetes changes, and nothing else
    assert base["http_options"] == {**source["http_options"], "host": "0.0.0.0"}
    assert base["grpc_options"] == source["grpc_options"]
    assert {k: v for k, v in base["applications"][0].items() if k != "args"} == \
        {k: v for k, v in source["applications"][0].items() if k != "args"}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_validates(rendered, rayservice_schema, name):
    for obj in rendered[name]:
        if obj["kind"] == "RayService":
            rayservice_schema.validate(obj)
            for group, template in pod_templates(obj).items():  # the pods, as Kubernetes checks them
                pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group},
                                "template": template}
                kubernetes_validate.validate(pod_template, KUBERNETES_VERSION, strict=True)
        elif obj["apiVersion"].startswith("monitoring.coreos.com/"):
            assert obj["kind"] == "PodMonitor" and obj["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_a_typo_in_the_rayservice_is_caught(rendered, rayservice_schema):
    service = json.loads(json.dumps(rayservice(rendered["base"])))
    service["spec"]["rayClusterConfig"]["enableInTreeAutoScaling"] = True
    with pytest.raises(jsonschema.ValidationError, match="enableInTreeAutoScaling"):
        rayservice_schema.validate(service)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_serve_config_deploys_as_serve_and_pagoda_read_it(rendered, name, model_dir):
    service = rayservice(rendered[name])
    config = ServeDeploySchema.model_validate(yaml.safe_load(service["spec"]["serveConfigV2"]))
    for path in config.grpc_options.grpc_servicer_functions:
        module, _, attr = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), attr)), path
    [app] = config.applications
    module, _, attr = app.import_path.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    check_app_args({**app.args, "model": model_dir})  # every option, the engines and the autoscaling policy


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_replica_and_rank_fits_a_worker_group(rendered, name, model_dir):
    service = rayservice(rendered[name])
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    config, prefill, decode = check_app_args({**args, "model": model_dir})
    groups = {g["groupName"]: node_resources(g) for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    demands = app_demands(config, prefill, decode)
    engine = decode
    if engine.get("kv_cache_service_shards"):
        from cluster.serve.placement import Demand

        demands.append(Demand("a cache-service shard", ({**engine["kv_cache_service_resources"]},)))
    for demand in demands:
        fits = [group for group, node in groups.items() if not unplaced([demand], [node])]
        assert fits, f"{demand.what} {demand.bundles} fits no worker group of {name}: {groups}"


def node_resources(group: dict) -> dict[str, float]:
    """The Ray resources a worker group's pod declares: CPUs and GPUs from its container limits
    (as KubeRay passes them to `ray start`) and the custom ones from rayStartParams."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    cpu = str(limits["cpu"])
    resources = {"CPU": float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu),
                 "GPU": float(limits.get("nvidia.com/gpu", 0))}
    custom = group.get("rayStartParams", {}).get("resources")
    if custom:
        resources.update(json.loads(json.loads(custom)))
    return resources


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_cluster_is_autoscaled_authenticated_and_drains_before_it_is_killed(rendered, name):
    service = rayservice(rendered[name])
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["authOptions"] == {"mode": "token"}
    args = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]
    ingress_grace = args["drain_timeout_s"] + 10  # cluster/serve/app.py: the ingress waits 10 s longer
    for group, template in pod_templates(service).items():
        assert template["spec"]["terminationGracePeriodSeconds"] > ingress_grace + 30, group
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "pagoda"  # metrics and PodMonitor
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory", group
    ports = {p["name"]: p["port"] for p in service["spec"]["serveService"]["spec"]["ports"]}
    serve = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert ports == {"http": serve["http_options"]["port"], "grpc": serve["grpc_options"]["port"]}
    for group in cluster.get("workerGroupSpecs", []):
        probe = group["template"]["spec"]["containers"][0].get("readinessProbe")
        if probe:  # model-server groups: ready while grpc.health.v1 says SERVING
            assert probe["grpc"]["port"] == serve["grpc_options"]["port"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_pod_sets_serves_intervals_as_a_local_cluster_does(rendered, name):
    """Serve's timings that `pagoda serve` sets for a local cluster (autoscaling reports, the
    controller's loop, handle metrics): every pod of the RayService sets the same."""
    from cluster.serve.launcher import SERVE_ENV_DEFAULTS

    for group, template in pod_templates(rayservice(rendered[name])).items():
        env = {e["name"]: e.get("value") for e in template["spec"]["containers"][0].get("env", [])}
        assert {key: env.get(key) for key in SERVE_ENV_DEFAULTS} == SERVE_ENV_DEFAULTS, group


def test_the_image_pins_what_the_project_pins():
    dockerfile = (K8S / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
    pins = dict(re.findall(r"^([\w-]+)==([\w.]+)", (ROOT / "constraints.txt").read_text(), re.M))
    assert args["RAY_VERSION"] == pins["ray"] and args["DEEPSPEED_VERSION"] == pins["deepspeed"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [ray] = [d for d in project["dependencies"] if d.startswith("ray[serve]")]
    assert pins["ray"] in SpecifierSet(ray.removeprefix("ray[serve]"))
    assert re.search(r"FROM rayproject/ray:\$\{RAY_VERSION\}-\$\{VARIANT\}", dockerfile)
    python = re.search(r"py3(\d+)", args["VARIANT"]).group(1)
    assert f"3.{python}" in SpecifierSet(project["requires-python"])
    for path in ("cluster", "model", "cache_service", "protos"):  # the packages the image installs
        assert re.search(rf"^COPY .* {path} \./{path}$", dockerfile, re.M), path
