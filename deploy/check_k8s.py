#!/usr/bin/python3
"""Checks that the Kubernetes manifests in deploy/k8s/ fit together, without a cluster.

Usage: check_k8s.py K8S_DIR DOCKERFILE MONITORING_DIR METRICS_SOURCE [GPU_OVERLAY_DIR [KUSTOMIZE_OUTPUT]]

Reads kustomization.yaml and every resource it lists (python3-yaml), then checks what `kubectl apply` would not:
names and labels that select the Deployment's pods, ports that resolve to a container port, the ConfigMap and
image the Deployment uses, flags that agree with the mounts and CPU limit, a grace period that covers the drain,
an HPA and a PDB that can work together, and the container port matching the image's EXPOSE. Then the monitoring
kustomization (MONITORING_DIR): the ServiceMonitor selects the metrics Service and names its port; the alert rules
cover errors, p99 latency, queue saturation and restarts; every metric the alerts, the Grafana dashboard, the
adapter rules and the HPA name is one the server exports (METRICS_SOURCE, server/metrics/metrics.cc) or kube-state-metrics'
restart counter. With GPU_OVERLAY_DIR (deploy/k8s-gpu): the overlay builds on K8S_DIR alone, its patches reach
the base's Deployment, container and HPA, the result passes every check above, and it runs the cuda image of the
base's version on one GPU (nvidia.com/gpu limit 1, RuntimeClass nvidia, the GPU taint tolerated, --backend auto);
with KUSTOMIZE_OUTPUT (`kubectl kustomize GPU_OVERLAY_DIR`), this check's rendering of the overlay must equal
kustomize's. Prints one line per problem and exits 1 when there is any.
"""
import copy
import json
import os
import re
import sys

import yaml

# Resident memory of mha_server beyond its layers and in-flight calls (code, libraries, gRPC, thread stacks, warm
# scratch): about 45 MiB measured idle, with room for allocator slack.
BASE_MEMORY_MIB = 256
# Seconds between the end of --shutdown_grace_s and the process's exit (stopping a computation, closing down).
EXIT_MARGIN_S = 5

problems = []


def check(condition, message):
    if not condition:
        problems.append(message)
    return condition


