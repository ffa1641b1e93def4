"""A throwaway PostgreSQL server on loopback, for tests that capture its changes with Debezium.

The server is the machine's own PostgreSQL (Debian's ``postgresql`` package: ``/usr/lib/postgresql/<n>/bin``, or
``initdb`` and ``postgres`` on PATH), initialised into a new temporary folder with ``wal_level=logical`` and trust
authentication on 127.0.0.1, and removed with it when stopped.

PostgreSQL refuses to run as root. As root, the server runs as the unprivileged OS user ``postgres`` (which the
Debian package creates; ``nobody`` otherwise), in a folder of its own under the system's temporary directory (a
test's ``tmp_path`` is private to root). The postmaster is a child of this process rather than a daemon started by
``pg_ctl``: the kernel kills it if this process dies (``PR_SET_PDEATHSIG``), so a killed test run leaves no server
behind; :meth:`EmbeddedPostgres.stop` shuts it down with a fast shutdown, as ``pg_ctl stop -m fast`` does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from replica_dev.embedded_kafka import die_with, free_port
from replica_lib.errors import SetupError

logger = logging.getLogger(__name__)

_DEBIAN_ROOT = Path("/usr/lib/postgresql")
_INSTALL = "install PostgreSQL (apt-get install postgresql)"
#: The line of ``postmaster.pid`` that says the server accepts connections (what ``pg_ctl -w`` waits for).
_PID_FILE_STATUS_LINE = 7
#: Settings for a disposable server: logical decoding for Debezium, no durability, a small footprint.
_SETTINGS = {
    "wal_level": "logical",
    "max_wal_senders": "8",
    "max_replication_slots": "8",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "shared_buffers": "32MB",
    "max_connections": "30",
    "listen_addresses": "127.0.0.1",
}


@dataclass(frozen=True)
class PostgresBinaries:
    """One PostgreSQL installation's server programs."""

    bindir: Path
    version: int

    @property
    def initdb(self) -> Path:
        return self.bindir / "initdb"

    @property
    def postgres(self) -> Path:
        return self.bindir / "postgres"


def find_binaries() -> PostgresBinaries:
    """The newest PostgreSQL server on this machine (Debian's layout first, then PATH), or say how to get one."""
    candidates = sorted(_DEBIAN_ROOT.glob("*/bin"), key=lambda p: _major(p.parent.name), reverse=True)
    on_path = shutil.which("postgres")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return PostgresBinaries(bindir, _version(bindir / "postgres"))
    raise SetupError(
        f"no PostgreSQL server found (initdb and postgres, in {_DEBIAN_ROOT}/*/bin or on PATH): {_INSTALL}"
    )


def _major(text: str) -> int:
    return int(text) if text.isdigit() else 0


def _version(postgres: Path) -> int:
    try:
        out = subprocess.run([str(postgres), "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"cannot run {postgres} ({exc}): {_INSTALL}") from exc
    match = re.search(r"\) (\d+)", out.stdout)
    if not match:
        raise SetupError(f"{postgres} --version said {out.stdout.strip()!r}, not a PostgreSQL version: {_INSTALL}")
    return int(match.group(1))


def _server_user() -> pwd.struct_passwd | None:
    """The OS user the server runs as: None (this one) unless this is root, which PostgreSQL refuses."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise SetupError(
        f"running as root, and no unprivileged 'postgres' or 'nobody' user to run PostgreSQL as: {_INSTALL}"
    )


class EmbeddedPostgres:
    """One PostgreSQL server with its data in a new temporary folder; a context manager for tests.

    Superuser ``postgres`` (no password: trust on 127.0.0.1, replication connections too), database
    ``postgres``, on :attr:`port`.
    """

    user = "postgres"
    database = "postgres"

    def __init__(self, start_timeout_s: float = 60.0) -> None:
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.data_dir: Path | None = None
        self._base: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.binaries: PostgresBinaries | None = None

    @property
    def conninfo(self) -> str:
        """A libpq connection string (what psycopg takes)."""
        return f"host=127.0.0.1 port={self.port} user={self.user} dbname={self.database}"

    def start(self) -> EmbeddedPostgres:
        """Initialise a new cluster and start it; raises :class:`SetupError` unless it accepts connections in time."""
        self.binaries = find_binaries()
        account = _server_user()
        self._base = Path(tempfile.mkdtemp(prefix="replica-postgres-"))
        self.data_dir = self._base / "data"
        if account is not None:
            os.chown(self._base, account.pw_uid, account.pw_gid)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "TZ": "UTC"}
        uid, gid = (None, None) if account is None else (account.pw_uid, account.pw_gid)
        groups: list[int] | None = None if account is None else []
        init = [str(self.binaries.initdb), "-D", str(self.data_dir), "-U", self.user, "--auth=trust"]
        init += ["--encoding=UTF8", "--no-locale", "--no-sync"]
        try:
            done = subprocess.run(
                init,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
                env=env,
                user=uid,
                group=gid,
                extra_groups=groups,
            )
        except subprocess.TimeoutExpired as exc:
            self._remove()
            raise SetupError(f"initdb into {self.data_dir} took over 120 s") from exc
        if done.returncode != 0:
            self._remove()
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            raise SetupError(f"initdb into {self.data_dir} failed: {tail}")
        self.port = free_port()
        settings = {**_SETTINGS, "port": str(self.port), "unix_socket_directories": str(self._base)}
        cmd = [str(self.binaries.postgres), "-D", str(self.data_dir)]
        for key, value in settings.items():
            cmd += ["-c", f"{key}={value}"]
        log = (self._base / "server.log").open("ab")
        parent = os.getpid()
        self._proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=die_with(parent),  # runs after the switch to the server user, which clears the signal
            user=uid,
            group=gid,
            extra_groups=groups,
        )
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.info("PostgreSQL %d ready on 127.0.0.1:%d (pid %d)", self.binaries.version, self.port, self._proc.pid)
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None and self.data_dir is not None
        pid_file = self.data_dir / "postmaster.pid"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SetupError(
                    f"PostgreSQL exited with code {self._proc.returncode} while starting: {self._log_tail()}"
                )
            with contextlib.suppress(OSError):
                lines = pid_file.read_text().splitlines()
                if len(lines) > _PID_FILE_STATUS_LINE and lines[_PID_FILE_STATUS_LINE].strip() == "ready":
                    return
            time.sleep(0.1)
        raise SetupError(
            f"PostgreSQL did not accept connections within {self.start_timeout_s:.0f} s: {self._log_tail()}"
        )

    def _log_tail(self) -> str:
        if self._base is None:
            return ""
        with contextlib.suppress(OSError):
            return " | ".join((self._base / "server.log").read_text(errors="replace").strip().splitlines()[-3:])
        return ""

    def stop(self) -> None:
        """Fast shutdown (roll back open transactions, disconnect clients), then remove the data folder."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        self._remove()

    def _remove(self) -> None:
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)
            self._base = None

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
