"""The media URL policy: http(s):// feature URLs cannot reach the server's own network (no SSRF).

Fake DNS: :class:`FakeDns` answers for made-up names, and ``pretend_public`` deems
127.0.0.2 (where the ``serve_files`` "public" server listens) a public address, so a
test can point a public-looking name at a local server while 127.0.0.1 stays loopback.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from fastdeploy.multimodal import FeatureFetchError, FeatureItem, encode_features, fetch_features
from fastdeploy.multimodal.sources import HTTP_FETCH_FAILED, URL_REFUSED, read_url
from fastdeploy.multimodal.url_policy import MediaUrlPolicy, is_public_address, system_resolve

HIDDEN = 16
GRID = (1, 4, 4)
FEATURES = torch.arange(4 * HIDDEN, dtype=torch.float32).reshape(4, HIDDEN)
NPY = encode_features(FEATURES, "npy")
PUBLIC_STAND_IN = "127.0.0.2"
LOCAL = MediaUrlPolicy(allow_private=True)


def pretend_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """The real address check, except that 127.0.0.2 counts as a public address."""
    return str(ip) == PUBLIC_STAND_IN or is_public_address(ip)


class FakeDns:
    """A resolver for made-up names (``a_example`` is ``a.example``): each name answers its lists
    in turn (the last one repeats); other names go to the system resolver with ``system=True``
    and fail otherwise."""

    def __init__(self, system: bool = False, **answers: list[list[str]]):
        self.answers = {name.replace("_", "."): list(lists) for name, lists in answers.items()}
        self.system = system
        self.calls: list[str] = []

    def __call__(self, host: str, port: int) -> Sequence[str]:
        self.calls.append(host)
        lists = self.answers.get(host)
        if lists is None and self.system:
            return system_resolve(host, port)
        if lists is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return lists.pop(0) if len(lists) > 1 else lists[0]


def policy(dns: FakeDns, domains: str | None = None) -> MediaUrlPolicy:
    """The default policy, with fake DNS and 127.0.0.2 taken for public."""
    base = MediaUrlPolicy.from_config(domains, False)
    return MediaUrlPolicy(base.allowed_domains, resolve=dns, address_allowed=pretend_public)


def fetch(url: str, **kw) -> torch.Tensor:
    """The features at ``url`` (fetch_features at the test hidden size)."""
    (item,) = fetch_features([FeatureItem("image", GRID, url=url)], hidden_size=HIDDEN, **kw)
    return item.features


def refused(url: str) -> str:
    return f"cannot fetch multimodal feature {url}: {URL_REFUSED}"


def failed(url: str) -> str:
    return f"cannot fetch multimodal feature {url}: {HTTP_FETCH_FAILED}"


def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the address check ------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.1.2.3",
        "0.0.0.0",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "100.64.0.1",
        "169.254.169.254",
        "224.0.0.1",
        "240.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "fd12::1",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "::ffff:10.0.0.1",
        "64:ff9b::7f00:1",
        "2002:7f00:1::",
        "2001::1",
    ],
)
def test_non_public_addresses_are_refused(address):
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.215.14", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address):
    assert is_public_address(ipaddress.ip_address(address))


# ---- loopback, link-local and friends: refused before any connection ---------------------


def recording_client() -> tuple[httpx.Client, list[httpx.Request]]:
    """A client that connects nowhere and records every request it is asked to send."""
    sent: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, content=NPY)

    return httpx.Client(transport=httpx.MockTransport(handle)), sent


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}/f.npy",
        "http://localhost:{port}/f.npy",
        "http://0.0.0.0:{port}/f.npy",
        "http://2130706433:{port}/f.npy",
        "http://0x7f.1:{port}/f.npy",
        "http://[::1]:{port}/f.npy",
        "http://[::ffff:127.0.0.1]:{port}/f.npy",
        "http://169.254.169.254/latest/meta-data/",
        "https://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/f.npy",
        "http://[fe80::1]/f.npy",
        "http://[64:ff9b::a9fe:a9fe]/f.npy",
    ],
)
def test_internal_addresses_are_refused_without_a_connection(url, caplog):
    url = url.format(port=closed_port())
    client, sent = recording_client()
    with pytest.raises(FeatureFetchError) as info:
        read_url(url, timeout_s=5, max_bytes=1 << 20, http_client=client)
    assert str(info.value) == refused(url)
    assert sent == []  # refused before anything was sent anywhere
    assert any("refused by the media URL policy" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0", "2130706433"])
def test_the_local_feature_server_is_refused_by_default_and_reached_when_allowed(feature_server, host):
    """The server's own ports: refused by default; served under --allow-private-media-urls."""
    feature_server.files["/f.npy"] = NPY
    url = f"http://{host}:{feature_server.port}/f.npy"
    with pytest.raises(FeatureFetchError) as info:
        fetch(url)
    assert str(info.value) == refused(url)
    assert feature_server.counts["/f.npy"] == 0
    assert torch.equal(fetch(url, url_policy=LOCAL), FEATURES)
    assert feature_server.counts["/f.npy"] == 1


