"""Every server Draftsmith starts listens on the loopback interface only (issue #16, item 5)."""
import ipaddress
import socket

import psutil
import pytest

from draftsmith.export.server import VllmServer, group_members

pytestmark = pytest.mark.slow


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state held by `pids`."""
    return [(c.pid, c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.pid in pids and c.status == psutil.CONN_LISTEN]


def test_the_vllm_server_and_its_engine_listen_on_loopback_only(tmp_path):
    from draftsmith.data.target import resolve_target_path

    target = str(resolve_target_path("smollm2"))
    with VllmServer(target, "binding", tmp_path, spec_config={"method": "ngram", "num_speculative_tokens": 2,
                                                              "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                    dtype="float32", max_model_len=512, start_timeout_s=900) as server:
        members = group_members(server.proc.pid)
        sockets = listening_sockets(members)
    assert len(members) >= 2, members  # the API server and its engine process
    assert server.port in {port for _, _, port in sockets}, sockets  # the check sees the API socket itself
    exposed = [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback]
    assert exposed == [], f"listening beyond loopback: {exposed}"


def test_the_loopback_check_sees_an_exposed_socket():
    with socket.socket() as s:  # the check above must be able to fail: a socket on every interface is reported
        s.bind(("0.0.0.0", 0))
        s.listen()
        found = [a for pid, a, port in listening_sockets([psutil.Process().pid]) if port == s.getsockname()[1]]
    assert found == ["0.0.0.0"] and not ipaddress.ip_address(found[0]).is_loopback
