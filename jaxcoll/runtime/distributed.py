"""Multi-process start-up: ``jax.distributed`` with cluster detection.

:func:`initialize` joins this process to a multi-process JAX job, choosing
the settings in this order:

1. Explicit settings from the environment, as ``python -m jaxcoll.launch``
   sets them: ``JAXCOLL_COORDINATOR`` (``host:port`` of process 0),
   ``JAXCOLL_NUM_PROCESSES`` and ``JAXCOLL_PROCESS_ID``.
2. A cluster, detected as JAX detects it and in JAX's order: Open MPI
   (``mpirun``: ``OMPI_MCA_orte_hnp_uri``), then Slurm (a job step with
   ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``,
   ``SLURM_PROCID``, ``SLURM_LOCALID``), with more than one process. Open
   MPI 5 sets no ``OMPI_MCA_orte_hnp_uri``: there the count and id come
   from ``OMPI_COMM_WORLD_SIZE`` / ``_RANK`` and the coordinator from
   ``JAXCOLL_COORDINATOR``, which must then be set.
3. Otherwise a single process: nothing to do.

The coordinator, count and id found are handed to ``jax.distributed`` with
its own detection off, so each process keeps every local device visible
(JAX's detection would restrict a process to the GPU of its local rank):
one process per host drives all the host's GPUs; with one task per GPU the
scheduler's ``CUDA_VISIBLE_DEVICES`` already gives each its own.

On CPU the cross-process collectives go through gloo, each all-reduce a collective of its
own (:func:`keep_cpu_all_reduces_apart`). ``JAXCOLL_CPU_DEVICES``
(the CPU simulation mode, see :mod:`jaxcoll.devices`) is honoured, so each
process of a launched job exposes that many CPU devices.

Start-up never hangs: if the other processes do not all connect within the
initialisation timeout (``timeout_s``, else ``JAXCOLL_INIT_TIMEOUT_S``, else
300 s), the process prints one clear error line and exits with status 75.
Once started, a process whose peer dies (SIGKILL, the OOM killer, a lost
host) ends at once with one line and exit 76 (:mod:`jaxcoll.runtime.liveness`);
one whose peer hangs is aborted by JAX (SIGABRT) after the heartbeat
timeout: ``JAXCOLL_HEARTBEAT_TIMEOUT_S``, default 100 s, or more when
:func:`initialize` is asked for more (``experiments.train`` asks for twice
its watchdog's longest limit plus 30 s, so that a hung peer ends in the
watchdog's exit 86 and its message first).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import math
import os
import re
import socket
import subprocess
import sys
import threading

import jax

from jaxcoll import checks, errors
from jaxcoll.runtime import devices

ENV_COORDINATOR = "JAXCOLL_COORDINATOR"
ENV_NUM_PROCESSES = "JAXCOLL_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXCOLL_PROCESS_ID"
ENV_INIT_TIMEOUT_S = "JAXCOLL_INIT_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT_S = "JAXCOLL_HEARTBEAT_TIMEOUT_S"
ENV_RESTART = "JAXCOLL_RESTART"

DEFAULT_INIT_TIMEOUT_S = 300.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
# Exit status of a process whose peers did not all connect in time.
INIT_TIMEOUT_EXIT_CODE = errors.EXIT_INIT_TIMEOUT  # 75, EX_TEMPFAIL: retrying the job may help.
# JAX's own connect deadline runs this much after ours, so that our watchdog
# (a clear message) fires before JAX aborts the process (SIGABRT, stack dump).
_JAX_TIMEOUT_MARGIN_S = 10

_LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
  """Where this process stands in the job.

  Attributes:
    process_id: index of this process, in ``0..num_processes - 1``.
    num_processes: number of processes in the job (1 for a single process).
    coordinator: ``host:port`` of the coordinator (process 0), or None for
      a single process.
    method: how the settings were found: ``"env"`` (``JAXCOLL_*``),
      ``"ompi"``, ``"slurm"`` or ``"single"``.
    cpu_devices: ``JAXCOLL_CPU_DEVICES`` when set (CPU simulation mode).
    restart: ``JAXCOLL_RESTART``, the launcher's attempt number (0 first).
  """

  process_id: int
  num_processes: int
  coordinator: str | None
  method: str
  cpu_devices: int | None = None
  restart: int = 0

  @property
  def is_multiprocess(self) -> bool:
    return self.num_processes > 1


_info: ClusterInfo | None = None
_heartbeat_s: int | None = None  # JAX's heartbeat timeout, once initialize() started a job
_lock = threading.Lock()


def _int_env(name: str, *, minimum: int, example: str) -> int | None:
  value = os.environ.get(name)
  if value is None or value.strip() == "":
    return None
  try:
    number = int(value)
  except ValueError:
    number = None
  if number is None or number < minimum:
    raise ValueError(
      f"`{name}` must be an integer >= {minimum}, got {value!r}; "
      f"set e.g. {name}={example} or unset it."
    )
  return number


def _check_timeout(value, what: str) -> float:
  seconds = checks.finite_number(value)
  if seconds is None or not seconds > 0:
    raise ValueError(
      f"`{what}` must be a positive number of seconds, got {value!r}; e.g. {what}=60."
    )
  return seconds


def _init_timeout(timeout_s) -> float:
  if timeout_s is not None:
    return _check_timeout(timeout_s, "timeout_s")
  value = os.environ.get(ENV_INIT_TIMEOUT_S)
  if value is None or value.strip() == "":
    return DEFAULT_INIT_TIMEOUT_S
  return _check_timeout(value, ENV_INIT_TIMEOUT_S)


def parse_coordinator(value: str, what: str = ENV_COORDINATOR) -> tuple[str, int]:
  """Splits ``host:port`` (``[v6addr]:port`` for IPv6) and checks the port."""
  host, sep, port_text = value.strip().rpartition(":")
  try:
    port = int(port_text)
  except ValueError:
    port = -1
  if not sep or not host or not 1 <= port <= 65535:
    raise ValueError(
      f"`{what}` must be host:port with a port in 1..65535, got {value!r}; "
      f"e.g. {what}=127.0.0.1:12345 (the address of process 0)."
    )
  return host, port


def _is_loopback(host: str) -> bool:
  return host.startswith("127.") or host in _LOOPBACK_HOSTS


def _explicit_settings() -> tuple[str, int, int] | None:
  """(coordinator, num_processes, process_id) from JAXCOLL_*, or None."""
  coordinator = os.environ.get(ENV_COORDINATOR, "").strip() or None
  num = _int_env(ENV_NUM_PROCESSES, minimum=1, example="2")
  pid = _int_env(ENV_PROCESS_ID, minimum=0, example="0")
  if coordinator is None and num in (None, 1) and pid in (None, 0):
    return None
  missing = [
    name
    for name, value in (
      (ENV_COORDINATOR, coordinator),
      (ENV_NUM_PROCESSES, num),
      (ENV_PROCESS_ID, pid),
    )
    if value is None
  ]
  if missing:
    raise ValueError(
      f"multi-process settings are incomplete: {', '.join(missing)} not set "
      f"(have {ENV_COORDINATOR}={coordinator!r}, {ENV_NUM_PROCESSES}={num!r}, "
      f"{ENV_PROCESS_ID}={pid!r}); set all three, or start the job with "
      "`python -m jaxcoll.launch`."
    )
  parse_coordinator(coordinator)
  if pid >= num:
    raise ValueError(
      f"`{ENV_PROCESS_ID}` must be in 0..{num - 1} ({ENV_NUM_PROCESSES}={num}), "
      f"got {pid}; give each process a distinct id below {num}."
    )
  return coordinator, num, pid


@dataclasses.dataclass(frozen=True)
class Settings:
  """What :func:`initialize` hands to ``jax.distributed.initialize``.

  Attributes:
    method: ``"env"``, ``"ompi"`` or ``"slurm"``.
    coordinator: ``host:port`` of process 0.
    num_processes: processes in the job.
    process_id: this process.
    source: the variables they were read from (for error messages).
  """

  method: str
  coordinator: str
  num_processes: int
  process_id: int
  source: str


_OMPI_URI = "OMPI_MCA_orte_hnp_uri"
_OMPI_SIZE, _OMPI_RANK = "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")


def _detected_cluster() -> Settings | None:
  """The settings of an Open MPI or Slurm job of several processes, or None.

  Same detection and precedence as JAX's ``jax._src.clusters`` (Open MPI,
  then Slurm), with JAX's own coordinator address rule for each.

  Raises:
    ValueError: Open MPI without ``OMPI_MCA_orte_hnp_uri`` (Open MPI 5) and
      no ``JAXCOLL_COORDINATOR``; or malformed count / id variables.
  """
  from jax._src import clusters  # noqa: PLC0415  (JAX's own detection rules)

  env = os.environ
  if _OMPI_URI in env or _OMPI_SIZE in env:
    size = _int_env(_OMPI_SIZE, minimum=1, example="2")
    rank = _int_env(_OMPI_RANK, minimum=0, example="0")
    if size is not None and size > 1:
      if rank is None or rank >= size:
        raise ValueError(
          f"`{_OMPI_RANK}`={env.get(_OMPI_RANK)!r} must be in 0..{size - 1} "
          f"({_OMPI_SIZE}={size}); start the job with mpirun."
        )
      source = f"{_OMPI_SIZE}={size}, {_OMPI_RANK}={rank}"
      if _OMPI_URI in env:
        try:  # JAX's own rule: the port from the job id, the host from the first tcp:// one
          coordinator = clusters.OmpiCluster.get_coordinator_address(None, None)
        except (ValueError, RuntimeError):  # int() of the job id, no tcp:// address
          raise ValueError(
            f"`{_OMPI_URI}`={env[_OMPI_URI]!r} is not Open MPI's '<job id>.<vpid>;tcp://"
            "<host>[,<host>...]:<port>' (e.g. '1531576320.0;tcp://10.96.0.1:34911'), so "
            "there is no coordinator to read from it; start the job with mpirun (which sets "
            f"it), or unset {_OMPI_URI} and {_OMPI_SIZE} to run without Open MPI."
          ) from None
        return Settings("ompi", coordinator, size, rank, f"Open MPI: {_OMPI_URI}, {source}")
      coordinator = env.get(ENV_COORDINATOR, "").strip()
      if not coordinator:
        raise ValueError(
          f"Open MPI without `{_OMPI_URI}` (Open MPI 5) gives no coordinator address; set "
          f"{ENV_COORDINATOR}=<host of rank 0>:<free port> for every rank, e.g. "
          f"`mpirun -x {ENV_COORDINATOR}=node0:12345 ...`."
        )
      parse_coordinator(coordinator)
      return Settings("ompi", coordinator, size, rank,
                      f"Open MPI 5: {source}, {ENV_COORDINATOR}={coordinator}")
  if all(v in env for v in _SLURM_VARS):
    ntasks = _int_env("SLURM_NTASKS", minimum=1, example="2")
    if ntasks > 1:
      procid = _int_env("SLURM_PROCID", minimum=0, example="0")
      if procid >= ntasks:
        raise ValueError(
          f"`SLURM_PROCID`={procid} must be in 0..{ntasks - 1} (SLURM_NTASKS={ntasks}); "
          f"start the job with srun, or give each task a distinct SLURM_PROCID below {ntasks}."
        )
      # JAX derives the port from the job id and the host from the node list.
      _int_env("SLURM_JOB_ID", minimum=0, example="12345")
      if not env["SLURM_STEP_NODELIST"].strip():
        raise ValueError(
          "`SLURM_STEP_NODELIST` is empty, so there is no host for the coordinator; "
          "start the job with srun, or set it to the job's hosts, e.g. node[01-04]."
        )
      coordinator = clusters.SlurmCluster.get_coordinator_address(None, None)
      return Settings(
        "slurm", coordinator, ntasks, procid,
        f"Slurm: SLURM_STEP_NODELIST={env['SLURM_STEP_NODELIST']}, SLURM_NTASKS={ntasks}, "
        f"SLURM_PROCID={procid}",
      )
  return None


def settings() -> Settings | None:
  """The multi-process settings of this process (see the module docstring),
  or None for a single process. Reads the environment only.

  Raises:
    ValueError: as :func:`initialize`.
  """
  env = os.environ
  ompi_without_uri = _OMPI_SIZE in env and _OMPI_URI not in env
  if not ompi_without_uri or ENV_NUM_PROCESSES in env or ENV_PROCESS_ID in env:
    explicit = _explicit_settings()
    if explicit is not None:
      coordinator, num, pid = explicit
      return Settings("env", coordinator, num, pid,
                      f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}={num}, {ENV_PROCESS_ID}={pid}")
  return _detected_cluster()


def jax_arguments(found: Settings, *, init_timeout_s: float, heartbeat_s: int) -> dict:
  """The keyword arguments :func:`initialize` gives ``jax.distributed.initialize``:
  the coordinator, count and id found, JAX's own detection off and no
  ``local_device_ids`` (every local device stays visible)."""
  host, port = parse_coordinator(found.coordinator)
  kwargs = dict(
    coordinator_address=found.coordinator,
    num_processes=found.num_processes,
    process_id=found.process_id,
    cluster_detection_method="deactivate",
    initialization_timeout=int(math.ceil(init_timeout_s)) + _JAX_TIMEOUT_MARGIN_S,
    heartbeat_timeout_seconds=heartbeat_s,
  )
  if _is_loopback(host):
    # A local job: keep the coordinator off the network (JAX's default
    # binds every interface).
    kwargs["coordinator_bind_address"] = f"{host}:{port}"
  return kwargs


def _check_port_free(found: Settings) -> None:
  """Process 0 serves the coordinator: a taken port is bad input, not the
  segfault JAX's gRPC server ends with."""
  if found.process_id != 0:
    return
  host, port = parse_coordinator(found.coordinator)
  bind_host = host.strip("[]") if _is_loopback(host) else ""
  family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind((bind_host, port))
      s.listen(1)
    except OSError as e:
      raise ValueError(
        f"the coordinator port {port} ({found.coordinator}, from {found.source}) is already "
        f"in use on this host ({e.strerror}); choose a free port, e.g. "
        f"{ENV_COORDINATOR}={host}:{_free_port_hint()}."
      ) from None