def test_a_name_with_any_refused_address_is_refused(serve_files):
    public = serve_files(PUBLIC_STAND_IN)
    public.files["/f.npy"] = NPY
    dns = FakeDns(mixed_example=[[PUBLIC_STAND_IN, "127.0.0.1"]], public_example=[[PUBLIC_STAND_IN]])
    url = f"http://mixed.example:{public.port}/f.npy"
    with pytest.raises(FeatureFetchError) as info:
        fetch(url, url_policy=policy(dns))
    assert str(info.value) == refused(url)
    assert public.counts["/f.npy"] == 0
    assert torch.equal(fetch(f"http://public.example:{public.port}/f.npy", url_policy=policy(dns)), FEATURES)


# ---- redirects ------------------------------------------------------------------------------


def test_every_redirect_hop_is_checked(serve_files, feature_server):
    public = serve_files(PUBLIC_STAND_IN)
    public.files["/f.npy"] = NPY
    feature_server.files["/secret.npy"] = NPY
    loop = f"http://localhost:{feature_server.port}/secret.npy"
    public.redirects = {
        "/to-loopback": f"{feature_server.url}/secret.npy",
        "/to-localhost": loop,
        "/to-decimal": f"http://2130706433:{feature_server.port}/secret.npy",
        "/to-file": "file:///etc/passwd",
        "/to-public": f"http://public.example:{public.port}/f.npy",
        "/relative": "/f.npy",
        "/loop": "/loop",
    }
    dns = FakeDns(system=True, public_example=[[PUBLIC_STAND_IN]])
    base = f"http://public.example:{public.port}"
    for path in ("/to-loopback", "/to-localhost", "/to-decimal", "/to-file"):
        with pytest.raises(FeatureFetchError) as info:
            fetch(base + path, url_policy=policy(dns))
        assert str(info.value) == refused(base + path)
        assert public.counts[path] == 1
    assert feature_server.counts["/secret.npy"] == 0
    # a redirect to an allowed host is followed, each hop keeping its own Host header
    assert torch.equal(fetch(base + "/to-public", url_policy=policy(dns)), FEATURES)
    assert torch.equal(fetch(base + "/relative", url_policy=policy(dns)), FEATURES)
    assert public.hosts[-1] == f"public.example:{public.port}"
    # a redirect loop ends after max_redirects hops
    with pytest.raises(FeatureFetchError) as info:
        fetch(base + "/loop", url_policy=policy(dns))
    assert str(info.value) == failed(base + "/loop")
    assert public.counts["/loop"] == MediaUrlPolicy().max_redirects + 1


# ---- the allow-list ---------------------------------------------------------------------------


def test_allowed_domains_parse_and_admit_subdomains():
    assert MediaUrlPolicy.from_config(None, False).allowed_domains == ()
    assert MediaUrlPolicy.from_config(" , ", False).allowed_domains == ()
    p = MediaUrlPolicy.from_config(" Example.COM , .cdn.net., *.wild.org,bücher.de", False)
    assert p.allowed_domains == ("example.com", "cdn.net", "wild.org", "xn--bcher-kva.de")
    for host in (
        "example.com",
        "EXAMPLE.com.",
        "a.b.example.com",
        "cdn.net",
        "x.wild.org",
        "xn--bcher-kva.de",
    ):
        assert p.host_allowed(host), host
    for host in ("evilexample.com", "example.com.evil.net", "com", "net", "wild.org.x", "1.2.3.4"):
        assert not p.host_allowed(host), host
    assert MediaUrlPolicy.from_config("10.0.0.1", False).host_allowed("10.0.0.1")
    assert not MediaUrlPolicy.from_config("0.1", False).host_allowed("10.0.0.1")  # no suffix match on IPs
    assert MediaUrlPolicy().host_allowed("anything.example")


