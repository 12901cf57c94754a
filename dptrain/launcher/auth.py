"""The job's secret, and the handshake that proves it between the launchers of a job's nodes.

[Note: only the job gets in]
Anything that can reach node 0's rendezvous port could read every key, stop the job by
writing ``launcher/failed/<k>``, or join it as a rank (torch's ``TCPStore`` client has no way
to prove anything). A job on several nodes therefore takes a secret, the same on every node
(``--secret-file``, ``DPTRAIN_SECRET_FILE`` or ``DPTRAIN_SECRET``), and the store is reached
from the network only through connections that proved they know it:

* node 0 hosts the store on 127.0.0.1 only; its ranks and its launcher talk to it there. A
  gate (``tunnel.Gate``) listens on ``--master-addr:--master-port`` and pipes a connection to
  the store only once it passed the handshake below; any other is closed with no answer but
  the gate's challenge;
* every other node's launcher runs a forwarder (``tunnel.Forwarder``) on 127.0.0.1: its ranks
  get ``MASTER_ADDR=127.0.0.1`` and the forwarder's port (torchrun's variables, so scripts and
  torch's own ``TCPStore`` client work unchanged), and each of their connections goes to the
  gate over a new connection that passes the handshake. The launcher's own client
  (``StoreClient``) passes it itself;
* the ranks never see the secret (their environment goes without it).

The handshake (version 1), on a new connection to the gate, the gate speaking first::

    gate   -> client: b"DPTA" version nonce_s                          (4 + 1 + 32 bytes)
    client -> gate:   b"DPTA" version nonce_c proof_c                  (4 + 1 + 32 + 32)
    gate   -> client: proof_s, or REFUSED when proof_c is wrong          (32)

    proof_c = HMAC-SHA256(secret, b"dptrain auth v1 client" + nonce_s + nonce_c)
    proof_s = HMAC-SHA256(secret, b"dptrain auth v1 server" + nonce_s + nonce_c)

Both nonces are fresh random bytes, so a recorded answer proves nothing on another connection
(no replay); the two labels differ, so one side's proof is never the other's (no
reflection); the gate checks ``proof_c`` (``hmac.compare_digest``) before it sends anything
but its challenge, and the client checks ``proof_s`` before it sends a byte of a rank's, so
each side knows it talks to the job (mutual). A gate that finds ``proof_c`` wrong says
``REFUSED`` (a fixed 32 bytes no HMAC is expected to equal) before it closes: the node then
knows that its secret does not match (``AuthMismatch``, final), where a connection closed or
cut during the handshake (``AuthClosed``: a flood evicted it, see [Note: a flood of silent
connections] in ``_admission``) is worth another try. REFUSED proves nothing (anyone on the
path could send it), but whoever can forge it could also cut the connection. A TCPStore client's first bytes are not the
magic, so it is closed at once (and reads the challenge as a wrong answer to its ping). The proofs do not cover the addresses: NAT and container port
maps change them on the way, and binding them would stop real jobs. What it does not give is
what TLS would: an attacker on the path between two nodes, who can read and change the
traffic, can still take over a connection after the handshake, as it can take over gloo's and
NCCL's own connections, which trust the network (as in PyTorch).

Why a gate in front of the store, not a step of the store's own parser: the store is
sometimes torch's (``DPTRAIN_STORE=torch``, or a torch newer than dptrain's server was tested
with), and the gate guards either; the store stays one idea. The price is one more hop on
loopback for the other nodes' requests (see ``benchmarks/RESULTS.md``). Why not TLS: Python's
``ssl`` takes a pre-shared key only from 3.13 on, certificates would need an authority per
job, and what keeps outsiders out is authentication; encrypting the store alone would not make
gloo's and NCCL's traffic private.

A single node needs no secret: its store listens on 127.0.0.1 only, and nothing of the job
listens on the network (gloo is pointed at the loopback interface). On loopback the store, the
forwarder and the gate let in only the job's own user (see [Note: only the job's own user on
loopback] in ``_admission``); gloo's own connections there are open to every local user.

Pure functions and generators here (no sockets of their own): ``server`` and ``client`` are the
two sides as generators that say what to send and how many bytes they need next, driven by
``tunnel``'s event loop, and ``run_blocking`` drives one over a blocking socket (``StoreClient``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
import time
from typing import Generator, Mapping

from dptrain.runtime import settings as _settings

__all__ = ["AuthError", "AuthMismatch", "AuthClosed", "load_secret", "server", "client", "run_blocking", "MAGIC", "VERSION", "HANDSHAKE_S",
           "GENERATE"]

MAGIC = b"DPTA"
VERSION = 1
NONCE = 32
PROOF = 32  # SHA-256
HEAD = len(MAGIC) + 1
#: Seconds either side waits for the other's part of the handshake.
HANDSHAKE_S = 10.0
#: What the gate answers a wrong proof with, instead of its own proof.
REFUSED = b"DPTA:refused:secret-not-matching"
assert len(REFUSED) == PROOF
#: The shortest secret taken, in bytes (the same rule as ``DPTRAIN_SECRET``'s).
MIN_CHARS = _settings.MIN_SECRET_CHARS
#: A command that writes a good secret file (shown in messages and docs).
GENERATE = "(umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > job.secret)"
_LABEL = b"dptrain auth v%d " % VERSION

#: What a handshake step asks of its driver: bytes to send first, then how many bytes to read.
Step = Generator[tuple[bytes, int], bytes, None]


class AuthError(Exception):
    """The other side did not prove it knows the job's secret (or speaks another protocol)."""


