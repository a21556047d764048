"""The partitioner every service's producer uses chooses what aiokafka's default partitioner
chooses (Kafka's murmur2 of the key): other platforms key their records the Java way, and a
job's events must land on one partition whichever producer wrote them."""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as reference
from hypothesis import given
from hypothesis import strategies as st

from services.common.partitioner import KeyPartitioner, murmur2, partition_of


@given(st.binary(max_size=600))
def test_the_hash_is_kafkas_murmur2(data: bytes) -> None:
    assert murmur2(data) == reference(data)


# The Java client's own values (Kafka's UtilsTest), as signed 32-bit integers.
JAVA = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


def test_the_java_clients_values() -> None:
    for key, signed in JAVA.items():
        assert murmur2(key) == signed & 0xFFFFFFFF, key


@given(st.binary(min_size=0, max_size=80), st.integers(min_value=1, max_value=64))
def test_the_partition_is_the_default_partitioners(key: bytes, count: int) -> None:
    partitions = list(range(count))
    expected = DefaultPartitioner()(key, partitions, partitions)
    assert KeyPartitioner()(key, partitions, partitions) == expected
    assert partition_of(key, partitions) == expected


def test_a_topic_of_one_partition_takes_every_key() -> None:
    assert partition_of(b"anything", [7]) == 7
    assert KeyPartitioner()(b"", [0], []) == 0


def test_an_unkeyed_record_goes_to_an_available_partition() -> None:
    chooser = KeyPartitioner()
    assert {chooser(None, [0, 1, 2, 3], [2]) for _ in range(50)} == {2}
    assert {chooser(None, [0, 1], []) for _ in range(200)} == {0, 1}
