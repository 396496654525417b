"""Parameter-server authentication and exposure checks: tokens, bind addresses, TLS material.

A shard and its clients share a token (``x-stratagem-token`` call metadata, compared in
constant time before the request body is read). The token comes from an argument, else
the file named by ``STRATAGEM_PS_TOKEN_FILE`` (what launcher-started shards hand to their
workers: the token never appears on a command line), else ``STRATAGEM_PS_TOKEN``. An empty
or whitespace-only token is an error, never "no authentication".
"""

from __future__ import annotations

import ipaddress
import os
import ssl
import stat
import tempfile
from pathlib import Path

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "resolve_token", "read_token_file", "is_loopback",
           "is_unspecified", "exposure_warning", "read_pem", "check_tls_pair",
           "ALLOW_PLAINTEXT_ENV", "check_token_transport"]

TOKEN_ENV = "STRATAGEM_PS_TOKEN"
TOKEN_FILE_ENV = "STRATAGEM_PS_TOKEN_FILE"
#: ``1``: let a client send its token without TLS to non-loopback shards (see
#: :func:`check_token_transport`); the environment form of ``allow_plaintext=True``.
ALLOW_PLAINTEXT_ENV = "STRATAGEM_PS_ALLOW_PLAINTEXT"
#: Largest token file read (a token is a few dozen characters).
MAX_TOKEN_FILE_BYTES = 4096


def _check(token: str, source: str) -> str:
    if not isinstance(token, str):
        raise TypeError(f"parameter-server token must be a string, got {type(token).__name__} "
                        f"from {source}")
    if not token.strip():
        raise ValueError(f"parameter-server token from {source} is empty or whitespace "
                         f"({token!r}), which would disable authentication. Fix: put a random "
                         "secret there (e.g. python -c 'import secrets; "
                         "print(secrets.token_urlsafe(32))'), or unset it to run without one")
    return token


def read_token_file(path: str | os.PathLike[str], *, source: str = "--token-file") -> str:
    """The token in ``path`` (surrounding whitespace stripped); errors name the file.

    Refused (``ValueError`` with the fix): a file that is not a regular file (a FIFO, a
    device, a directory: opened without blocking, so a FIFO cannot hang the caller), and a
    file that other users may read or write (any group or other permission bit: ``chmod 600``
    it). A token others can read is no secret."""
    where = f"{source}={str(path)!r}"
    try:
        # O_NONBLOCK: opening a FIFO with no writer would otherwise block forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"cannot read the parameter-server token file {where}: {exc}. Fix: "
                         "point it at a readable UTF-8 file holding the token") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"parameter-server token file {where} is not a regular file "
                             f"(mode {stat.filemode(st.st_mode)}); refused. Fix: write the "
                             "token to a regular file readable only by you (chmod 600)")
        if st.st_mode & 0o077:
            raise ValueError(f"parameter-server token file {where} is accessible to other "
                             f"users (mode {stat.S_IMODE(st.st_mode):03o}); a token others can "
                             f"read is no secret. Fix: chmod 600 {str(path)!r}")
        if st.st_size > MAX_TOKEN_FILE_BYTES:
            raise ValueError(f"parameter-server token file {where} holds {st.st_size} bytes, "
                             f"more than a token (at most {MAX_TOKEN_FILE_BYTES}). Fix: point "
                             "it at the file holding only the token")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_TOKEN_FILE_BYTES + 1)
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the parameter-server token file {where}: {exc}. Fix: "
                         "point it at a readable UTF-8 file holding the token") from None
    finally:
        os.close(fd)
    return _check(text.strip(), where)


def resolve_token(token: str | None) -> str | None:
    """``token``, else the file in ``STRATAGEM_PS_TOKEN_FILE``, else ``STRATAGEM_PS_TOKEN``,
    else None (no authentication). Blank values anywhere raise ``ValueError``.

    The file comes first because a launcher sets it for its own job's shards, which must win
    over a token the user exported for shards of their own."""
    if token is not None:
        return _check(token, "token=")
    path = os.environ.get(TOKEN_FILE_ENV)
    if path is not None:
        return read_token_file(path, source=TOKEN_FILE_ENV)
    env = os.environ.get(TOKEN_ENV)
    if env is not None:
        return _check(env, TOKEN_ENV)
    return None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    h = host.strip().strip("[]")
    if "%" in h:  # scoped IPv6 (fe80::1%eth0)
        h = h.split("%", 1)[0]
    try:
        return ipaddress.ip_address(h)
    except ValueError:
        return None


