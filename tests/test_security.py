"""Security of the bus: auth (user/password, token, nkey seed, creds file), TLS (server and mutual), no
secret in any log or in `rlbus config show`, and no pickle/eval/exec anywhere bus data could reach.

Every server here is a LocalNatsServer of the test's own with an `authorization {}` or `tls {}` block.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
import tokenize
from pathlib import Path

import pytest
from e2e_utils import Run, make_config, prompt_work

from rlbus.bus import Bus, BusConnectError, LocalNatsServer, Stage, connect
from rlbus.config import RlbusConfig, save_config
from rlbus.launcher import ServiceProcess

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- helpers


def _cfg(url: str, run_id: str, tmp_path: Path, **bus: object) -> RlbusConfig:
    return RlbusConfig(run={"id": run_id, "dir": tmp_path / "runs"}, bus={"url": url, **bus})


async def _roundtrip(cfg: RlbusConfig) -> None:
    async with Bus.connect(cfg, name="secure-client") as bus:
        await bus.publish(Stage.PROMPTS, prompt_work(cfg.run.id))
        consumer = await bus.consumer(Stage.PROMPTS, "rollout", ack_wait_s=5)
        [d] = await consumer.fetch(1, timeout=5)
        assert d.message.prompt_id == "p0"  # type: ignore[attr-defined]
        assert await d.ack()
        await bus.delete_run()


def _reward_process(
    cfg: RlbusConfig, tmp_path: Path, name: str, env: dict[str, str] | None = None
) -> ServiceProcess:
    """The reward service (no model to load: quick) as its own process, config from a file."""
    path = save_config(cfg, tmp_path / f"{name}.yaml")
    proc = ServiceProcess(
        name,
        "reward",
        ["--config", str(path), "--instance-id", name],
        tmp_path / "logs" / f"{name}.log",
        env=dict(env or {}),
    )
    return proc.start()


async def _wait_heartbeat(cfg: RlbusConfig, proc: ServiceProcess, timeout_s: float = 60) -> None:
    import asyncio

    async with Bus.connect(cfg, name="observer") as bus:
        state = await bus.state()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(
                hb.instance_id == proc.name and hb.status == "ready" for hb in await state.live("reward", 10)
            ):
                return
            assert proc.alive, proc.log_path.read_text(errors="replace")
            await asyncio.sleep(0.5)
    raise AssertionError(f"no heartbeat from {proc.name}:\n{proc.log_path.read_text(errors='replace')}")


def _wait_exit(proc: ServiceProcess, timeout_s: float = 45) -> int:
    assert proc.proc is not None
    try:
        return proc.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(
            f"{proc.name} kept running with a wrong secret:\n{proc.log_path.read_text()}"
        ) from None


def _assert_secret_absent(secret: str, *paths: Path) -> None:
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    assert files
    for f in files:
        assert secret.encode() not in f.read_bytes(), f"secret leaked into {f}"


def _config_show(*args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "config", "show", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


# ---------------------------------------------------------------- user/password and token


@pytest.mark.timeout(300)
def test_user_password_run_and_wrong_password(run_id: str, tmp_path: Path) -> None:
    """A real run (every service its own process) on a server that needs user/password; the password
    travels by environment variable, so it is in no file of the run, no log, no `config show`."""
    user, secret = "rlbus-svc", "pw-Zq81-never-print-me"
    block = f'authorization {{ user: "{user}", password: "{secret}" }}'
    with LocalNatsServer(tmp_path / "nats", extra_config=block) as srv:
        cfg = make_config(
            srv.url,
            run_id,
            tmp_path,
            [
                f"bus.user={user}",
                "trainer.total_training_steps=2",
                "data.train_batch_size=4",
                "rollout.n=2",
                "rollout.prompts_per_batch=4",
                "trainer.val_before_train=false",
                "trainer.test_freq=0",
            ],
        )
        env = {"RLBUS_BUS__PASSWORD": secret}
        run = Run(cfg)  # writes config.yaml: without the password, which only the environment carries
        for p in run.procs:
            p.env.update(env)
        with run:
            rc = run.wait_learner(240)
            assert rc == 0, run.logs("learner")
            assert len(run.ledger()["trained"]) == 2 * 4

        bad = _reward_process(
            cfg, tmp_path, "reward-intruder", env={"RLBUS_BUS__PASSWORD": "wrong-" + secret}
        )
        assert _wait_exit(bad) != 0
        text = bad.log_path.read_text()
        assert "authorization failed" in text and "rlbus reward: cannot connect to NATS" in text, text
        assert "Traceback" not in text, text

        shown = _config_show("--config", str(run.config_path), env=env)
        assert "password: '***'" in shown and secret not in shown
    _assert_secret_absent(secret, run.run_dir, bad.log_path)


@pytest.mark.timeout(120)
async def test_token_auth_service_connects_and_wrong_token_fails_clearly(run_id: str, tmp_path: Path) -> None:
    secret = "tok-7f3a-never-print-me"
    with LocalNatsServer(tmp_path / "nats", extra_config=f'authorization {{ token: "{secret}" }}') as srv:
        good_cfg = _cfg(srv.url, run_id, tmp_path, token=secret)
        await _roundtrip(good_cfg)
        good = _reward_process(good_cfg, tmp_path, "reward-good")  # the token sits in its config file
        try:
            await _wait_heartbeat(good_cfg, good)
        finally:
            good.stop()
        assert good.proc is not None and good.proc.returncode == 0
        bad = _reward_process(
            _cfg(srv.url, run_id, tmp_path, token="wrong-" + secret), tmp_path, "reward-bad"
        )
        assert _wait_exit(bad) != 0
        assert "authorization failed" in bad.log_path.read_text()
        # The token in the URL instead (nats://<token>@host): connects, and is redacted in logs.
        url_cfg = _cfg(srv.url.replace("nats://", f"nats://{secret}@"), run_id, tmp_path)
        by_url = _reward_process(url_cfg, tmp_path, "reward-url")
        try:
            await _wait_heartbeat(good_cfg, by_url)
        finally:
            by_url.stop()
        with pytest.raises(BusConnectError, match="authorization failed"):
            await connect(good_cfg.bus.model_copy(update={"token": None}), srv.url, "anonymous", wait_s=10)
        shown = _config_show(f"bus.token={secret}", f"bus.url=nats://{secret}@127.0.0.1:4222")
        assert "token: '***'" in shown and "url: nats://***@127.0.0.1:4222" in shown and secret not in shown
    _assert_secret_absent(secret, tmp_path / "logs")


# ---------------------------------------------------------------- TLS


def _make_pki(d: Path) -> dict[str, Path]:
    """A self-signed CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("rlbus test CA"))
        .issuer_name(name("rlbus test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        cn: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName] | None
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
        )
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(ca_key, hashes.SHA256()), key

    server, server_key = leaf(
        "127.0.0.1",
        ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client, client_key = leaf("rlbus-client", ExtendedKeyUsageOID.CLIENT_AUTH, None)
    out = {"ca": d / "ca.pem", "server": d / "server.pem", "client": d / "client.pem"}
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out["server"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    out["client"].write_bytes(client.public_bytes(serialization.Encoding.PEM))
    out["server_key"] = write_key(server_key, d / "server-key.pem")
    out["client_key"] = write_key(client_key, d / "client-key.pem")
    return out


def _tls_block(pki: dict[str, Path], verify: bool) -> str:
    lines = [f'cert_file: "{pki["server"]}"', f'key_file: "{pki["server_key"]}"', "timeout: 5"]
    if verify:
        lines += [f'ca_file: "{pki["ca"]}"', "verify: true"]
    return "tls {\n  " + "\n  ".join(lines) + "\n}"


@pytest.mark.timeout(180)
async def test_tls_with_our_ca_and_mutual_tls(run_id: str, tmp_path: Path) -> None:
    pki = _make_pki(tmp_path / "pki")
    with LocalNatsServer(tmp_path / "nats-tls", extra_config=_tls_block(pki, verify=False)) as srv:
        cfg = _cfg(srv.url, run_id, tmp_path, tls_ca=pki["ca"])
        await _roundtrip(cfg)
        await _roundtrip(_cfg(srv.url.replace("nats://", "tls://"), run_id, tmp_path, tls_ca=pki["ca"]))
        proc = _reward_process(cfg, tmp_path, "reward-tls")  # a service over TLS
        try:
            await _wait_heartbeat(cfg, proc)
        finally:
            proc.stop()
        with pytest.raises(BusConnectError, match="(?i)certificate"):  # system CAs do not know ours
            await connect(cfg.bus.model_copy(update={"tls_ca": None}), srv.url, "no-ca", wait_s=5)
        other = _make_pki(tmp_path / "other-pki")
        with pytest.raises(BusConnectError, match="(?i)certificate"):
            await connect(cfg.bus.model_copy(update={"tls_ca": other["ca"]}), srv.url, "wrong-ca", wait_s=5)

    with LocalNatsServer(tmp_path / "nats-mtls", extra_config=_tls_block(pki, verify=True)) as srv:
        mtls = _cfg(
            srv.url, run_id, tmp_path, tls_ca=pki["ca"], tls_cert=pki["client"], tls_key=pki["client_key"]
        )
        await _roundtrip(mtls)
        with pytest.raises(BusConnectError):  # no client certificate: the server refuses the handshake
            await connect(
                mtls.bus.model_copy(update={"tls_cert": None, "tls_key": None}), srv.url, "anon", wait_s=5
            )
    with pytest.raises(BusConnectError, match="tls_key is set without bus.tls_cert"):
        await connect(cfg.bus.model_copy(update={"tls_key": pki["client_key"]}), srv.url, "half", wait_s=1)


# ---------------------------------------------------------------- nkeys and creds files


def _user_seed() -> tuple[bytes, str]:
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


@pytest.mark.timeout(120)
async def test_nkey_seed_auth(run_id: str, tmp_path: Path) -> None:
    seed, public = _user_seed()
    other_seed, _ = _user_seed()
    (tmp_path / "user.nk").write_bytes(seed + b"\n")
    (tmp_path / "other.nk").write_bytes(other_seed + b"\n")
    block = f'authorization {{ users = [ {{ nkey: "{public}" }} ] }}'
    with LocalNatsServer(tmp_path / "nats", extra_config=block) as srv:
        cfg = _cfg(srv.url, run_id, tmp_path, nkeys_seed=tmp_path / "user.nk")
        await _roundtrip(cfg)
        proc = _reward_process(cfg, tmp_path, "reward-nkey")
        try:
            await _wait_heartbeat(cfg, proc)
        finally:
            proc.stop()
        with pytest.raises(BusConnectError, match="authorization failed"):
            await connect(
                cfg.bus.model_copy(update={"nkeys_seed": tmp_path / "other.nk"}), srv.url, "x", wait_s=10
            )
        with pytest.raises(BusConnectError, match="does not exist"):
            await connect(
                cfg.bus.model_copy(update={"nkeys_seed": tmp_path / "none.nk"}), srv.url, "x", wait_s=2
            )
    _assert_secret_absent(seed.decode(), tmp_path / "logs")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _jwt(claims: dict, signer_seed: bytes) -> str:
    """A NATS (v2) JWT: ed25519-nkey over `header.claims`, jti = base32(sha512/256(claims))."""
    import nkeys

    claims = {"iat": int(time.time()), **claims}
    body = json.dumps(claims, separators=(",", ":")).encode()
    claims["jti"] = base64.b32encode(hashlib.new("sha512_256", body).digest()).decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}, separators=(",", ":")).encode())
    payload = _b64(json.dumps(claims, separators=(",", ":")).encode())
    signature = nkeys.from_seed(bytearray(signer_seed)).sign(f"{head}.{payload}".encode())
    return f"{head}.{payload}.{_b64(signature)}"


