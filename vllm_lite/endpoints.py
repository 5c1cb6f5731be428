"""Every address decision in one place: engine-core ZMQ endpoints, data-parallel address sets,
private IPC directories and free-port choice.

* A user names an engine core by ONE base address; the core binds two sockets derived from
  it (``CoreAddresses.from_base``): ``tcp://HOST:P`` -> ports P (input) and P+1 (output);
  ``ipc:///PATH`` -> ``/PATH.in`` and ``/PATH.out``.
* A data-parallel daemon of D cores at ``base`` puts core r at ``dp_core_addresses(base, D)[r]``:
  ``tcp://HOST:P`` -> ``P + 2r``; ``ipc:///PATH`` -> ``/PATH`` for rank 0, ``/PATH-dp<r>`` for
  the others. Rank 0 sits at the base, so a single-core frontend can attach to it.
* Private sockets (a frontend's own core, the tensor-parallel executor) live in a fresh
  mode-0700 temp dir (``private_ipc_dir``), so only this user can reach them.
* ``--port 0``: ``reserve_port_run`` binds a run of consecutive ports and KEEPS them bound;
  the sockets are handed to the core processes, which serve on them (``zmq.USE_FD``), so no
  other process can take a port between our choice and its use.
"""

from __future__ import annotations

import socket
import tempfile
from dataclasses import dataclass
from typing import Optional, Sequence, Union

DEFAULT_ENGINE_PORT = 8100


@dataclass
class CoreAddresses:
    """ZMQ endpoints one engine core binds: frontends connect a DEALER to each."""

    input: str
    output: str

    @staticmethod
    def from_base(address: str) -> "CoreAddresses":
        """One user-facing address -> the socket pair (see the module docstring)."""
        if address.startswith("tcp://"):
            host, port = split_tcp(address)
            if not 0 < port < 65535:
                raise ValueError(f"engine address must look like tcp://HOST:PORT (PORT < 65535), got {address!r}.")
            return CoreAddresses(input=f"tcp://{host}:{port}", output=f"tcp://{host}:{port + 1}")
        if address.startswith("ipc://") and len(address) > len("ipc://"):
            return CoreAddresses(input=f"{address}.in", output=f"{address}.out")
        raise ValueError(f"engine address must be tcp://HOST:PORT or ipc:///PATH, got {address!r}.")


def split_tcp(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (HOST, PORT); ValueError naming the expected form otherwise."""
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not address.startswith("tcp://") or not sep or not host or not port.isdigit():
        raise ValueError(f"engine address must look like tcp://HOST:PORT (PORT < 65535), got {address!r}.")
    return host, int(port)


def make_address(host: str, port: Optional[int], address: Optional[str]) -> str:
    """The base address from --address, or from --host/--port."""
    if address:
        return address
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{DEFAULT_ENGINE_PORT if port is None else port}"


def dp_core_addresses(base: str, data_parallel_size: int) -> list[str]:
    """The user-facing address of each data-parallel core of a daemon at ``base`` (rank order)."""
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}.")
    CoreAddresses.from_base(base)  # validates the form
    if data_parallel_size == 1:
        return [base]
    if base.startswith("tcp://"):
        host, port = split_tcp(base)
        last = port + 2 * data_parallel_size - 1
        if last > 65535:
            raise ValueError(f"{data_parallel_size} cores at {base!r} need ports up to {last} (> 65535).")
        return [f"tcp://{host}:{port + 2 * r}" for r in range(data_parallel_size)]
    return [base] + [f"{base}-dp{r}" for r in range(1, data_parallel_size)]


def check_bind_address(address: str, data_parallel_size: int) -> None:
    """ValueError unless a daemon of ``data_parallel_size`` cores can bind at ``address``
    (as ``dp_core_addresses`` demands, plus ``tcp://HOST:0``: free ports chosen at start)."""
    if address.startswith("tcp://") and split_tcp(address)[1] == 0:
        address = address[: -len("0")] + "1"  # the form and D are checked; the ports are chosen later
    dp_core_addresses(address, data_parallel_size)


def split_addresses(address: Union[str, Sequence[str]], data_parallel_size: int = 1) -> list[str]:
    """``address`` as a list of core addresses: a list as given, a comma-separated string, or a base + D."""
    if isinstance(address, str):
        parts = [a.strip() for a in address.split(",") if a.strip()]
    elif isinstance(address, (list, tuple)) and all(isinstance(a, str) for a in address):
        parts = list(address)
    else:
        raise TypeError(f"engine address must be a string or a list of strings, got {address!r}.")
    if not parts:
        raise ValueError("engine address is empty.")
    if len(parts) == 1:
        return dp_core_addresses(parts[0], data_parallel_size)
    if data_parallel_size not in (1, len(parts)):
        raise ValueError(f"got {len(parts)} engine addresses but data_parallel_size={data_parallel_size}.")
    for a in parts:
        CoreAddresses.from_base(a)
    return parts


# ---------------------------------------------------------------------------- private IPC


def private_ipc_dir(prefix: str = "vllm-lite-") -> str:
    """A fresh temp dir of mode 0700 for sockets only this user may reach; the caller removes it."""
    return tempfile.mkdtemp(prefix=prefix)


def ipc_address(directory: str, name: str) -> str:
    return f"ipc://{directory}/{name}"


def private_core_addresses(directory: str) -> CoreAddresses:
    """The socket pair of a frontend's private engine core, inside ``directory``."""
    return CoreAddresses(input=ipc_address(directory, "input.sock"), output=ipc_address(directory, "output.sock"))


# ---------------------------------------------------------------------------- TCP ports


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET


def bind_listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound and listening on ``host:port`` (port 0: the kernel picks), inheritable.

    Raises ValueError naming the address when it is taken.
    """
    h = host.strip("[]")
    sock = socket.socket(_family(h), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((h, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from e
    sock.set_inheritable(True)
    return sock


@dataclass
class PortRun:
    """``count`` consecutive ports from ``first``, each held by a listening socket until ``close()``."""

    host: str
    first: int
    sockets: list[socket.socket]

    def fds(self) -> list[int]:
        return [s.fileno() for s in self.sockets]

    def close(self) -> None:
        for s in self.sockets:
            s.close()
        self.sockets = []


def reserve_port_run(host: str, count: int, attempts: int = 100) -> PortRun:
    """Bind ``count`` consecutive free ports on ``host`` and keep them (no bind-and-release race)."""
    for _ in range(attempts):
        first_sock = bind_listening_socket(host, 0)
        first = first_sock.getsockname()[1]
        held = [first_sock]
        try:
            if first + count > 65536:
                raise ValueError("run would pass port 65535")
            for p in range(first + 1, first + count):
                held.append(bind_listening_socket(host, p))
            return PortRun(host, first, held)
        except ValueError:
            for s in held:
                s.close()
    raise RuntimeError(f"could not find {count} consecutive free ports on {host}.")


def resolve_port_zero(address: str, data_parallel_size: int) -> tuple[str, Optional[PortRun]]:
    """``tcp://HOST:0`` -> a base address on reserved ports for every core's socket pair (and the
    reservation, which the caller hands to the cores, then closes); other addresses unchanged."""
    if not address.startswith("tcp://") or split_tcp(address)[1] != 0:
        return address, None
    host = split_tcp(address)[0]
    run = reserve_port_run(host, 2 * data_parallel_size)
    return f"tcp://{host}:{run.first}", run