class AuthMismatch(AuthError):
    """The secrets differ: the gate refused this side's proof, or the gate's proof is wrong."""


class AuthClosed(AuthError):
    """The connection closed, broke or went silent during the handshake: nothing was proved
    either way, so another try may pass (see [Note: a flood of silent connections] in ``_admission``).

    ``heard``: whether the gate's challenge had arrived (a dptrain gate answered).
    """

    def __init__(self, message: str, heard: bool = False) -> None:
        super().__init__(message)
        self.heard = heard


# -- the secret ---------------------------------------------------------------------------------
def load_secret(path: str | None = None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret: the file ``path`` (``--secret-file``), else ``DPTRAIN_SECRET_FILE``, else
    ``DPTRAIN_SECRET``; None when none is given.

    A file must be a regular file (a FIFO, a directory or a device is refused without waiting on
    it; a link is followed) that only its owner can read or write (mode 0600 or 0400, as
    ssh asks of a private key), owned by this user (or root), and hold at least ``MIN_CHARS``
    characters besides the surrounding white space.

    Raises:
        ValueError: one line naming the file or variable, what is wrong and the fix (a
            ``SettingError`` for a malformed variable).
    """
    environ = os.environ if environ is None else environ
    where = f"--secret-file {path}"
    if not path:
        path = _settings.get("DPTRAIN_SECRET_FILE", environ)
        where = f"DPTRAIN_SECRET_FILE={path}"
    if not path:
        text = _settings.get("DPTRAIN_SECRET", environ)
        return text.encode() if text else None
    path = os.path.expanduser(path)
    try:
        # Never blocking on a FIFO or a device, and refused unless a regular file: see [Note: opening
        # a file dptrain did not make] in dptrain.runtime.settings. A link is followed: the user named this
        # file, and a secret mounted by Kubernetes or kept in a vault's folder is reached through one.
        fd = _settings.open_regular(path)
    except _settings.NotRegularFile as exc:
        raise ValueError(f"{where} is {exc.kind}, not a regular file; give the file that holds the job's secret, "
                         f"e.g. one made with {GENERATE}") from None
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc.strerror}); create it with {GENERATE}") from None
    try:
        info = os.fstat(fd)
        if info.st_mode & 0o077:
            raise ValueError(f"{where} can be read or written by other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                             f"a secret must be the owner's alone: chmod 600 {path}")
        if hasattr(os, "geteuid") and info.st_uid not in (os.geteuid(), 0):
            raise ValueError(f"{where} belongs to another user (uid {info.st_uid}); use a file of your own")
        data = os.read(fd, 64 * 1024).strip()
    finally:
        os.close(fd)
    if len(data) < MIN_CHARS:
        raise ValueError(f"{where} holds {len(data)} characters; a secret needs at least {MIN_CHARS}: {GENERATE}")
    return data


# -- the handshake ------------------------------------------------------------------------------
def _proof(secret: bytes, side: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, _LABEL + side + nonce_s + nonce_c, hashlib.sha256).digest()


def _check_head(head: bytes, other: str) -> None:
    if head[:len(MAGIC)] != MAGIC:
        raise AuthError(f"{other} does not speak dptrain's authentication")
    if head[len(MAGIC)] != VERSION:
        raise AuthError(f"{other} speaks version {head[len(MAGIC)]} of dptrain's authentication, this node "
                        f"{VERSION}: install the same dptrain on every node")


def server(secret: bytes) -> Step:
    """The gate's side. Raises ``AuthError`` when the client fails; returns once it passed."""
    nonce_s = secrets.token_bytes(NONCE)
    head = yield MAGIC + bytes([VERSION]) + nonce_s, HEAD
    _check_head(head, "the client")
    rest = yield b"", NONCE + PROOF
    nonce_c, proof_c = rest[:NONCE], rest[NONCE:]
    if not hmac.compare_digest(proof_c, _proof(secret, b"client", nonce_s, nonce_c)):
        yield REFUSED, 0  # the driver sends it before it closes
        raise AuthMismatch("the client does not know the job's secret")
    yield _proof(secret, b"server", nonce_s, nonce_c), 0


def client(secret: bytes) -> Step:
    """The side of a node that connects to the gate. Raises ``AuthError`` when the gate fails."""
    nonce_c = secrets.token_bytes(NONCE)
    head = yield b"", HEAD
    _check_head(head, "the rendezvous")
    nonce_s = yield b"", NONCE
    answer = MAGIC + bytes([VERSION]) + nonce_c + _proof(secret, b"client", nonce_s, nonce_c)
    proof_s = yield answer, PROOF
    if proof_s == REFUSED:
        raise AuthMismatch("the secret does not match: the rendezvous refused this node's proof")
    if not hmac.compare_digest(proof_s, _proof(secret, b"server", nonce_s, nonce_c)):
        raise AuthMismatch("the rendezvous does not know the job's secret")


def run_blocking(sock: socket.socket, step: Step, timeout_s: float = HANDSHAKE_S) -> None:
    """Drive ``step`` over the blocking socket ``sock`` within ``timeout_s``.

    Raises ``AuthMismatch`` (the secrets differ), ``AuthClosed`` (the connection closed or broke
    during the handshake, or went silent after the other side spoke: worth another try) or
    ``AuthError`` (another protocol, another version, or no word at all within the time); the
    socket is left in blocking mode without a timeout.
    """
    deadline = time.monotonic() + timeout_s
    data = None
    heard = False
    try:
        while True:
            send, need = step.send(data)
            if send:
                sock.sendall(send)
            data = b""
            while len(data) < need:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout()
                sock.settimeout(left)
                chunk = sock.recv(need - len(data))
                if not chunk:
                    raise AuthClosed("the rendezvous closed the connection during the handshake", heard)
                heard = True
                data += chunk
    except StopIteration:
        return
    except socket.timeout:
        if heard:
            raise AuthClosed(f"no answer to the handshake within {timeout_s:g}s", heard) from None
        # Not a word: a gate sends its challenge as soon as it accepts, so this is something else.
        raise AuthError(f"no challenge within {timeout_s:g}s: it is not a dptrain gate (is node 0 run without "
                        f"a secret?)") from None
    except OSError as exc:
        raise AuthClosed(f"the connection broke during the handshake ({exc.strerror or exc})", heard) from None
    finally:
        sock.settimeout(None)
