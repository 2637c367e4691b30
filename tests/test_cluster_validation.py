"""Cluster descriptions from a manager are checked before anything acts on them (host names, numbers, depth)."""

from __future__ import annotations

import json

import pytest

from hetero_plugins.cluster import check_host_name, parse_cluster, read_cluster


@pytest.mark.parametrize("host", ["node1", "n-3.cluster.local", "10.0.0.7", "gpu_node_2", "a" * 63])
def test_host_names_that_are_host_names_pass(host: str) -> None:
    assert check_host_name("h", host) == host


@pytest.mark.parametrize(
    "host", ["n3\nattacker.example:64\nx", "n3:4", "", " n1", "n1 n2", "-n", "n.", "a" * 64, 7, "x" * 254]
)
def test_anything_else_is_refused_with_the_field_named(host: object) -> None:
    spec = {"slots": [{"host": "n1", "device": "v100"}, {"host": host, "device": "t4"}]}
    with pytest.raises(ValueError, match=r"slots\[1\]\.host.*HINT"):
        parse_cluster(spec, world_size=1, hosts=["n1"])


def test_an_injected_discovery_line_never_reaches_a_place() -> None:
    spec = {"ranks": [{"device": "v100"}], "free_slots": [{"device": "v100", "host": "n3\nattacker.example:64\nx"}]}
    with pytest.raises(ValueError, match=r"free_slots\[0\]\.host"):
        parse_cluster(spec, world_size=1)


@pytest.mark.parametrize("text", ['{"ranks": [{"device": "v100", "data": NaN}]}',
                                  '{"ranks": [{"device": "v100", "data": Infinity}]}',
                                  '{"ranks": [{"device": "v100", "data": -Infinity}]}'])
def test_non_finite_numbers_are_refused(tmp_path, text: str) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="not valid JSON"):
        read_cluster(path, epoch=0, world_size=1)


def test_non_finite_data_from_a_callable_is_refused() -> None:
    with pytest.raises(ValueError, match=r"ranks\[0\]\.data.*finite"):
        parse_cluster({"ranks": [{"device": "v100", "data": float("nan")}]}, world_size=1)


def test_deeply_nested_json_is_a_clear_error(tmp_path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        read_cluster(path, epoch=0, world_size=1)


def test_a_valid_file_still_reads(tmp_path) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"ranks": [{"device": "v100", "data": 0.5, "host": "n1", "index": 0}]}))
    view = read_cluster(path, epoch=0, world_size=1)
    assert view.places[0] == {"device": "v100", "corunner": None, "data": 0.5, "host": "n1", "index": 0}


def test_a_free_slot_on_a_running_ranks_accelerator_is_refused() -> None:
    spec = {"ranks": [{"device": "v100", "host": "n1", "index": 0}, {"device": "t4", "host": "n1", "index": 1}],
            "free_slots": [{"device": "t4", "host": "n1", "index": 1}]}
    with pytest.raises(ValueError, match=r"free_slots\[0\].*ranks\[1\] already runs on host 'n1' index 1"):
        parse_cluster(spec, 2)
    twice = dict(spec, free_slots=[{"device": "a100", "host": "n2", "index": 0}] * 2)
    with pytest.raises(ValueError, match=r"free_slots\[1\].*free_slots\[0\]"):
        parse_cluster(twice, 2)


def test_co_located_ranks_and_distinct_slots_pass() -> None:
    spec = {"ranks": [{"device": "v100", "host": "n1", "index": 0}, {"device": "v100", "host": "n1", "index": 0}],
            "free_slots": [{"device": "v100", "host": "n1", "index": 1}, {"device": "v100", "host": "n2", "index": 0},
                           {"device": "v100", "host": "n1"}]}
    view = parse_cluster(spec, 2)
    assert [s.get("index") for s in view.free_slots] == [1, 0, None]