def is_unspecified(host: str) -> bool:
    """Binds every interface: ``0.0.0.0``, ``::``, ``::0``, ``[::]``, ``0:0:...:0``, ``""``."""
    if not host.strip().strip("[]"):
        return True
    ip = _ip(host)
    return ip is not None and ip.is_unspecified


def is_loopback(host: str) -> bool:
    """Only this machine can connect (127.0.0.0/8, ``::1``, ``localhost``)."""
    if host.strip().strip("[]").lower() in ("localhost", "localhost.localdomain"):
        return True
    ip = _ip(host)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip is not None and ip.is_loopback


def exposure_warning(host: str, *, token: bool, tls: bool) -> str | None:
    """The warning a shard binding ``host`` deserves, or None (loopback, or token + TLS)."""
    if is_loopback(host):
        return None
    where = ("every network interface" if is_unspecified(host)
             else f"non-loopback address {host!r}")
    if not token:
        return (f"parameter-server shard binding {host!r} listens on {where} without a token "
                "(set STRATAGEM_PS_TOKEN or --token-file): anyone who can reach it can read or "
                "overwrite the model and shut the shard down. Fix: bind 127.0.0.1, or set a "
                "token and TLS (--tls-cert/--tls-key)")
    if not tls:
        return (f"parameter-server shard binding {host!r} listens on {where} with a token but "
                "without TLS: the token and every tensor cross the network in clear text. "
                "Fix: pass --tls-cert/--tls-key (and STRATAGEM_PS_TLS_ROOT_CERT on workers)")
    return None


def check_token_transport(addresses: list[str], *, token: bool, tls: bool,
                          allow_plaintext: bool | None) -> None:
    """Refuse (``ValueError``) to send a token in clear text to a shard off this machine.

    A token without TLS crosses the network readable by anyone on the path, who can then
    read or overwrite the model. Loopback addresses (127.0.0.0/8, ``::1``, ``localhost``) are
    fine; anything else needs TLS (``tls_root_cert`` / ``STRATAGEM_PS_TLS_ROOT_CERT``) or an
    explicit ``allow_plaintext=True`` (``STRATAGEM_PS_ALLOW_PLAINTEXT=1``: a network you
    trust, e.g. a private cluster fabric). ``allow_plaintext=None`` reads the environment."""
    if not token or tls:
        return
    if allow_plaintext is None:
        allow_plaintext = os.environ.get(ALLOW_PLAINTEXT_ENV, "") == "1"
    if allow_plaintext:
        return
    for a in addresses:
        host = a.rpartition(":")[0]
        if not is_loopback(host):
            raise ValueError(
                f"refusing to send the parameter-server token in clear text to {a!r}: it is "
                "not a loopback address and the client has no TLS, so anyone on the network "
                "path could read the token. Fix: serve the shards with --tls-cert/--tls-key "
                "and set STRATAGEM_PS_TLS_ROOT_CERT (or tls_root_cert=) on the workers, or, on "
                f"a network you trust, pass allow_plaintext=True ({ALLOW_PLAINTEXT_ENV}=1)")


def read_pem(data: bytes | str | os.PathLike[str], what: str) -> bytes:
    """PEM bytes given directly or by path; a missing file is named as TLS material."""
    if isinstance(data, bytes):
        return data
    try:
        return Path(data).read_bytes()
    except OSError as exc:
        raise ValueError(f"TLS {what} {str(data)!r} cannot be read ({exc.strerror or exc}). "
                         f"Fix: pass the path of a PEM {what}") from None


def check_tls_pair(cert: bytes, key: bytes) -> None:
    """Raise ``ValueError`` (a TLS error, not a bind error) unless ``cert``/``key`` are a
    matching PEM certificate chain and private key."""
    if b"-----BEGIN" not in cert or b"CERTIFICATE-----" not in cert:
        raise ValueError("TLS certificate is not a PEM certificate (no '-----BEGIN "
                         "CERTIFICATE-----' block). Fix: pass the PEM certificate as tls_cert")
    if b"PRIVATE KEY-----" not in key:
        raise ValueError("TLS key is not a PEM private key (no '-----BEGIN ... PRIVATE "
                         "KEY-----' block). Fix: pass the PEM private key as tls_key")
    # The ssl module checks a pair only from files: a private 0700 directory, removed at once.
    with tempfile.TemporaryDirectory(prefix="stratagem-tls-") as d:
        cp, kp = Path(d, "cert.pem"), Path(d, "key.pem")
        for p, data in ((cp, cert), (kp, key)):
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(cp), str(kp))
        except ssl.SSLError as exc:
            raise ValueError(f"TLS certificate/key refused: {exc.reason or exc} (a corrupt PEM, "
                             "an encrypted key, or a key that does not match the certificate). "
                             "Fix: pass the matching unencrypted PEM pair") from None