def _operator_setup() -> tuple[str, dict[str, str]]:
    """Server config for operator mode (memory resolver) and a user's creds file text, all made here."""
    import nkeys

    def keypair(prefix: int) -> tuple[bytes, str]:
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()

    op_seed, op_pub = keypair(nkeys.PREFIX_BYTE_OPERATOR)
    acc_seed, acc_pub = keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    sys_seed, sys_pub = keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    user_seed, user_pub = keypair(nkeys.PREFIX_BYTE_USER)
    unlimited = {
        "subs": -1,
        "data": -1,
        "payload": -1,
        "imports": -1,
        "exports": -1,
        "wildcards": True,
        "conn": -1,
        "leaf": -1,
    }
    js = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    operator = _jwt(
        {
            "iss": op_pub,
            "sub": op_pub,
            "name": "rlbus-op",
            "nats": {"type": "operator", "version": 2, "system_account": sys_pub},
        },
        op_seed,
    )
    account = _jwt(
        {
            "iss": op_pub,
            "sub": acc_pub,
            "name": "rlbus",
            "nats": {"limits": {**unlimited, **js}, "type": "account", "version": 2},
        },
        op_seed,
    )
    system = _jwt(
        {
            "iss": op_pub,
            "sub": sys_pub,
            "name": "SYS",
            "nats": {"limits": unlimited, "type": "account", "version": 2},
        },
        op_seed,
    )
    user = _jwt(
        {
            "iss": acc_pub,
            "sub": user_pub,
            "name": "svc",
            "nats": {
                "pub": {},
                "sub": {},
                "subs": -1,
                "data": -1,
                "payload": -1,
                "type": "user",
                "version": 2,
            },
        },
        acc_seed,
    )
    server = (
        f'operator: "{operator}"\nsystem_account: {sys_pub}\nresolver: MEMORY\n'
        f'resolver_preload: {{\n  {acc_pub}: "{account}"\n  {sys_pub}: "{system}"\n}}\n'
    )
    creds = (
        f"-----BEGIN NATS USER JWT-----\n{user}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user_seed.decode()}\n------END USER NKEY SEED------\n"
    )
    other_seed, other_pub = keypair(nkeys.PREFIX_BYTE_USER)
    stranger = _jwt(
        {
            "iss": acc_pub,
            "sub": other_pub,
            "name": "x",
            "nats": {"pub": {}, "sub": {}, "type": "user", "version": 2},
        },
        other_seed,
    )  # self-signed
    bad = creds.replace(user, stranger).replace(user_seed.decode(), other_seed.decode())
    return server, {"good": creds, "bad": bad, "seed": user_seed.decode()}