def selects(selector, labels):
    """True when every key of a label selector (matchLabels or a Service's selector) is set the same in labels."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def cpu_cores(quantity):
    quantity = str(quantity)
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def memory_bytes(quantity):
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(quantity))
    return float(match.group(1)) * units.get(match.group(2), 1)


def flag_values(args):
    """--name=value and --name value pairs; the last occurrence wins, as with absl flags."""
    values = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" in arg:
            name, value = arg[2:].split("=", 1)
            values[name] = value
        elif arg.startswith("--") and i + 1 < len(args) and not args[i + 1].startswith("--"):
            values[arg[2:]] = args[i + 1]
            i += 1
        i += 1
    return values


def load_resources(k8s_dir):
    """The kustomization and the documents of its resources; configMapGenerator files are not read."""
    with open(f"{k8s_dir}/kustomization.yaml") as f:
        kustomization = yaml.safe_load(f)
    check(kustomization.get("kind") == "Kustomization", "kustomization.yaml: kind is not Kustomization")
    resources = []
    for path in kustomization.get("resources", []):
        with open(f"{k8s_dir}/{path}") as f:
            for doc in yaml.safe_load_all(f):
                if doc is None:
                    continue
                for field in ("apiVersion", "kind"):
                    check(field in doc, f"{path}: a document has no {field}")
                check(doc.get("metadata", {}).get("name"), f"{path}: a {doc.get('kind')} has no metadata.name")
                resources.append(doc)
    keys = [(r.get("kind"), r.get("metadata", {}).get("name")) for r in resources]
    for key in set(keys):
        check(keys.count(key) == 1, f"{key[0]} {key[1]} is defined {keys.count(key)} times")
    return kustomization, resources


# Metrics other exporters provide that the rules and the dashboard may use.
EXTERNAL_METRICS = {"kube_pod_container_status_restarts_total"}


def exported_metrics(metrics_source):
    """Series names the server exports: each .Name("...") in server/metrics/metrics.cc, histograms with their suffixes."""
    with open(metrics_source) as f:
        text = f.read()
    names = set()
    for kind, name in re.findall(r'Build(Counter|Gauge|Histogram)\(\)\s*\.Name\("(\w+)"\)', text):
        names.add(name)
        if kind == "Histogram":
            names.update({name + "_bucket", name + "_sum", name + "_count"})
    return names


def metrics_in(expr):
    """The mha_* and kube_* series names a PromQL expression reads."""
    return set(re.findall(r"\b((?:mha|kube)_\w+)", expr))


def check_monitoring(monitoring_dir, k8s_resources, metrics_source):
    _, resources = load_resources(monitoring_dir)
    known = exported_metrics(metrics_source) | EXTERNAL_METRICS
    check("mha_queue_depth" in known, f"{metrics_source}: no mha_queue_depth (the HPA scales on it)")

    def used(expr, where):
        for metric in metrics_in(expr):
            check(metric in known, f"{where}: {metric} is not a metric the server exports")

    services = [r for r in k8s_resources if r["kind"] == "Service"]
    monitors = [r for r in resources if r["kind"] == "ServiceMonitor"]
    check(len(monitors) == 1, f"{monitoring_dir}: expected one ServiceMonitor, found {len(monitors)}")
    for monitor in monitors:
        selected = [s for s in services if selects(monitor["spec"]["selector"]["matchLabels"],
                                                   s["metadata"].get("labels", {}))]
        if check(len(selected) == 1, "ServiceMonitor: selects no Service (or several) of deploy/k8s"):
            port_names = {p.get("name") for p in selected[0]["spec"]["ports"]}
            for endpoint in monitor["spec"]["endpoints"]:
                check(endpoint.get("port") in port_names,
                      f"ServiceMonitor: port {endpoint.get('port')!r} is not a port of Service "
                      f"{selected[0]['metadata']['name']}")
    rules = [rule for r in resources if r["kind"] == "PrometheusRule" for g in r["spec"]["groups"]
             for rule in g["rules"]]
    exprs = " ".join(rule["expr"] for rule in rules)
    for what, pattern in (("the error rate", r'code=~"[^"]*INTERNAL'), ("p99 latency", r"histogram_quantile\(0\.99"),
                          ("queue saturation", r"mha_queue_depth"), ("restarts", r"restarts_total")):
        check(re.search(pattern, exprs), f"PrometheusRule: no alert on {what}")
    for rule in rules:
        used(rule["expr"], f"alert {rule.get('alert')}")
    with open(f"{monitoring_dir}/grafana-dashboard.json") as f:
        dashboard = json.load(f)
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    check(targets, "grafana-dashboard.json: no panel queries anything")
    for target in targets:
        used(target["expr"], f"dashboard query {target['refId']}")
    with open(f"{monitoring_dir}/prometheus-adapter-rules.yaml") as f:
        adapter = yaml.safe_load(f)
    adapted = {rule["name"]["as"] for rule in adapter["rules"]}
    for rule in adapter["rules"]:
        used(rule["seriesQuery"], "prometheus-adapter rule")
    for hpa in (r for r in k8s_resources if r["kind"] == "HorizontalPodAutoscaler"):
        for metric in hpa["spec"].get("metrics", []):
            if metric["type"] == "Pods":
                check(metric["pods"]["metric"]["name"] in adapted,
                      f"HorizontalPodAutoscaler: pods metric {metric['pods']['metric']['name']} has no adapter rule")
    print(f"check_k8s: {len(resources)} monitoring resources, {len(targets)} dashboard queries and "
          f"{len(rules)} alert rules checked")


def check_stack(kustomization, resources, dockerfile):
    """The Deployment, Services, HPA and PDB of one kustomization's resources, and the image they run."""

    def of_kind(kind):
        return [r for r in resources if r["kind"] == kind]

    deployments = of_kind("Deployment")
    if not check(len(deployments) == 1, f"expected one Deployment, found {len(deployments)}"):
        return
    deployment = deployments[0]
    name = deployment["metadata"]["name"]
    pod = deployment["spec"]["template"]
    pod_labels = pod["metadata"]["labels"]
    check(selects(deployment["spec"]["selector"]["matchLabels"], pod_labels),
          f"Deployment {name}: selector does not match its pod template labels")
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    check(set(containers) == {"mha-server", "envoy"},
          f"Deployment {name}: expected the containers mha-server and envoy (its front door), found {sorted(containers)}")
    container = containers.get("mha-server", pod["spec"]["containers"][0])
    ports = {p["containerPort"]: p.get("name") for c in containers.values() for p in c.get("ports", [])}
    port_names = {v: k for k, v in ports.items() if v}

    def resolve(port, where):
        """A port number or name as the container sees it; None (and a problem) when it names no container port."""
        number = port_names.get(port) if isinstance(port, str) else port
        check(number in ports, f"{where}: port {port!r} is not a container port of Deployment {name}")
        return number

    # Flags against ports, mounts and resources.
    flags = flag_values(container.get("args", []))
    listen_port = int(flags.get("listen", "0.0.0.0:50051").rsplit(":", 1)[1])
    check(flags.get("listen", "0.0.0.0:").startswith("127.0.0.1:"),
          f"Deployment {name}: --listen must bind the pod's loopback (127.0.0.1): the envoy container is the front door")
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    for path, volume in mounts.items():
        check(volume in volumes, f"Deployment {name}: volumeMount {path} names no volume {volume}")
    layers_dir = flags.get("layers_dir", "/layers")
    if check(layers_dir in mounts, f"Deployment {name}: --layers_dir {layers_dir} is not a mount"):
        config_map = volumes.get(mounts[layers_dir], {}).get("configMap", {}).get("name")
        check(config_map in {r["metadata"]["name"] for r in of_kind("ConfigMap")},
              f"Deployment {name}: the layers volume names no ConfigMap in the kustomization ({config_map})")
    resources_spec = container.get("resources", {})
    requests, limits = resources_spec.get("requests", {}), resources_spec.get("limits", {})
    for kind, parse in (("cpu", cpu_cores), ("memory", memory_bytes)):
        if check(kind in requests and kind in limits, f"Deployment {name}: {kind} request and limit must be set"):
            check(parse(requests[kind]) <= parse(limits[kind]), f"Deployment {name}: {kind} request over its limit")
    if "threads" in flags and "cpu" in limits:
        check(int(flags["threads"]) == int(cpu_cores(limits["cpu"])),
              f"Deployment {name}: --threads {flags['threads']} differs from the CPU limit {limits['cpu']}")

    # Probes: native gRPC on a container port.
    for probe in ("readinessProbe", "livenessProbe"):
        spec = container.get(probe)
        if check(spec and "grpc" in spec, f"Deployment {name}: {probe} must be a native grpc probe"):
            resolve(spec["grpc"]["port"], f"Deployment {name} {probe}")

    # Termination: preStop sleep plus the server's drain fit in the grace period.
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    command = pre_stop.get("exec", {}).get("command", [])
    pre_stop_s = pre_stop.get("sleep", {}).get("seconds", 0)
    if len(command) == 2 and command[0].endswith("sleep"):
        pre_stop_s = int(command[1])
    check(pre_stop, f"Deployment {name}: no preStop hook")
    grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
    if check("shutdown_grace_s" in flags, f"Deployment {name}: set --shutdown_grace_s so the drain fits the grace"):
        drain_s = float(flags["shutdown_grace_s"])
        check(grace >= pre_stop_s + drain_s + EXIT_MARGIN_S,
              f"Deployment {name}: terminationGracePeriodSeconds {grace} < preStop {pre_stop_s} s + "
              f"--shutdown_grace_s {drain_s:g} s + {EXIT_MARGIN_S} s to exit")

    # Memory: the limit covers what the server's own limits let it hold, the sessions' KV cache pool included.
    # --grpc_memory_mb bounds what gRPC buffers before any check (calls not yet admitted, from any client).
    budget = ("max_layer_mb", "max_inflight_mb", "kv_cache_mb", "grpc_memory_mb")
    if check(all(flag in flags for flag in budget),
             f"Deployment {name}: set --max_layer_mb, --max_inflight_mb, --kv_cache_mb and --grpc_memory_mb to fit "
             f"the memory limit"):
        need_mib = BASE_MEMORY_MIB + sum(int(flags[flag]) for flag in budget)
        if "memory" in limits:
            check(memory_bytes(limits["memory"]) >= need_mib << 20,
                  f"Deployment {name}: memory limit {limits['memory']} < {BASE_MEMORY_MIB} MiB base + " +
                  " + ".join(f"--{flag} {flags[flag]}" for flag in budget))

    # Identity: mutual TLS at the proxy (check_proxy) and tokens at the server, from Secrets; a writable in-memory
    # /tmp; health on its own plaintext port for the probes (which cannot speak TLS).
    if "envoy" in containers:
        config_maps = {r["metadata"]["name"]: r for r in of_kind("ConfigMap")}
        check_proxy(name, containers["envoy"], config_maps, volumes, listen_port, resolve)
    if check("auth_tokens_file" in flags, f"Deployment {name}: set --auth_tokens_file (docs/SECURITY.md)"):
        tokens = flags["auth_tokens_file"]
        mount = max((m for m in mounts if tokens.startswith(m + "/")), key=len, default=None)
        check(mount is not None and "secret" in volumes.get(mounts[mount], {}),
              f"Deployment {name}: --auth_tokens_file {tokens} is not in a Secret volume")
    if check("health_listen" in flags, f"Deployment {name}: set --health_listen for the kubelet's probes"):
        health_port = int(flags["health_listen"].rsplit(":", 1)[1])
        for probe in ("readinessProbe", "livenessProbe"):
            check(resolve(container.get(probe, {}).get("grpc", {}).get("port"), probe) == health_port,
                  f"Deployment {name}: {probe} must probe --health_listen's port {health_port}")
    check(container.get("readinessProbe", {}).get("grpc", {}).get("service") == "mha.v1.Attention",
          f"Deployment {name}: readinessProbe must ask for service mha.v1.Attention (fails when saturated)")
    check(not container.get("livenessProbe", {}).get("grpc", {}).get("service"),
          f"Deployment {name}: livenessProbe must ask for the whole server (service \"\": fails only when wedged)")
    if "ready_max_queue" in flags and "max_queue_size" in flags:
        check(0 < int(flags["ready_max_queue"]) <= int(flags["max_queue_size"]),
              f"Deployment {name}: --ready_max_queue must be in [1, --max_queue_size]")
    check("/tmp" in mounts and volumes.get(mounts["/tmp"], {}).get("emptyDir", {}).get("medium") == "Memory",
          f"Deployment {name}: mount an in-memory emptyDir on /tmp (private TLS copies, read-only root)")
    check(pod["spec"].get("automountServiceAccountToken") is False,
          f"Deployment {name}: set automountServiceAccountToken: false (the pods never call the API)")

    # Connections: closed after an age so that clients spread over new replicas (gRFC A9).
    check(float(flags.get("max_connection_age_s", "0")) > 0,
          f"Deployment {name}: set --max_connection_age_s so long-lived connections move to new replicas")

    # Services select the pods and target a container port; one of them is headless.
    services = of_kind("Service")
    for service in services:
        where = f"Service {service['metadata']['name']}"
        check(selects(service["spec"].get("selector"), pod_labels), f"{where}: selector does not match the pods")
        for port in service["spec"]["ports"]:
            resolve(port.get("targetPort", port["port"]), where)
    check(any(s["spec"].get("clusterIP") == "None" for s in services), "no headless Service (clusterIP: None)")
    check(any(s["spec"].get("type", "ClusterIP") == "ClusterIP" and s["spec"].get("clusterIP") != "None"
              for s in services), "no ClusterIP Service")

    # HPA scales this Deployment, on a resource whose request is set; the PDB leaves room to evict.
    hpas = of_kind("HorizontalPodAutoscaler")
    check(len(hpas) == 1, f"expected one HorizontalPodAutoscaler, found {len(hpas)}")
    for hpa in hpas:
        target = hpa["spec"]["scaleTargetRef"]
        check((target["kind"], target["name"], target["apiVersion"]) == ("Deployment", name, deployment["apiVersion"]),
              f"HorizontalPodAutoscaler {hpa['metadata']['name']}: scaleTargetRef is not Deployment {name}")
        check(1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"],
              "HorizontalPodAutoscaler: minReplicas must be in [1, maxReplicas]")
        for metric in hpa["spec"].get("metrics", []):
            if metric["type"] == "Resource":
                check(metric["resource"]["name"] in requests,
                      f"HorizontalPodAutoscaler: scales on {metric['resource']['name']} with no request set")
    pdbs = of_kind("PodDisruptionBudget")
    check(len(pdbs) == 1, f"expected one PodDisruptionBudget, found {len(pdbs)}")
    for pdb in pdbs:
        check(selects(pdb["spec"]["selector"]["matchLabels"], pod_labels), "PodDisruptionBudget: selects no pods")
        min_replicas = min((h["spec"].get("minReplicas", 1) for h in hpas), default=1)
        check(pdb["spec"].get("minAvailable", 0) < min_replicas,
              "PodDisruptionBudget: minAvailable >= the HPA's minReplicas would block every eviction")

    # The image the Deployment runs is the one kustomize rewrites, and it exposes the container port.
    image_name = container["image"].rsplit(":", 1)[0]
    check(any(image_name in (i["name"], i.get("newName")) for i in kustomization.get("images", [])),
          f"kustomization.yaml: images has no entry for {image_name}")
    with open(dockerfile) as f:
        exposed = {int(p.split("/")[0]) for line in f if line.startswith("EXPOSE") for p in line.split()[1:]}
    check(set(ports) <= exposed,
          f"container ports {sorted(ports)} are not all EXPOSEd by {dockerfile} {sorted(exposed)}")


