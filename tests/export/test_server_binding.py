"""Every server Draftsmith starts listens on the loopback interface only (issue #16, item 5). The live check runs
where a validation's vLLM server is up anyway: tests/faults/test_kill_matrix.py, before it kills the validator;
here, that the check itself can fail."""
import ipaddress
import socket

import psutil
from stages import listening_sockets


def test_the_loopback_check_sees_an_exposed_socket():
    with socket.socket() as s:  # the live check must be able to fail: a socket on every interface is reported
        s.bind(("0.0.0.0", 0))
        s.listen()
        found = [a for pid, a, port in listening_sockets([psutil.Process().pid]) if port == s.getsockname()[1]]
    assert found == ["0.0.0.0"] and not ipaddress.ip_address(found[0]).is_loopback