def _check_host_resolves(found: Settings) -> None:
  """A coordinator host name that does not resolve is bad input, said at once:
  JAX's client would retry it until the start-up deadline (300 s by default)
  and then say only that not every process connected. A temporary failure of
  the name service (``EAI_AGAIN``) is left to that deadline."""
  host, port = parse_coordinator(found.coordinator)
  try:
    socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
  except socket.gaierror as e:
    if e.errno == socket.EAI_AGAIN:
      return
    raise ValueError(
      f"the coordinator host {host!r} ({found.coordinator}, from {found.source}) does not "
      f"resolve ({e.strerror}); set {ENV_COORDINATOR} to the host name or address of "
      f"process 0 as this host knows it, e.g. {ENV_COORDINATOR}=127.0.0.1:{port} for a job "
      "on this machine."
    ) from None


def _free_port_hint() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _backend_started() -> bool:
  try:
    from jax._src import xla_bridge  # noqa: PLC0415  (no public equivalent)
  except ImportError:  # pragma: no cover - a future JAX moved it
    return False
  return xla_bridge.backends_are_initialized()


def _start_watchdog(timeout_s: float, where: str, found: Settings) -> threading.Event:
  """Exits the process with a clear message unless the event is set in time.

  ``jax.distributed.initialize`` blocks in C++ while it waits for the other
  processes and, when its own deadline passes, aborts the whole process with
  a stack dump; it never raises. A thread is the only way to say why.
  """
  done = threading.Event()

  def watch():
    if done.wait(timeout_s):
      return
    sys.stdout.flush()
    if found.method == "env":
      advice = (
        f"Start all processes with the same {ENV_COORDINATOR} and {ENV_NUM_PROCESSES} (or "
        "use `python -m jaxcoll.launch`)"
      )
    else:
      advice = (
        f"Check that all {found.num_processes} processes started and can reach "
        f"{found.coordinator} (with mpirun, e.g. --mca oob_tcp_if_include <interface>)"
      )
    sys.stderr.write(
      f"jaxcoll.distributed: {where} did not start within {timeout_s:g} s: "
      f"not every process connected to the coordinator (settings from {found.source}). "
      f"{advice}, or raise {ENV_INIT_TIMEOUT_S}.\n"
    )
    sys.stderr.flush()
    os._exit(INIT_TIMEOUT_EXIT_CODE)

  threading.Thread(target=watch, name="jaxcoll-init-watchdog", daemon=True).start()
  return done