def check_proxy(name, proxy, config_maps, volumes, server_port, resolve):
    """The envoy container in front of the server: its configuration (a ConfigMap of the kustomization, mounted
    where its -c points) listens on the grpc container port, terminates mutual TLS with files from a Secret, forwards
    to the server's loopback port, and holds what gRPC 1.51 cannot: rapid-reset detection, a connection limit, a
    stream limit and a headers timeout (docs/SECURITY.md)."""
    where = f"Deployment {name}: container envoy"
    resources_spec = proxy.get("resources", {})
    for kind in ("cpu", "memory"):
        check(kind in resources_spec.get("requests", {}) and kind in resources_spec.get("limits", {}),
              f"{where}: {kind} request and limit must be set")
    mounts = {m["mountPath"]: m["name"] for m in proxy.get("volumeMounts", [])}

    def mounted(path):
        mount = max((m for m in mounts if path.startswith(m + "/")), key=len, default=None)
        return volumes.get(mounts[mount], {}) if mount is not None else {}

    args = proxy.get("args", [])
    if not check("-c" in args[:-1], f"{where}: no -c CONFIG among its args"):
        return
    path = args[args.index("-c") + 1]
    config_map = config_maps.get(mounted(path).get("configMap", {}).get("name"), {})
    text = config_map.get("data", {}).get(os.path.basename(path))
    if not check(text is not None, f"{where}: {path} is no key of a ConfigMap of the kustomization"):
        return
    config = yaml.safe_load(text)
    listeners = config.get("static_resources", {}).get("listeners", [])
    if not check(len(listeners) == 1, f"{where}: expected one listener"):
        return
    listener = listeners[0]
    check(listener["address"]["socket_address"]["port_value"] == resolve("grpc", where),
          f"{where}: the listener is not on the grpc container port")
    chain = listener["filter_chains"][0]
    tls = chain.get("transport_socket", {}).get("typed_config", {})
    check(tls.get("require_client_certificate") is True, f"{where}: the listener must require client certificates")
    context = tls.get("common_tls_context", {})
    files = [c[key]["filename"] for c in context.get("tls_certificates", []) for key in ("certificate_chain", "private_key")]
    files.append(context.get("validation_context", {}).get("trusted_ca", {}).get("filename", ""))
    for file in files:
        check("secret" in mounted(file), f"{where}: TLS file {file!r} is not in a Secret volume")
    filters = {f["name"]: f.get("typed_config", {}) for f in chain.get("filters", [])}
    check("envoy.filters.network.connection_limit" in filters, f"{where}: no connection_limit filter")
    manager = filters.get("envoy.filters.network.http_connection_manager", {})
    check(manager.get("http2_protocol_options", {}).get("max_concurrent_streams"),
          f"{where}: set http2_protocol_options.max_concurrent_streams")
    check(manager.get("request_headers_timeout"), f"{where}: set request_headers_timeout")
    runtime = {k: v for layer in config.get("layered_runtime", {}).get("layers", [])
               for k, v in layer.get("static_layer", {}).get("overload", {}).items()}
    check("premature_reset_total_stream_count" in runtime,
          f"{where}: set the runtime overload.premature_reset_total_stream_count (HTTP/2 rapid reset)")
    upstreams = [e["endpoint"]["address"]["socket_address"]
                 for c in config.get("static_resources", {}).get("clusters", [])
                 for group in c.get("load_assignment", {}).get("endpoints", []) for e in group.get("lb_endpoints", [])]
    check(upstreams == [{"address": "127.0.0.1", "port_value": server_port}],
          f"{where}: must forward to the server's --listen, 127.0.0.1:{server_port}, alone (found {upstreams})")