@pytest.mark.timeout(120)
async def test_creds_file_auth_in_operator_mode(run_id: str, tmp_path: Path) -> None:
    server_conf, creds = _operator_setup()
    (tmp_path / "svc.creds").write_text(creds["good"])
    (tmp_path / "bad.creds").write_text(creds["bad"])
    with LocalNatsServer(tmp_path / "nats", extra_config=server_conf) as srv:
        cfg = _cfg(srv.url, run_id, tmp_path, creds_file=tmp_path / "svc.creds")
        await _roundtrip(cfg)
        proc = _reward_process(cfg, tmp_path, "reward-creds")
        try:
            await _wait_heartbeat(cfg, proc)
        finally:
            proc.stop()
        with pytest.raises(BusConnectError, match="authorization failed"):
            await connect(
                cfg.bus.model_copy(update={"creds_file": tmp_path / "bad.creds"}), srv.url, "x", wait_s=10
            )
        with pytest.raises(BusConnectError, match="authorization failed"):
            await connect(cfg.bus.model_copy(update={"creds_file": None}), srv.url, "anonymous", wait_s=10)
    _assert_secret_absent(creds["seed"], tmp_path / "logs")


# ---------------------------------------------------------------- no pickle / eval / exec


_BANNED_NAMES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "jsonpickle"}
_BANNED_CALLS = {"eval", "exec", "execfile", "compile", "__import__"}


