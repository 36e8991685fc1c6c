"""The watchers' own store (moe_hang.runtime.coord.relay): named in the job's store as
``host:port``, reached by the others, ended with its watcher."""

from __future__ import annotations

import pytest

from moe_hang.runtime.coord.relay import Relay, local_address, open_relay, parse_spec

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("raw, want", [(b"127.0.0.1:29500", ("127.0.0.1", 29500)),
                                       (b"::1:29500", ("::1", 29500)),
                                       (b"node7:0", None), (b"node7:", None),
                                       (b":29500", None), (b"node7:http", None),
                                       (b"", None), (None, None)])
def test_spec(raw, want):
    assert parse_spec(raw) == want


def test_a_relay_is_reached_by_its_spec_and_ends_with_close():
    relay = Relay("127.0.0.1", op_timeout_s=30.0)
    ch = open_relay(relay.spec(), "run1", connect_s=5.0)
    assert ch is not None
    try:
        ch.put("alive/0", b"1")
        assert ch.get("alive/0") == b"1"
    finally:
        ch.close()
    relay.close()
    assert open_relay(relay.spec(), "run1", connect_s=0.5) is None


def test_the_local_address_on_the_way_to_a_store():
    relay = Relay("127.0.0.1", op_timeout_s=30.0)
    try:
        assert local_address("127.0.0.1", relay.port) == "127.0.0.1"
    finally:
        relay.close()
    assert local_address("127.0.0.1", relay.port, timeout=0.5) is None  # nobody listens
