"""What the launcher tells an operator before anything starts."""

from __future__ import annotations

import os

from cluster.config import parse_config
from cluster.launcher import Launcher


def test_a_pool_asking_for_resources_no_node_offers_is_named(capsys):
    config = parse_config({"decode": {"resources": {"num_gpus": 1, "resources": {"node_b": 2}}}})
    Launcher(config)._warn_missing_resources({"CPU": 4.0, "node_b": 1.0})
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["[tandem] warning: decode workers wait for resources no Ray node offers now: "
                     "GPU=1 (the cluster has 0), node_b=2 (the cluster has 1)"]
    Launcher(parse_config({}))._warn_missing_resources({"CPU": 2.0})
    assert capsys.readouterr().err == ""


def test_a_local_cluster_has_cpus_for_every_pool_at_its_bounds():
    # at max_replicas: 4 prefill workers of 1 CPU + 4 decode workers of 2
    assert Launcher(parse_config({})).local_num_cpus() == max(os.cpu_count() or 1, 4 + 8)
    wide = parse_config({"decode": {"max_replicas": 30, "resources": {"num_cpus": 0.5}}})
    assert Launcher(wide).local_num_cpus() == max(os.cpu_count() or 1, 4 + 15)
    assert Launcher(parse_config({"ray": {"num_cpus": 3}})).local_num_cpus() == 3  # said explicitly: kept
