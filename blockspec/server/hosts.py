"""Which `Host` headers the server answers (`--allowed-hosts`).

Without an API key (the default) any web page could otherwise read a localhost server's replies through DNS
rebinding: the browser sends the attacker's name as Host, so refusing names the server was not given stops it."""

from __future__ import annotations

from blockspec.errors import BlockspecError

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
ANY_HOST = "*"


def host_name(value: str) -> str:
    """The name part of a Host header or an --allowed-hosts entry, lower case: no port, no IPv6 brackets."""
    value = value.strip().lower()
    if value.startswith("["):  # "[::1]:8000"
        return value[1:].partition("]")[0]
    if value.count(":") == 1:  # "name:port"; more colons: a bare IPv6 address
        return value.partition(":")[0]
    return value


def allowed_hosts(extra: str | None, bound_host: str) -> frozenset[str]:
    """The loopback names, the address the server is bound to, and the comma-separated `extra` names (`*`: any)."""
    names = set(LOOPBACK_HOSTS) | ({host_name(bound_host)} - {""})  # "": every interface, no name
    if extra is not None:
        given = [host_name(n) for n in extra.split(",") if n.strip()]
        if not given:
            raise BlockspecError(f"--allowed-hosts {extra!r}: give host names separated by commas, or * for any")
        names.update(given)
    return frozenset(names)


class HostCheck:
    def __init__(self, hosts: frozenset[str]) -> None:
        self.hosts = hosts

    def refusal(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """Why a request with these headers is refused, or None when its Host is allowed."""
        if ANY_HOST in self.hosts:
            return None
        values = [v for k, v in headers if k == b"host"]
        if len(values) != 1:  # several Host headers: which one a proxy or the browser meant is unclear
            return "the request needs one Host header"
        host = values[0].decode("latin-1")
        if host_name(host) in self.hosts:
            return None
        return f"Host {host[:100]!r} is not allowed on this server (blockspec serve --allowed-hosts)"