def _check_same_local_device_count(found: Settings) -> None:
  """Every process of the job must have as many devices as the others.

  JAX joins processes of unequal device counts (2 + 4 emulated CPU devices,
  8 + 4 GPUs) without a word, but the job's meshes (one row of devices per
  process) and ``multihost_utils`` cannot place them: the run ended in a
  ``cannot reshape array of size 6 into shape (2,2)`` traceback. Every process
  sees the whole device list, so each says the same one line.
  """
  counts = collections.Counter(d.process_index for d in jax.devices())
  if len(set(counts.values())) <= 1:
    return
  per_process = ", ".join(f"process {i}: {counts[i]}" for i in sorted(counts))
  if os.environ.get(devices.ENV_CPU_DEVICES, "").strip():
    fix = (f"set the same {devices.ENV_CPU_DEVICES} on every process (mpirun -x "
           f"{devices.ENV_CPU_DEVICES}=N, srun --export=ALL,{devices.ENV_CPU_DEVICES}=N; "
           "python -m jaxcoll.launch sets it for all)")
  else:
    fix = "give every process the same number of devices (e.g. CUDA_VISIBLE_DEVICES)"
  raise ValueError(
    f"the processes of this job have unequal device counts ({per_process}; settings from "
    f"{found.source}); every process must have the same number: {fix}."
  )


