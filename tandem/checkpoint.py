"""Checkpoints that survive crashes: atomic save, clear load errors, saving from rank 0.

A training script that resumes after the launcher restarts it
(``python -m tandem.run --max-restarts 3 train.py``)::

    import tandem as dist
    from tandem import checkpoint

    path, start = "out/checkpoint.pt", 0
    if checkpoint.exists(path):
        state = checkpoint.load(path)                  # tensors and plain containers only
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    for step in range(start, steps):
        ...
        if (step + 1) % 100 == 0:                      # every rank calls it
            checkpoint.save_on_rank0({"model": model.state_dict(),
                                      "optimizer": optimizer.state_dict(),
                                      "step": step + 1}, path)

:func:`save` writes to a temporary file beside ``path``
(``<name>.tmp.<host>.<pid>.<random>``), flushes and fsyncs it, renames it over ``path``
with ``os.replace`` (atomic on POSIX) and fsyncs the directory, so that the rename
itself survives a power cut. A process killed at any moment leaves under ``path``
either the previous checkpoint or the new one, never a partial file. The temporary
files that such kills leave behind are deleted by the next :func:`save` of the same
path on the same host; :func:`load`, :func:`exists` and :func:`latest` never read them.

Files are written with ``torch.save`` and read with ``torch.load(weights_only=True)``
by default: model and optimizer state dicts, RNG states, numbers, strings, lists,
tuples and dicts load without running any code from the file.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import pickle
import re
import secrets
import socket
from typing import Any

import torch

from tandem import _dcp
from tandem._proc import process_alive
from tandem.collectives.api import broadcast
from tandem.collectives.subgroups import get_global_rank
from tandem.collectives.world import AnyGroup, get_rank, is_initialized
from tandem.errors import ArgumentError, StateError

__all__ = ["save", "load", "exists", "latest", "save_on_rank0"]

_TMP = ".tmp."  # marks temporary files: <name>.tmp.<host>.<pid>.<random>

PathLike = str | os.PathLike[str]


def _path(path: PathLike, what: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"{what}: path must be a str or os.PathLike, got {path!r}")
    return os.fspath(path)


def _is_temp(name: str) -> bool:
    return _TMP in name


def _remove_stale_temps(path: str) -> None:
    """Delete ``path``'s temporary files left by killed saves of this host.

    Only files whose writer process is gone are touched: a save running concurrently
    in another live process (or on another host sharing the directory) keeps its file.
    """
    directory, base = os.path.split(os.path.abspath(path))
    prefix, host = base + _TMP, socket.gethostname()
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix):].rsplit(".", 2)  # the host name may itself hold dots
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        if int(parts[1]) != os.getpid() and not process_alive(int(parts[1])):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)


def save(obj: Any = None, path: PathLike | None = None, *, state_dict: Any = None,
         checkpoint_id: PathLike | None = None, storage_writer: Any = None,
         planner: Any = None, process_group: AnyGroup | None = None, no_dist: bool = False,
         use_collectives: bool = True) -> None:
    """Write ``obj`` with ``torch.save`` to ``path`` atomically (see the module docstring).

    Creates the parent directory if needed. If the save fails (disk full, an object
    that cannot be pickled), the exception propagates, the temporary file is removed
    and ``path`` still holds its previous content.

    ``save(state_dict, checkpoint_id=DIR)`` is torch.distributed.checkpoint's form: a
    collective call that writes a checkpoint directory (see ``tandem._dcp``).
    """
    if checkpoint_id is not None or state_dict is not None:
        _dcp.check_unsupported("checkpoint.save", storage_writer=storage_writer,
                               planner=planner)
        if path is not None or (obj is not None and state_dict is not None):
            raise ArgumentError("checkpoint.save: give either (obj, path) or (state_dict, "
                                "checkpoint_id=DIR), not both")
        if checkpoint_id is None:
            raise ArgumentError("checkpoint.save: state_dict= needs checkpoint_id=DIR")
        if not use_collectives:
            raise ArgumentError("checkpoint.save: use_collectives=False is refused: rank 0 "
                                "writes the checkpoint and tells the others when it is in "
                                "place; for one process alone pass no_dist=True")
        _dcp.save(obj if state_dict is None else state_dict,
                  _path(checkpoint_id, "checkpoint.save"), process_group, no_dist)
        return
    if path is None:
        raise ArgumentError("checkpoint.save: path is required (or checkpoint_id=DIR, "
                            "torch.distributed.checkpoint's form)")
    path = _path(path, "checkpoint.save")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _remove_stale_temps(path)
    tmp = f"{path}{_TMP}{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def load(path: Any = None, map_location: Any = "cpu", *, weights_only: bool = True,
         state_dict: Any = None, checkpoint_id: PathLike | None = None,
         storage_reader: Any = None, planner: Any = None,
         process_group: AnyGroup | None = None, no_dist: bool = False) -> Any:
    """Read a checkpoint written by :func:`save` (or by ``torch.save``).

    Raises ``FileNotFoundError`` naming ``path`` if there is none, and
    :class:`~tandem.errors.ArgumentError` naming it if the file is truncated, corrupt,
    not a torch file, or (with ``weights_only``) holds objects that could run code when
    unpickled; pass ``weights_only=False`` only for files you trust.

    ``load(state_dict, checkpoint_id=DIR)`` is torch.distributed.checkpoint's form: it
    fills ``state_dict`` in place from a checkpoint directory and returns None (see
    ``tandem._dcp``; every rank reads the file, so ``process_group`` and ``no_dist``
    change nothing).
    """
    if checkpoint_id is not None or state_dict is not None:
        _dcp.check_unsupported("checkpoint.load", storage_reader=storage_reader,
                               planner=planner)
        if checkpoint_id is None:
            raise ArgumentError("checkpoint.load: state_dict= needs checkpoint_id=DIR")
        if path is not None and state_dict is not None:
            raise ArgumentError("checkpoint.load: give the state to fill once")
        _dcp.load(path if state_dict is None else state_dict,
                  _path(checkpoint_id, "checkpoint.load"), weights_only)
        return None
    if path is None:
        raise ArgumentError("checkpoint.load: path is required (or checkpoint_id=DIR, "
                            "torch.distributed.checkpoint's form)")
    path = _path(path, "checkpoint.load")
    if os.path.isdir(path):
        raise ArgumentError(f"checkpoint.load: {path} is a directory, not a checkpoint file")
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint.load: no checkpoint at {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except OSError:
        raise  # permission denied, I/O error: already names the path
    except Exception as exc:  # torch raises RuntimeError, EOFError, KeyError, UnpicklingError...
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if isinstance(exc, pickle.UnpicklingError) and refused:
            raise ArgumentError(
                f"checkpoint.load: {path} holds {refused.group(1)}, not only tensors and "
                f"plain containers, which weights_only=True refuses to unpickle; pass "
                f"weights_only=False only if you trust the file") from exc
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise ArgumentError(f"checkpoint.load: {path} is truncated, corrupt or not a "
                            f"torch.save file ({type(exc).__name__}: {first})") from exc


def exists(path: PathLike) -> bool:
    """Whether a complete checkpoint file is at ``path`` (temporary files never count)."""
    return os.path.isfile(_path(path, "checkpoint.exists"))


def latest(directory: PathLike, pattern: str = "*.pt") -> str | None:
    """The most recently written checkpoint in ``directory`` whose name matches ``pattern``.

    For runs that keep one file per step (``step_000100.pt``, ...). Temporary files of
    saves in progress or killed are skipped; ties in modification time go to the
    later name. Returns ``None`` if there is none (or no such directory).
    """
    directory = _path(directory, "checkpoint.latest")
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return None
    found = [(e.stat().st_mtime_ns, e.name) for e in entries
             if e.is_file() and not _is_temp(e.name) and fnmatch.fnmatch(e.name, pattern)]
    return os.path.join(directory, max(found)[1]) if found else None


def save_on_rank0(obj: Any, path: PathLike, group: AnyGroup | None = None) -> None:
    """Every rank of ``group`` calls this; rank 0 of the group :func:`save`\\ s ``obj``.

    Returns on each rank only once the file is in place, so any rank may read it next
    (given a filesystem all ranks share). ``obj`` is ignored on the other ranks. If the
    save fails, rank 0 raises its error and every other rank raises
    :class:`~tandem.errors.StateError`, instead of waiting for a file that never comes.
    Without an initialised process group the calling process saves.
    """
    path = _path(path, "checkpoint.save_on_rank0")
    if group is None and not is_initialized():
        save(obj, path)
        return
    status = torch.ones(1, dtype=torch.uint8)
    error: BaseException | None = None
    if get_rank(group) == 0:
        try:
            save(obj, path)
        except Exception as exc:  # noqa: BLE001 - re-raised after the others are told
            status.zero_()
            error = exc
    # rank 0 sends only after the rename and the directory fsync: the broadcast is the
    # barrier that makes the file visible to every rank that returns from it
    broadcast(status, group=group, group_src=0)
    if error is not None:
        raise error
    if not status.item():
        raise StateError(f"checkpoint.save_on_rank0: rank {get_global_rank(group, 0)} "
                         f"failed to save {path}; its own error says why")