def test_allow_list_is_enforced_on_the_url_and_on_redirects(serve_files):
    public = serve_files(PUBLIC_STAND_IN)
    public.files["/f.npy"] = NPY
    public.redirects = {"/away": f"http://other.example:{public.port}/f.npy"}
    dns = FakeDns(
        media_example=[[PUBLIC_STAND_IN]],
        cdn_media_example=[[PUBLIC_STAND_IN]],
        other_example=[[PUBLIC_STAND_IN]],
    )
    only_media = policy(dns, "media.example")
    for host in ("media.example", "cdn.media.example"):
        assert torch.equal(fetch(f"http://{host}:{public.port}/f.npy", url_policy=only_media), FEATURES)
    assert public.counts["/f.npy"] == 2
    for url in (f"http://other.example:{public.port}/f.npy", f"http://{PUBLIC_STAND_IN}:{public.port}/f.npy"):
        with pytest.raises(FeatureFetchError) as info:
            fetch(url, url_policy=only_media)
        assert str(info.value) == refused(url)
    url = f"http://media.example:{public.port}/away"
    with pytest.raises(FeatureFetchError) as info:
        fetch(url, url_policy=only_media)
    assert str(info.value) == refused(url)
    assert public.counts["/away"] == 1 and public.counts["/f.npy"] == 2
    assert "other.example" not in dns.calls  # refused by name, before any lookup
    # the allow-list also applies with --allow-private-media-urls
    private_ok = MediaUrlPolicy.from_config("media.example", True)
    url = f"http://127.0.0.1:{public.port}/f.npy"
    with pytest.raises(FeatureFetchError, match="not allowed by the server's media URL policy"):
        fetch(url, url_policy=private_ok)


# ---- DNS rebinding: the connection goes to the checked address ---------------------------------


def test_dns_rebinding_cannot_swap_the_checked_address(serve_files):
    public = serve_files(PUBLIC_STAND_IN)
    public.files["/f.npy"] = NPY
    internal = serve_files("127.0.0.1", public.port)  # same port, loopback: the rebinding target
    internal.files["/f.npy"] = encode_features(torch.zeros(4, HIDDEN), "npy")
    dns = FakeDns(rebind_example=[[PUBLIC_STAND_IN], ["127.0.0.1"]])
    url = f"http://rebind.example:{public.port}/f.npy"
    assert torch.equal(fetch(url, url_policy=policy(dns)), FEATURES)
    assert dns.calls == ["rebind.example"]  # resolved once, and the checked address was used
    assert public.counts["/f.npy"] == 1 and internal.counts["/f.npy"] == 0
    assert public.hosts == [f"rebind.example:{public.port}"]  # the Host header keeps the name
    # the next lookup answers loopback: refused, nothing sent to the internal server
    with pytest.raises(FeatureFetchError) as info:
        fetch(url, url_policy=policy(dns))
    assert str(info.value) == refused(url)
    assert internal.counts["/f.npy"] == 0


def test_https_connects_to_the_pinned_address_with_the_name_as_sni():
    dns = FakeDns(secure_example=[["93.184.215.14"]])
    client, sent = recording_client()
    data = read_url(
        "https://secure.example/f.npy",
        timeout_s=5,
        max_bytes=1 << 20,
        http_client=client,
        url_policy=MediaUrlPolicy(resolve=dns),
    )
    assert data == NPY
    (request,) = sent
    assert request.url.host == "93.184.215.14" and request.url.scheme == "https"
    assert request.headers["host"] == "secure.example"
    assert request.extensions["sni_hostname"] == "secure.example"