def _violations(path: Path) -> list[str]:
    """Code (not comments, not strings) that could turn bus bytes into code or arbitrary objects."""
    source = path.read_text()
    toks = [
        t
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    ]
    out = []
    for i, tok in enumerate(toks):
        if tok.type != tokenize.NAME:
            continue
        prev = toks[i - 1].string if i else ""
        nxt = toks[i + 1].string if i + 1 < len(toks) else ""
        where = f"{path.relative_to(ROOT)}:{tok.start[0]}"
        if tok.string in _BANNED_NAMES and prev != ".":
            out.append(f"{where}: {tok.string}")
        elif tok.string in _BANNED_CALLS and nxt == "(" and prev != ".":  # model.eval() is fine
            out.append(f"{where}: {tok.string}(")
        elif (
            tok.string == "allow_pickle"
            and nxt == "="
            and i + 2 < len(toks)
            and toks[i + 2].string != "False"
        ):
            out.append(f"{where}: allow_pickle={toks[i + 2].string}")
        elif tok.string in ("unsafe_load", "full_load", "UnsafeLoader", "FullLoader") and prev == ".":
            out.append(f"{where}: yaml.{tok.string}")
    # torch.load only with weights_only=True; yaml.load never (safe_load is the way).
    for m in re.finditer(r"\b(torch\.load|yaml\.load)\s*\(", source):
        line = source.count("\n", 0, m.start()) + 1
        if source.splitlines()[line - 1].lstrip().startswith("#"):
            continue
        depth, j = 0, m.end() - 1
        while j < len(source):
            depth += {"(": 1, ")": -1}.get(source[j], 0)
            if depth == 0:
                break
            j += 1
        call = source[m.start() : j + 1]
        if m.group(1) == "yaml.load" or not re.search(r"weights_only\s*=\s*True", call):
            out.append(f"{path.relative_to(ROOT)}:{line}: {call[:80]}")
    return out