def load_overlay(overlay_dir, base_dir, base_kustomization, base_resources):
    """An overlay's kustomization and the base's resources as it changes them, for what this project's overlays
    use: `images` (newName/newTag), strategic-merge patches (maps merged, containers matched by name, args, command
    and tolerations replaced) and JSON patches (test, add, replace, remove). The overlay must build on base_dir
    alone. A strategic merge into any other list of the base is reported, not guessed at: kustomize merges some
    lists by keys this check does not know (topologySpreadConstraints by key and whenUnsatisfiable)."""
    with open(f"{overlay_dir}/kustomization.yaml") as f:
        overlay = yaml.safe_load(f)
    where = f"{overlay_dir}/kustomization.yaml"
    check(overlay.get("kind") == "Kustomization", f"{where}: kind is not Kustomization")
    bases = [os.path.realpath(os.path.join(overlay_dir, r)) for r in overlay.get("resources", [])]
    check(bases == [os.path.realpath(base_dir)], f"{where}: resources must be the base {base_dir} alone")
    resources = copy.deepcopy(base_resources)

    images = {i["name"]: dict(i) for i in base_kustomization.get("images", [])}
    for image in overlay.get("images", []):
        if check(image["name"] in images, f"{where}: images names {image['name']}, which the base does not set"):
            images[image["name"]].update(image)
    for resource in resources:
        for container in resource.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            name = container["image"].rsplit(":", 1)[0]
            if name in images:
                image = images[name]
                container["image"] = f"{image.get('newName', name)}:{image.get('newTag', 'latest')}"

    def target(kind, name, what):
        matches = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
        check(len(matches) == 1, f"{where}: {what} targets {kind} {name}, which the base does not define once")
        return matches[0] if len(matches) == 1 else None

    for patch in overlay.get("patches", []):
        if "path" in patch:
            with open(f"{overlay_dir}/{patch['path']}") as f:
                doc = yaml.safe_load(f)
            resource = target(doc["kind"], doc["metadata"]["name"], patch["path"])
            if resource is not None:
                strategic_merge(resource, doc, f"{overlay_dir}/{patch['path']}")
        else:
            what = f"the JSON patch of {patch['target']['kind']} {patch['target']['name']}"
            resource = target(patch["target"]["kind"], patch["target"]["name"], what)
            if resource is not None:
                json_patch(resource, yaml.safe_load(patch["patch"]), f"{where}: {what}")
    overlay_kustomization = dict(base_kustomization, images=list(images.values()))
    return overlay, overlay_kustomization, resources