def _tls_contexts(name: str, folder: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) TLS contexts: a test CA, and a certificate for ``name`` only."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool):
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_cert = cert("test CA", ca_key, "test CA", ca_key, True)
    leaf = cert(name, leaf_key, "test CA", ca_key, False)
    pem = serialization.Encoding.PEM
    (folder / "leaf.pem").write_bytes(leaf.public_bytes(pem))
    (folder / "leaf.key").write_bytes(
        leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(folder / "leaf.pem", folder / "leaf.key")
    client = ssl.create_default_context(cadata=ca_cert.public_bytes(pem).decode())
    return server, client


def test_https_verifies_the_certificate_of_the_name_not_the_address(serve_files, tmp_path, caplog):
    server_tls, client_tls = _tls_contexts("secure.example", tmp_path)
    public = serve_files(PUBLIC_STAND_IN, tls=server_tls)
    public.files["/f.npy"] = NPY
    dns = FakeDns(secure_example=[[PUBLIC_STAND_IN]], impostor_example=[[PUBLIC_STAND_IN]])
    with httpx.Client(verify=client_tls, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        kw = {"timeout_s": 5, "max_bytes": 1 << 20, "http_client": client, "url_policy": policy(dns)}
        assert read_url(f"https://secure.example:{public.port}/f.npy", **kw) == NPY
        # another name on the same address: its certificate does not match, so nothing is fetched
        url = f"https://impostor.example:{public.port}/f.npy"
        with pytest.raises(FeatureFetchError) as info:
            read_url(url, **kw)
        assert str(info.value) == failed(url)
    assert public.counts["/f.npy"] == 1
    assert any("certificate verify failed" in r.getMessage() for r in caplog.records)


# ---- one client-facing message for every failure -------------------------------------------------


def test_every_failure_reads_the_same_to_the_client(feature_server, caplog):
    caplog.set_level(logging.WARNING)
    feature_server.files["/garbage.npy"] = b"not a feature file"
    feature_server.files["/big.npy"] = NPY
    feature_server.delays["/slow.npy"] = 2.0
    feature_server.files["/slow.npy"] = NPY
    base = feature_server.url
    local = MediaUrlPolicy(allow_private=True, resolve=FakeDns())  # FakeDns knows no name
    cases = {
        "refused": (f"http://127.0.0.1:{closed_port()}/f.npy", {}),
        "bad file": (f"{base}/garbage.npy", {}),
        "404": (f"{base}/missing.npy", {}),
        "DNS": (f"http://no-such-host.example:{feature_server.port}/f.npy", {}),
        "too large": (f"{base}/big.npy", {"max_bytes": 10}),
        "timeout": (f"{base}/slow.npy", {"timeout_s": 0.3}),
    }
    texts = {}
    for what, (url, kw) in cases.items():
        with pytest.raises(FeatureFetchError) as info:
            fetch(url, url_policy=local, **kw)
        texts[what] = str(info.value).replace(url, "<url>")
    assert set(texts.values()) == {failed("<url>")}, texts
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for detail in (
        "ConnectError",
        "unrecognised feature file",
        "HTTP 404",
        "gaierror",
        "exceeds",
        "timed out",
    ):
        assert detail in logged, detail


def test_downloads_go_direct_not_through_an_environment_proxy(feature_server, monkeypatch):
    """A proxy would resolve the name again, past the address check: feature downloads ignore it."""
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{closed_port()}")
    feature_server.files["/f.npy"] = NPY
    assert torch.equal(fetch(f"{feature_server.url}/f.npy", url_policy=LOCAL), FEATURES)
    assert feature_server.counts["/f.npy"] == 1


# ---- plumbing ----------------------------------------------------------------------------------------


def test_the_chat_server_builds_its_policy_from_the_config():
    from fastdeploy.entrypoints.openai.serving_mm import MultimodalChatInputs

    model = SimpleNamespace(
        allowed_local_media_path=None,
        allowed_media_domains="media.example, cdn.net",
        allow_private_media_urls=True,
        limit_mm_per_prompt={"image": 3},
    )
    engine = SimpleNamespace(
        arch=object(),
        metrics=None,
        config=SimpleNamespace(model=model, cache=SimpleNamespace(encoder_cache_memory=0.01)),
    )
    builder = MultimodalChatInputs(engine).builder
    built = builder.url_policy
    assert built.allowed_domains == ("media.example", "cdn.net") and built.allow_private
    assert builder.limit_per_prompt == {"image": 3}  # (--limit-mm-per-prompt, from the same config)
    model.allow_private_media_urls, model.allowed_media_domains = False, None
    assert MultimodalChatInputs(engine).builder.url_policy == MediaUrlPolicy()