def _check_process_count(found: Settings) -> None:
  """This process was given the job's process count its coordinator has.

  JAX takes the count from process 0 and ignores another one given to the
  others: a process told ``JAXCOLL_NUM_PROCESSES=3`` in a job of 2 joined it
  without a word. Said here, on the process whose setting is wrong, before
  anything is written; its liveness channel is up, so a command line that
  ends it through :func:`jaxcoll.runtime.liveness.fail_now` ends the others
  at once (a plain exit sat in JAX's shutdown barrier, and then aborted).
  """
  joined = jax.process_count()
  if joined == found.num_processes:
    return
  raise ValueError(
    f"this process (id {found.process_id}) was told the job has {found.num_processes} "
    f"processes (settings from {found.source}), but the job at {found.coordinator} has "
    f"{joined}, the count process 0 was given; give every process the same count "
    f"(python -m jaxcoll.launch sets it for all)."
  )


ENV_XLA_FLAGS = "XLA_FLAGS"
# XLA:CPU's pass that merges the all-reduces of a program into one of several operands.
CPU_ALL_REDUCE_COMBINER = "cpu-all-reduce-combiner"
_DISABLE_PASSES = "--xla_disable_hlo_passes"


def without_pass(xla_flags: str, name: str) -> str:
  """``xla_flags`` (an ``XLA_FLAGS`` value) with the HLO pass ``name`` added to
  ``--xla_disable_hlo_passes`` (the one already there, else a new flag).

  >>> without_pass("--xla_dump_to=/tmp/d", "cpu-all-reduce-combiner")
  '--xla_dump_to=/tmp/d --xla_disable_hlo_passes=cpu-all-reduce-combiner'
  >>> without_pass("--xla_disable_hlo_passes=fusion", "cpu-all-reduce-combiner")
  '--xla_disable_hlo_passes=fusion,cpu-all-reduce-combiner'
  """
  words = xla_flags.split()
  for i in range(len(words) - 1, -1, -1):  # XLA reads the last one
    flag, sep, value = words[i].partition("=")
    if flag == _DISABLE_PASSES and sep:
      names = [n for n in value.split(",") if n]
      if name not in names:
        words[i] = f"{flag}={','.join([*names, name])}"
      return " ".join(words)
  return " ".join([*words, f"{_DISABLE_PASSES}={name}"])