# How a strategic merge treats the lists the overlays patch (the Kubernetes API's patch strategies): containers are
# merged by name; args, command and tolerations are replaced whole.
MERGE_KEYS = {"containers": "name"}
REPLACED_LISTS = {"args", "command", "tolerations"}


def strategic_merge(base, patch, where):
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            strategic_merge(base[key], value, where)
        elif isinstance(value, list) and key in base and key not in REPLACED_LISTS:
            merge_key = MERGE_KEYS.get(key)
            if not check(merge_key, f"{where}: merges into the base's list {key}; use a JSON patch"):
                continue
            for item in value:
                matches = [b for b in base[key] if b.get(merge_key) == item.get(merge_key)]
                if check(matches, f"{where}: the base has no {key} entry with {merge_key} {item.get(merge_key)!r}"):
                    strategic_merge(matches[0], item, where)
        else:
            base[key] = copy.deepcopy(value)


def json_patch(doc, operations, where):
    """RFC 6902 test, add, replace and remove on doc, in place."""
    for operation in operations:
        op, path = operation["op"], operation["path"]
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
        try:
            node = doc
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            key = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
            if op == "test":
                check(node[key] == operation["value"], f"{where}: test {path} failed: it is {node[key]!r}")
            elif op == "replace":
                node[key]  # must exist
                node[key] = copy.deepcopy(operation["value"])
            elif op == "add" and isinstance(node, list):
                node.insert(key, copy.deepcopy(operation["value"]))
            elif op == "add":
                node[key] = copy.deepcopy(operation["value"])
            elif op == "remove":
                del node[key]
            else:
                check(False, f"{where}: unsupported JSON patch op {op}")
        except (KeyError, IndexError, ValueError, TypeError):
            check(False, f"{where}: {op} {path}: no such path in the base")