def test_no_pickle_eval_or_exec_in_the_source_tree() -> None:
    files = sorted(p for d in ("shared", "services") for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 20
    found = [v for f in files for v in _violations(f)]
    assert not found, "code that could run or unpickle bus data:\n" + "\n".join(found)


def test_the_source_checker_catches_what_it_should(tmp_path: Path) -> None:
    bad = ROOT / "shared" / "_tmp_security_probe.py"  # must sit under ROOT for relative paths
    try:
        bad.write_text(
            "import pickle\nfrom cloudpickle import loads\nx = eval('1')\nexec('y = 1')\n"
            "import torch\nw = torch.load('f.pt')\nok = torch.load('f.pt', weights_only=True)\n"
            "import numpy as np\na = np.load('a.npy', allow_pickle=True)\nimport yaml\nd = yaml.load('a')\n"
            "# pickle in a comment is fine\ns = 'eval(1) in a string is fine'\nmodel.eval()\n"
        )
        found = _violations(bad)
    finally:
        bad.unlink()
    text = "\n".join(found)
    for what in (
        "pickle",
        "cloudpickle",
        "eval(",
        "exec(",
        "torch.load('f.pt')",
        "allow_pickle=True",
        "yaml.load",
    ):
        assert what in text, (what, text)
    assert len(found) == 7, text  # nothing from the comment, the string, model.eval() or weights_only=True


def test_the_shipped_placeholder_token_or_an_empty_secret_is_refused_at_start(tmp_path: Path) -> None:
    """k8s/secret.yaml ships `change-me-nats-token`: a pod that still has it exits with the refusal code (2)
    naming bus.token and the fix, before it connects to anything."""
    shipped = re.search(r"token:\s*(\S+)", (ROOT / "k8s" / "secret.yaml").read_text())
    assert shipped is not None
    for env in ({"RLBUS_BUS__TOKEN": shipped.group(1)}, {"RLBUS_BUS__PASSWORD": "  "}):
        done = subprocess.run(
            [sys.executable, "-m", "rlbus.cli", "reward"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        key = "bus.token" if "RLBUS_BUS__TOKEN" in env else "bus.password"
        assert done.returncode == 2, done.stderr
        assert key in done.stderr and ("placeholder" in done.stderr or "empty" in done.stderr), done.stderr