def keep_cpu_all_reduces_apart() -> None:
  """Turns off XLA:CPU's all-reduce combiner for this process (``XLA_FLAGS``, read when
  the backend starts): a multi-process job's all-reduces stay one gloo collective each.

  A combined all-reduce runs its operands one after the other, and when a peer process
  dies during one, XLA:CPU goes on to the next operand: the neighbours still in the first
  one then send this process a piece of the wrong size, and gloo aborts the process from
  its own thread (``gloo::EnforceNotMet ... Received data size doesn't match expected
  size``, SIGABRT and a thread dump), before :mod:`jaxcoll.runtime.liveness` ends it with
  its one line. A training step's gradients, loss and gradient norm were one such
  all-reduce: the survivor of process 0 aborted so every time. Apart, a collective whose
  peer is gone fails as a whole and the program stops (the smoke run's step time on 2 x 4
  CPU devices did not measurably change). GPU and TPU compilers have combiners of their
  own, untouched.
  """
  os.environ[ENV_XLA_FLAGS] = without_pass(os.environ.get(ENV_XLA_FLAGS, ""),
                                           CPU_ALL_REDUCE_COMBINER)


def _start_liveness(found: Settings) -> bool:
  """The survivors of a process that dies end at once (:mod:`jaxcoll.runtime.liveness`)."""
  from jax._src import distributed as jax_distributed  # noqa: PLC0415  (its client)

  from jaxcoll.runtime import liveness  # noqa: PLC0415

  host, port = parse_coordinator(found.coordinator)
  return liveness.start(
    jax_distributed.global_state.client, process_id=found.process_id,
    num_processes=found.num_processes, coordinator_host=host,
    bind_host=host.strip("[]") if _is_loopback(host) else "", lost_peer=peer_gone)


