"""Host headers (`blockspec serve --allowed-hosts`), against DNS rebinding: a page on attacker.example whose name
now resolves to 127.0.0.1 sends `Host: attacker.example`, and must not read the replies of a server without a key.

- By default the loopback names (any port, any case) are answered, any other name gets 400 with OpenAI's error body
  on every path, before the API key is looked at; responses are counted in /metrics as usual.
- `--allowed-hosts` widens the list (names or addresses, ports ignored) and `*` lifts the check; the bound --host
  address is allowed too; the flag reaches the app served by `blockspec serve`."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import uvicorn

from blockspec.cli import main
from blockspec.llm import LLM
from blockspec.server.hosts import LOOPBACK_HOSTS, HostCheck, allowed_hosts, host_name
from server_utils import LiveServer, tiny_pair


def refused(host: str) -> dict:
    return {"error": {"message": f"Host {host!r} is not allowed on this server (blockspec serve --allowed-hosts)",
                      "type": "invalid_request_error", "param": None, "code": "host_not_allowed"}}


@pytest.fixture(scope="module")
def engine_factory():
    _, _, lm, draft = tiny_pair()
    return lambda: LLM.from_loaded(lm, draft).engine


def get(srv: LiveServer, host: str, path: str = "/health", **headers: str) -> httpx.Response:
    return httpx.get(srv.url + path, headers={"Host": host, **headers})


def test_host_names():
    assert host_name("LocalHost:8000") == "localhost" and host_name("127.0.0.1") == "127.0.0.1"
    assert host_name("[::1]:8000") == host_name("[::1]") == host_name("::1") == "::1"
    assert allowed_hosts(None, "127.0.0.1") == LOOPBACK_HOSTS
    assert allowed_hosts(None, "0.0.0.0") == LOOPBACK_HOSTS | {"0.0.0.0"}
    assert allowed_hosts(" Box.LAN:9000, 10.0.0.7,,", "::1") == LOOPBACK_HOSTS | {"box.lan", "10.0.0.7"}
    check = HostCheck(LOOPBACK_HOSTS)
    assert check.refusal([(b"host", b"localhost:1")]) is None
    assert check.refusal([(b"host", b"localhost"), (b"host", b"localhost")]) == "the request needs one Host header"
    assert check.refusal([]) == "the request needs one Host header"
    assert HostCheck(frozenset({"*"})).refusal([]) is None


def test_foreign_hosts_get_400_and_loopback_names_200(engine_factory):
    srv = LiveServer(engine_factory(), api_key="k")
    try:
        key = {"Authorization": "Bearer k"}
        for host in ("127.0.0.1", f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", "LOCALHOST", f"[::1]:{srv.port}",
                     "[::1]"):
            r = get(srv, host, **key)
            assert (r.status_code, r.json()) == (200, {"status": "ok"}), host
        for host in ("attacker.example", f"attacker.example:{srv.port}", "127.0.0.1.attacker.example", "10.0.0.7",
                     "localhost.attacker.example"):
            for path in ("/health", "/v1/models", "/metrics", "/nowhere"):
                r = get(srv, host, path, **key)  # the right key does not help
                assert (r.status_code, r.json()) == (400, refused(host)), (host, path)
            assert get(srv, host).status_code == 400  # nor is a missing key reported to a foreign page
        r = httpx.post(srv.url + "/v1/completions", headers={"Host": "attacker.example", **key},
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 4})
        assert (r.status_code, r.json()) == (400, refused("attacker.example"))
        assert get(srv, "localhost").status_code == 401  # an allowed name still needs the key
        metrics = srv.app.state.metrics
        assert metrics.value("blockspec_requests_total", endpoint="/health", status="400") == 10
        assert metrics.value("blockspec_requests_total", endpoint="/v1/completions", status="400") == 1
        assert srv.engine.scheduler.has_work() is False and metrics.value("blockspec_generation_tokens_total") == 0
    finally:
        srv.stop()


def test_allowed_hosts_widen_the_list(engine_factory):
    srv = LiveServer(engine_factory(), allowed_hosts=allowed_hosts("box.lan,10.0.0.7:9999", "127.0.0.1"))
    try:
        for host in ("box.lan", f"box.lan:{srv.port}", "BOX.LAN:1", "10.0.0.7", f"10.0.0.7:{srv.port}", "localhost"):
            assert get(srv, host).status_code == 200, host
        r = srv.client(default_headers={"Host": f"box.lan:{srv.port}"}).completions.create(
            model="tiny", prompt="Hello", max_tokens=3, temperature=0)
        assert len(r.choices[0].token_ids) == 3
        assert get(srv, "attacker.example").json() == refused("attacker.example")
        assert get(srv, "box.lan.attacker.example").status_code == 400
    finally:
        srv.stop()
    srv = LiveServer(engine_factory(), allowed_hosts=allowed_hosts("*", "127.0.0.1"))
    try:
        assert get(srv, "attacker.example").status_code == 200
    finally:
        srv.stop()


def test_serve_passes_allowed_hosts_and_the_bound_address(monkeypatch, capsys):
    target, _, _, _ = tiny_pair()
    apps = []

    def run(self: uvicorn.Server, sockets=None) -> None:  # the app is kept, not served
        apps.append(self.config.app)
        for sock in sockets or []:
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)

    async def statuses(app, hosts: list[str]) -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            return [(await client.get("/health", headers={"Host": h})).status_code for h in hosts]

    assert main(["serve", str(target), "--device", "cpu", "--host", "127.0.0.2", "--port", "0",
                 "--allowed-hosts", "Box.LAN:9000"]) == 0
    hosts = ["box.lan:8000", "127.0.0.2:8000", "localhost", "[::1]:1", "attacker.example", "0.0.0.0"]
    assert asyncio.run(statuses(apps[-1], hosts)) == [200, 200, 200, 200, 400, 400]
    assert main(["serve", str(target), "--device", "cpu", "--port", "0"]) == 0  # default: loopback only
    assert asyncio.run(statuses(apps[-1], ["localhost:8000", "box.lan"])) == [200, 400]
    assert main(["serve", str(target), "--device", "cpu", "--port", "0", "--allowed-hosts", "*"]) == 0
    assert asyncio.run(statuses(apps[-1], ["attacker.example"])) == [200]
    capsys.readouterr()
    assert main(["serve", str(target), "--allowed-hosts", " ,"]) == 2
    assert capsys.readouterr().err == ("blockspec: error: --allowed-hosts ' ,': give host names separated by "
                                       "commas, or * for any\n")
