"""Test-only: a process that starts with this folder on PYTHONPATH (main.py, its ranks; the tests'
fork server imports it for the main.py job it forks) cannot reach the network. Resolving a name other
than localhost, or connecting a socket to an address that is not loopback, is appended to the file
$FRAMEWORK_TEST_NETWORK_LOG and fails as an unreachable network would. Nothing in the framework
knows about it."""

import os

_log = os.environ.get("FRAMEWORK_TEST_NETWORK_LOG", "")
if _log:
    import errno
    import ipaddress
    import socket

    def _record(what: str) -> None:
        with open(_log, "a") as handle:
            handle.write(f"{os.getpid()} {what}\n")

    def _local(host) -> bool:
        if host is None or host in ("", "localhost", b"localhost"):
            return True
        try:
            return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host).is_loopback
        except ValueError:
            return False

    _getaddrinfo = socket.getaddrinfo

    def _guarded_getaddrinfo(host, *args, **kwargs):
        if not _local(host):
            _record(f"getaddrinfo {host!r}")
            raise socket.gaierror(socket.EAI_NONAME, "name resolution blocked by the test")
        return _getaddrinfo(host, *args, **kwargs)

    def _guard(method):
        def guarded(self, address, *args):
            if self.family in (socket.AF_INET, socket.AF_INET6) and not _local(address[0]):
                _record(f"{method.__name__} {address!r}")
                raise OSError(errno.ENETUNREACH, "network blocked by the test")
            return method(self, address, *args)

        return guarded

    socket.getaddrinfo = _guarded_getaddrinfo
    socket.socket.connect = _guard(socket.socket.connect)
    socket.socket.connect_ex = _guard(socket.socket.connect_ex)