def heartbeat_timeout_s() -> int | None:
  """JAX's heartbeat timeout in this multi-process job, as
  :func:`initialize` set it; None in a single process (or a job that
  :func:`initialize` did not start)."""
  return _heartbeat_s


def initialize(*, timeout_s: float | None = None, heartbeat_s: int | None = None) -> ClusterInfo:
  """Joins this process to its multi-process JAX job (or does nothing).

  Call it at the start of the program, before any JAX computation. Calling
  it again returns the same :class:`ClusterInfo` and does nothing else.

  Args:
    timeout_s: seconds to wait for every process to connect; default
      ``JAXCOLL_INIT_TIMEOUT_S``, else 300. When they do not all connect in
      time the process writes one error line to stderr and exits with status
      ``INIT_TIMEOUT_EXIT_CODE`` (75): JAX's start-up cannot be interrupted
      and would otherwise abort with a stack dump.
    heartbeat_s: the heartbeat timeout this job needs at least (e.g. more
      than twice its longest watchdog limit, so a hung peer ends in the
      watchdog's exit 86 rather than JAX's abort): used when larger than the
      default 100 s. ``JAXCOLL_HEARTBEAT_TIMEOUT_S``, when set, wins.

  Returns:
    A :class:`ClusterInfo`: this process's id, the process count, and how
    they were found.

  Raises:
    ValueError: a ``JAXCOLL_*`` variable or ``timeout_s`` is malformed,
      the three multi-process variables are only partly set, or the
      processes joined have unequal device counts (each says so).
    RuntimeError: a multi-process job is requested but JAX's backend has
      already started in this process.

  Example:
    >>> import jaxcoll
    >>> info = jaxcoll.distributed.initialize()  # doctest: +SKIP
    >>> info.process_id, info.num_processes  # doctest: +SKIP
    (0, 2)
  """
  global _info  # noqa: PLW0603  (once-per-process state, as jax.distributed)
  with _lock:
    if _info is not None:
      return _info
    cpu_devices = devices.simulate_from_environment()
    restart = _int_env(ENV_RESTART, minimum=0, example="0") or 0
    init_timeout_s = _init_timeout(timeout_s)
    wanted = max(DEFAULT_HEARTBEAT_TIMEOUT_S, int(math.ceil(heartbeat_s or 0)))
    heartbeat_s = (
      _int_env(ENV_HEARTBEAT_TIMEOUT_S, minimum=1, example=str(DEFAULT_HEARTBEAT_TIMEOUT_S))
      or wanted
    )
    found = settings()
    if found is None:
      _info = ClusterInfo(0, 1, None, "single", cpu_devices, restart)
      return _info

    if jax.distributed.is_initialized():
      raise RuntimeError(
        "jax.distributed is already initialized in this process; call "
        "jaxcoll.distributed.initialize() instead of "
        "jax.distributed.initialize(), not both."
      )
    if _backend_started():
      raise RuntimeError(
        "JAX's backend has already started, too late to join a multi-process "
        "job; call jaxcoll.distributed.initialize() before any JAX "
        "computation (right after the imports)."
      )
    _check_host_resolves(found)
    _check_port_free(found)
    _collapse_gloo_chatter(found)
    # gloo is the only CPU cross-process implementation that needs no MPI;
    # set it explicitly in case a user config picked another one.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    keep_cpu_all_reduces_apart()
    kwargs = jax_arguments(found, init_timeout_s=init_timeout_s, heartbeat_s=heartbeat_s)
    where = f"process {found.process_id} of {found.num_processes} ({found.coordinator})"
    done = _start_watchdog(init_timeout_s, where, found)
    try:
      jax.distributed.initialize(**kwargs)
    finally:
      done.set()
    _check_same_local_device_count(found)
    _start_liveness(found)  # first: a process whose count is wrong ends the others too
    _check_process_count(found)
    _info = ClusterInfo(found.process_id, found.num_processes, found.coordinator, found.method,
                        cpu_devices, restart)
    global _heartbeat_s  # noqa: PLW0603
    _heartbeat_s = heartbeat_s
    return _info