def check_gpu_overlay(overlay, base_kustomization, resources):
    """What makes the GPU overlay one: the cuda image of the base's version, one GPU per pod, the NVIDIA runtime
    class, the GPU taint tolerated, --backend left at auto, and a node spread that lets replicas share a GPU node."""
    base_tags = {i["name"]: i.get("newTag") for i in base_kustomization.get("images", [])}
    for image in overlay.get("images", []):
        if image["name"] in base_tags:
            check(image.get("newTag") == f"{base_tags[image['name']]}-cuda",
                  f"images: {image['name']} must be tagged {base_tags[image['name']]}-cuda (the cuda variant "
                  f"deploy/container-test.sh builds), not {image.get('newTag')}")
    deployments = [r for r in resources if r["kind"] == "Deployment"]
    if not deployments:
        return
    pod = deployments[0]["spec"]["template"]["spec"]
    name = deployments[0]["metadata"]["name"]
    check(pod.get("runtimeClassName") == "nvidia", f"Deployment {name}: runtimeClassName must be nvidia")
    check(any(t.get("key") == "nvidia.com/gpu" and t.get("effect") == "NoSchedule"
              and (t.get("operator") == "Exists" or "value" in t) for t in pod.get("tolerations", [])),
          f"Deployment {name}: no toleration for the nvidia.com/gpu:NoSchedule taint")
    for constraint in pod.get("topologySpreadConstraints", []):
        check(constraint["topologyKey"] != "kubernetes.io/hostname"
              or constraint["whenUnsatisfiable"] != "DoNotSchedule",
              f"Deployment {name}: a DoNotSchedule spread across nodes counts CPU nodes too and leaves replicas "
              f"Pending on a multi-GPU node")
    for container in pod["containers"]:
        if container["name"] != "mha-server":
            continue  # the envoy front door needs no GPU
        resources_spec = container.get("resources", {})
        limits, requests = resources_spec.get("limits", {}), resources_spec.get("requests", {})
        check(str(limits.get("nvidia.com/gpu")) == "1",
              f"Deployment {name}: container {container['name']} must limit nvidia.com/gpu to 1")
        check(str(requests.get("nvidia.com/gpu", limits.get("nvidia.com/gpu"))) == str(limits.get("nvidia.com/gpu")),
              f"Deployment {name}: container {container['name']}: nvidia.com/gpu request differs from its limit")
        backend = flag_values(container.get("args", [])).get("backend", "auto")
        check(backend == "auto", f"Deployment {name}: --backend={backend}; leave it auto (CUDA when available)")


