"""deploy/systemd: the units and the config files they read are what an operator installs.

The test reads each unit's ExecStart and runs exactly that command - the binary path mapped to this
environment's `waltz`, /etc/waltz/ to the shipped files - with only the per-host values (addresses,
ports, directories, coordination, certificate paths) given through WALTZ_* variables, as a unit's
Environment= lines would. A storage node and a server start with mutual TLS, become ready, serve a
client, and stop cleanly on the unit's KillSignal.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from waltz_core.testing.servers import free_ports

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "systemd"
WALTZ = str(Path(sys.executable).with_name("waltz"))


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read(DEPLOY / name)
    return parser


def exec_start(name: str) -> list[str]:
    argv = shlex.split(unit(name)["Service"]["ExecStart"])
    assert argv[0] == "/opt/waltz/bin/waltz"
    return [WALTZ, *[a.replace("/etc/waltz/", f"{DEPLOY}/") for a in argv[1:]]]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([WALTZ, *args], capture_output=True, text=True, timeout=60, env=env)


def start(argv: list[str], env: dict[str, str], ready: str, log: Path) -> subprocess.Popen[str]:
    with open(log, "w") as err:  # the child keeps its own descriptor
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(ready):
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"{argv} never printed {ready!r}:\n{log.read_text()[-3000:]}")


def test_units_are_sane_and_the_config_files_are_valid() -> None:
    for name, toml in (("waltz-storage.service", "storage.toml"), ("waltz-server.service", "server.toml")):
        service = unit(name)["Service"]
        assert service["User"] == "waltz" and service["Restart"] == "on-failure"
        assert service["KillSignal"] == "SIGTERM" and service["NoNewPrivileges"] == "true"
        assert service["ProtectSystem"] == "strict"
        check = run("config", "check", str(DEPLOY / toml))
        assert check.returncode == 0, check.stderr
        assert f"{toml.split('.')[0]} configuration" in check.stdout
    storage_dir = re.search(r'^directory = "(.*)"', (DEPLOY / "storage.toml").read_text(), re.M)
    assert storage_dir is not None
    assert storage_dir.group(1) in unit("waltz-storage.service")["Service"]["ReadWritePaths"].split()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_units_exact_commands_start_a_tls_cluster(tmp_path: Path) -> None:
    from waltz_transport_tcp.certs import create_test_ca

    certs = create_test_ca(tmp_path / "tls", hosts=("127.0.0.1",), clients=("client",))
    data_port, admin_port, storage_http, server_port, server_http = free_ports(5)
    coordination = str(tmp_path / "coordination")
    base = {k: v for k, v in os.environ.items() if not k.startswith("WALTZ_")}
    common = {**base, "WALTZ_COORDINATION_NAME": "local", "WALTZ_COORDINATION_CONNECT": coordination,
              "WALTZ_TRANSPORT_TCP__TLS_CERT": str(certs.node_cert), "WALTZ_TRANSPORT_TCP__TLS_KEY": str(certs.node_key),
              "WALTZ_TRANSPORT_TCP__TLS_CA": str(certs.ca)}
    client_cert = certs.clients["client"]
    cli = tmp_path / "cli.toml"
    cli.write_text(f'[coordination]\nname = "local"\nconnect = "{coordination}"\n\n[transport.tcp]\n'
                   f'tls_cert = "{client_cert[0]}"\ntls_key = "{client_cert[1]}"\ntls_ca = "{certs.ca}"\n')
    storage = f"127.0.0.1:{data_port}"
    for step in (["cluster", "create", "-n", "prod", "--partitions", "2"],
                 ["cluster", "add-storage-node", "-s", storage, "-a", str(admin_port), "-g", "0"],
                 ["cluster", "auto-assign", "-g", "0"]):
        done = run(*step, "-c", str(cli), env=base)
        assert done.returncode == 0, done.stderr
    storage_env = {**common, "WALTZ_STORAGE_HOST": "127.0.0.1", "WALTZ_STORAGE_PORT": str(data_port),
                   "WALTZ_STORAGE_ADMIN_PORT": str(admin_port), "WALTZ_STORAGE_DIRECTORY": str(tmp_path / "storage"),
                   "WALTZ_HTTP_HOST": "127.0.0.1", "WALTZ_HTTP_PORT": str(storage_http)}
    server_env = {**common, "WALTZ_SERVER_HOST": "127.0.0.1", "WALTZ_SERVER_PORT": str(server_port),
                  "WALTZ_HTTP_HOST": "127.0.0.1", "WALTZ_HTTP_PORT": str(server_http)}
    procs = []
    try:
        procs.append(start(exec_start("waltz-storage.service"), storage_env, "waltz storage ready",
                           tmp_path / "storage.log"))
        assigned = run("storage", "add-partition", "-a", f"127.0.0.1:{admin_port}", "-p", "0-1", "-c", str(cli), env=base)
        assert assigned.returncode == 0, assigned.stderr
        procs.append(start(exec_start("waltz-server.service"), server_env, "waltz server ready",
                           tmp_path / "server.log"))
        client = tmp_path / "client.toml"
        client.write_text(cli.read_text())
        marks = run("client", "high-water-mark", "-c", str(client), "--json", env=base)
        assert marks.returncode == 0, marks.stderr
        assert json.loads(marks.stdout)["high_water_marks"] == {"0": -1, "1": -1}  # served, still empty
    finally:
        for proc in reversed(procs):  # the unit's KillSignal: a clean stop, exit status 0
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
            assert proc.stdout is not None
            proc.stdout.close()
            assert code == 0, (tmp_path / "server.log").read_text()[-2000:]