ENV_VERBOSE = "JAXCOLL_VERBOSE"


def _collapse_gloo_chatter(found: Settings) -> None:
  """Under mpirun / srun (no launcher reads our output), routes this
  process's stdout through :mod:`jaxcoll.runtime.gloo_filter`, which
  collapses gloo's connection lines as the launcher does; not with
  ``JAXCOLL_VERBOSE=1``, nor when the filter cannot start."""
  if found.method not in ("ompi", "slurm") or os.environ.get(ENV_VERBOSE, "").strip().lower() \
      not in ("", "0", "false", "no"):
    return
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gloo_filter.py")
  sys.stdout.flush()
  try:
    child = subprocess.Popen([sys.executable, "-I", script], stdin=subprocess.PIPE)
  except OSError:
    return  # output stays as it is
  original = os.dup(1)
  os.dup2(child.stdin.fileno(), 1)
  child.stdin.close()

  def finish():  # our write end closed: the filter drains what it got and exits
    try:
      sys.stdout.flush()
    except (OSError, ValueError):
      pass
    os.dup2(original, 1)
    try:
      child.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass

  atexit.register(finish)


# What gloo's TCP transport says when the process at the other end is gone: it could not
# connect (refused), or the connection broke (reset, closed, a write's broken pipe). Not any
# gloo error: a timeout ("Timed out waiting ... for recv") is a peer that is slow or hung, the
# watchdog's case, and this process's own failure.
_PEER_GONE = re.compile(r"connection (refused|reset|closed)|closed by peer|broken pipe",
                        re.IGNORECASE)


def peer_gone(error: BaseException) -> bool:
  """Whether ``error`` is a multi-process job's collective failing because a peer
  process has exited (gloo could not connect to it, or the connection broke):
  not this process's fault; the peer's own output says why it ended. An error raised
  from or while handling one (an evaluation's ``EvalError``, a failed checkpoint save)
  is one too (:func:`lost_peer_error` finds it).

  >>> peer_gone(ValueError("gloo"))  # only JAX's runtime errors, and only with peers
  False
  """
  return lost_peer_error(error) is not None


def lost_peer_error(error: BaseException) -> BaseException | None:
  """The collective's error in ``error``'s chain (``error`` itself, its cause, or the
  error it was raised while handling, and so on) that says a peer process is gone; None
  when there is none, or in a single process."""
  if jax.process_count() <= 1:
    return None
  seen: set[int] = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, jax.errors.JaxRuntimeError) and _PEER_GONE.search(str(error)):
      return error
    error = error.__cause__ or error.__context__
  return None


def cluster_info() -> ClusterInfo | None:
  """The :class:`ClusterInfo` of the last :func:`initialize`, or None."""
  return _info