def compare_with_kustomize(resources, kustomize_output):
    """The overlay as this check renders it against `kubectl kustomize`'s rendering of it."""
    with open(kustomize_output) as f:
        rendered = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(f) if d}
    ours = {(r["kind"], r["metadata"]["name"]): r for r in resources}
    check(set(rendered) == set(ours), f"kubectl kustomize renders {sorted(rendered)}, this check {sorted(ours)}")
    for key in set(rendered) & set(ours):
        check(rendered[key] == ours[key], f"{key[0]} {key[1]}: kubectl kustomize renders it differently")


def main(k8s_dir, dockerfile, monitoring_dir, metrics_source, gpu_overlay_dir=None, kustomize_output=None):
    kustomization, resources = load_resources(k8s_dir)
    check_stack(kustomization, resources, dockerfile)
    check_monitoring(monitoring_dir, resources, metrics_source)
    print(f"check_k8s: {len(resources)} resources from {k8s_dir}/kustomization.yaml checked, "
          f"{len(problems)} problem(s)")
    if gpu_overlay_dir is None:
        return
    before = len(problems)
    overlay, overlay_kustomization, overlay_resources = load_overlay(gpu_overlay_dir, k8s_dir, kustomization,
                                                                    resources)
    check_stack(overlay_kustomization, overlay_resources, dockerfile)
    check_gpu_overlay(overlay, kustomization, overlay_resources)
    if kustomize_output:
        compare_with_kustomize(overlay_resources, kustomize_output)
    problems[before:] = [f"{gpu_overlay_dir}: {p}" for p in problems[before:]]
    print(f"check_k8s: {gpu_overlay_dir} over {k8s_dir} checked"
          f"{' against kubectl kustomize' if kustomize_output else ''}, {len(problems) - before} problem(s)")


if __name__ == "__main__":
    if not 5 <= len(sys.argv) <= 7:
        sys.exit(__doc__)
    try:
        main(*sys.argv[1:])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, StopIteration) as error:
        problems.append(f"cannot read the manifests: {error!r}")
    for problem in problems:
        print(f"check_k8s: {problem}")
    sys.exit(1 if problems else 0)
