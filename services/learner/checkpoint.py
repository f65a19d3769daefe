"""Learner checkpoints: model + optimizer through torch.distributed.checkpoint (DCP), the rest as JSON.

Layout of one checkpoint, `<run_dir>/checkpoints/global_step_N/` (N = training steps completed; verl's name;
the `step_N/` folders of earlier versions are still listed and resumed):

    state/              DCP files of {"model": ..., "optim": ...} (sharded per rank under FSDP2)
    rng_rank{R}.json    torch (CPU and CUDA), numpy and python RNG states of rank R
    meta.json           lr scheduler state, KL controller value and the caller's `extra`
                        (step, policy version, data-loader position, ledger, ...)
    hf/                 config, generation config and tokenizer files (what `export_hf` needs)
    COMPLETE            written last: a directory without it is never loaded

Atomicity: everything is written to `global_step_N.tmp/`, the marker last, then the directory is renamed to
`global_step_N/`. A crash while saving leaves at most a `.tmp` directory, which `latest_checkpoint` ignores
and the next save or `prune_checkpoints` removes. Model and optimizer go through
`get_state_dict`/`set_state_dict`, so the same code saves a plain module, DDP or FSDP2 (sharded DTensors,
one DCP shard per rank, written collectively); JSON files are written by rank 0 only. Where the ranks do
not share a filesystem, each writes a checkpoint of its own shard, complete in itself (rlbus.learner.
checkpoint_layout: meta.json's "layout" is "per_rank").
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rlbus.learner.checkpoint_layout import COLLECTIVE, PER_RANK, checkpoint_layout, common_step
from rlbus.learner.rng_state import rng_state, set_rng_state

CHECKPOINTS_DIRNAME = "checkpoints"
COMPLETE_MARKER = "COMPLETE"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^(?:global_)?step_(\d+)$")  # global_step_N (verl's), or step_N (earlier rlbus)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit the model it is loaded into."""


# ------------------------------------------------------------------------------------------ locations


def checkpoint_root(run_dir: str | os.PathLike, local_dir: str | os.PathLike | None = None) -> Path:
    """`trainer.default_local_dir` when set, else `<run dir>/checkpoints` (the run dir is per experiment)."""
    return Path(local_dir) if local_dir is not None else Path(run_dir) / CHECKPOINTS_DIRNAME


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"global_step_{int(step)}"


def is_complete(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and (path / COMPLETE_MARKER).is_file() and bool(_STEP_RE.match(path.name))


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first. Half-written ones are skipped."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and is_complete(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def common_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint complete on every learner rank (collective call under torch.distributed):
    where each rank keeps its own folder, a rank may have died before sealing the newest one."""
    found = dict(list_checkpoints(root))  # step -> its folder (global_step_N, or an earlier step_N)
    step = common_step(list(found))
    return None if step is None else found[step]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A complete step dir as given, or the latest one under a checkpoints root or a run dir."""
    path = Path(path)
    if is_complete(path):
        return path
    for root in (path, path / CHECKPOINTS_DIRNAME):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    if path.is_dir() and _STEP_RE.match(path.name):
        raise CheckpointError(f"{path} is incomplete (no {COMPLETE_MARKER} marker): a save was interrupted")
    raise CheckpointError(
        f"no complete checkpoint at {path} (expected global_step_N/ with a {COMPLETE_MARKER} file)"
    )


def checkpoint_step(path: str | os.PathLike) -> int:
    m = _STEP_RE.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path} is not a global_step_N checkpoint directory")
    return int(m.group(1))


def prune_checkpoints(
    root: str | os.PathLike, keep: int, is_kept: Callable[[int], bool] | None = None, own_folder: bool = False
) -> list[Path]:
    """Removes all but the newest `keep` complete checkpoints, and stale `.tmp`/`.old` leftovers. With
    `is_kept`, only the steps it names count as kept ones (save_freq); the others (rolling checkpoints)
    are removed unless one is the newest checkpoint of all. Rank 0 prunes, and a rank > 0 with
    `own_folder` (the per-rank layout: a folder no other rank sees)."""
    if _rank() != 0 and not own_folder:
        return []
    root = Path(root)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for child in root.iterdir():
        if child.is_dir() and re.match(r"^(global_)?step_\d+\.(tmp|old)$", child.name):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    found = list_checkpoints(root)
    newest = found[-1][0] if found else None
    if is_kept is not None:
        for step, path in found:
            if not is_kept(step) and step != newest:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        found = [(step, path) for step, path in found if is_kept(step)]
    for _, path in found[: max(0, len(found) - max(1, int(keep)))]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


# ------------------------------------------------------------------------------------------ distributed


def _dist_on() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    return torch.distributed.get_rank() if _dist_on() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if _dist_on() else 1


def _barrier() -> None:
    if _dist_on():
        torch.distributed.barrier()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it 'assumes a single process' when no group is up: that is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*torch\.distributed is disabled, unavailable or uninit.*"
        )
        yield


# ------------------------------------------------------------------------------------------ small files


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(Path(dirpath))


# ------------------------------------------------------------------------------------------ save / load


def hf_module(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP / torch.compile wrappers (FSDP2 shards in place: no wrapper)."""
    seen = 0
    while seen < 8 and not hasattr(model, "config"):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            break
        model, seen = inner, seen + 1
    return model


def _save_hf_files(model: torch.nn.Module, tokenizer: Any, out: Path) -> None:
    """Config, generation config and tokenizer (no weights): the non-tensor half of an HF directory."""
    out.mkdir(parents=True, exist_ok=True)
    inner = hf_module(model)
    config = getattr(inner, "config", None)
    if config is not None:
        config.save_pretrained(out)
    gen = getattr(inner, "generation_config", None)
    if gen is not None:
        with contextlib.suppress(Exception):  # an invalid generation config must not block a checkpoint
            gen.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    else:  # the tokenizer files beside the model the trainer was loaded from, when that is a local dir
        src = Path(str(getattr(config, "_name_or_path", "") or getattr(inner, "name_or_path", "") or ""))
        if src.is_dir():
            for f in src.iterdir():
                if f.is_file() and (
                    f.name.startswith("tokenizer")
                    or f.name
                    in ("special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja")
                ):
                    shutil.copy2(f, out / f.name)


def _trainer_state(trainer: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    sched = getattr(trainer, "scheduler", None)
    if sched is not None:
        out["scheduler"] = sched.state_dict()
    kl = getattr(trainer, "kl_ctrl", None)
    if kl is not None:
        out["kl_coef"] = float(kl.value)
    return out


def save_checkpoint(
    path: str | os.PathLike, trainer: Any, extra: dict[str, Any] | None = None, tokenizer: Any = None
) -> Path:
    """Writes `trainer` (model, optimizer, scheduler, KL controller), the RNG states and `extra` to `path`.

    `path` is the final step directory (`step_dir(root, step)`); it appears only once complete. `extra`
    must be JSON-able. Under torch.distributed every rank calls this (DCP saves collectively).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    if not _STEP_RE.match(path.name):
        raise CheckpointError(f"checkpoint dir must be named global_step_N, got {path.name!r}")
    tmp = path.with_name(path.name + ".tmp")
    rank = _rank()
    t0 = time.perf_counter()
    layout = checkpoint_layout(path.parent)
    own_folder = rank == 0 or layout == PER_RANK  # this rank makes, fills and seals a folder of its own
    if own_folder:
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        tmp.mkdir(parents=True)
    _barrier()
    no_dist = layout == PER_RANK  # each rank's shard with metadata of its own
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    with _single_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "state"), no_dist=no_dist)
    critic = getattr(trainer, "critic", None)
    if critic is not None:  # PPO: the value model resumes too, or GAE restarts from a zero value head
        c_model, c_optim = get_state_dict(critic.model, critic.optimizer)
        with _single_process_quiet():
            dcp.save({"model": c_model, "optim": c_optim}, checkpoint_id=str(tmp / "critic"), no_dist=no_dist)
    if rank == 0:
        meta = {**checkpoint_meta(trainer, extra), "layout": layout}
        write_small_files(tmp, meta, rng_state(), trainer.model, tokenizer)
    else:
        _write_json(tmp / f"rng_rank{rank}.json", rng_state())
        if layout == PER_RANK:  # its own scheduler and KL state; the run's `extra` is rank 0's
            _write_json(tmp / "meta.json", {**checkpoint_meta(trainer, None), "layout": layout})
    _barrier()
    if own_folder:
        seal_checkpoint(tmp, path, t0)
    _barrier()
    return path


def checkpoint_meta(trainer: Any, extra: dict[str, Any] | None) -> dict[str, Any]:
    """meta.json's content: the format, the scheduler and KL controller state, the caller's `extra`."""
    tstate = _trainer_state(trainer)
    critic = getattr(trainer, "critic", None)
    if critic is not None:
        tstate["critic_scheduler"] = critic.scheduler.state_dict()
    return {
        "format": FORMAT_VERSION,
        "world_size": _world(),
        "saved_at": time.time(),
        "trainer": tstate,
        "extra": extra or {},
    }


def write_small_files(
    tmp: Path, meta: dict[str, Any], rng: dict[str, Any], model: Any, tokenizer: Any
) -> None:
    """Rank 0's JSON and HF files of a checkpoint being written in `tmp`."""
    _write_json(tmp / "rng_rank0.json", rng)
    _write_json(tmp / "meta.json", meta)
    _save_hf_files(model, tokenizer, tmp / "hf")


def seal_checkpoint(tmp: Path, path: Path, t0: float) -> None:
    """Everything of `tmp` on disk, the marker last, then renamed to `path` (which only ever appears whole)."""
    _fsync_tree(tmp)
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    _write_json(tmp / COMPLETE_MARKER, {"files": files, "seconds": time.perf_counter() - t0})
    _fsync_dir(tmp)
    old = path.with_name(path.name + ".old")
    if path.exists():  # the same step saved again (a resumed run got here a second time)
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    tmp.rename(path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def is_per_rank(path: str | os.PathLike) -> bool:
    """Whether this rank wrote `path` in a folder of its own (rlbus.learner.checkpoint_layout)."""
    return read_meta(path).get("layout", COLLECTIVE) == PER_RANK


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    return json.loads((path / "meta.json").read_text())


def load_checkpoint(path: str | os.PathLike, trainer: Any, restore_rng: bool = True) -> dict[str, Any]:
    """Restores what `save_checkpoint` wrote into an already built `trainer`; returns the saved `extra`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta = read_meta(path)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format {meta.get('format')}, this code reads {FORMAT_VERSION}"
        )
    no_dist = meta.get("layout", COLLECTIVE) == PER_RANK  # this rank's shard, with its own metadata
    if no_dist and meta.get("world_size") != _world():
        raise CheckpointError(
            f"{path}: each of its {meta.get('world_size')} ranks wrote its own shard to a folder of its own; "
            f"it resumes only with that many ranks (this run has {_world()})"
        )
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path / "state"), no_dist=no_dist)
    except Exception as exc:
        raise CheckpointError(f"{path}: model/optimizer state does not fit this trainer: {exc}") from exc
    set_state_dict(
        trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    tstate = meta.get("trainer", {})
    critic = getattr(trainer, "critic", None)
    if critic is not None:
        if not (path / "critic").exists():
            raise CheckpointError(f"{path}: this run has a critic but the checkpoint holds none")
        c_model, c_optim = get_state_dict(critic.model, critic.optimizer)
        c_state: dict[str, Any] = {"model": c_model, "optim": c_optim}
        with _single_process_quiet():
            dcp.load(c_state, checkpoint_id=str(path / "critic"), no_dist=no_dist)
        set_state_dict(
            critic.model,
            critic.optimizer,
            model_state_dict=c_state["model"],
            optim_state_dict=c_state["optim"],
        )
    rng = None
    if restore_rng:
        rng_file = path / f"rng_rank{_rank()}.json"
        if not rng_file.is_file():
            rng_file = path / "rng_rank0.json"
        rng = json.loads(rng_file.read_text())
    restore_trainer_state(trainer, tstate, rng)
    return meta.get("extra", {})


def restore_trainer_state(trainer: Any, tstate: dict[str, Any], rng: dict[str, Any] | None) -> None:
    """What meta.json's "trainer" holds (schedulers, KL controller) and the RNG states, back into `trainer`."""
    critic = getattr(trainer, "critic", None)
    if critic is not None and "critic_scheduler" in tstate:
        critic.scheduler.load_state_dict(tstate["critic_scheduler"])
    sched = getattr(trainer, "scheduler", None)
    if sched is not None and "scheduler" in tstate:
        sched.load_state_dict(tstate["scheduler"])
    kl = getattr(trainer, "kl_ctrl", None)
    if kl is not None and "kl_coef" in tstate:
        kl.value = float(tstate["kl_coef"])
    if rng is not None:
        set_rng_state(rng)


def load_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint as plain full CPU tensors, in one process, whatever wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    reader = dcp.FileSystemReader(str(path / "state"))
    metadata = reader.read_metadata()
    target: dict[str, torch.Tensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            target[key[len("model.") :]] = torch.empty(md.size, dtype=md.properties.dtype)
    if not target:
        raise CheckpointError(f"{path}: no model tensors in the DCP metadata")
    with _single_process_quiet():
        dcp.load({"model": target}, storage_reader=reader, no_dist=True)
    return target


# ------------------------------------------------------------------------------------------ resume


SUPERSEDED_METRICS = "metrics.superseded.jsonl"


def resume_target(
    run_dir: str | os.PathLike, mode: str, log: Any = None, local_dir: str | os.PathLike | None = None
) -> Path | None:
    """trainer.resume_mode: auto = the latest complete checkpoint under the run dir if any (else None: a
    fresh start), disable = None, anything else = that checkpoint (an error when it is not a complete one).

    A `disable` start moves earlier checkpoints aside, so a later `auto` never resumes another run's steps.
    """
    root = checkpoint_root(run_dir, local_dir)
    mode = str(mode)
    if mode == "auto":
        return latest_checkpoint(root)
    if mode == "disable":
        if _rank() == 0 and list_checkpoints(root):
            aside = root.with_name(f"{root.name}.superseded-{int(time.time())}")
            root.rename(aside)
            if log is not None:
                log.warning("fresh start: earlier checkpoints moved aside", path=str(aside))
        return None
    return resolve_checkpoint(mode)


def rewind_metrics(run_dir: str | os.PathLike, step: int) -> int:
    """On resume from `step`: metrics.jsonl keeps its rows of steps <= `step`; later rows (the crashed
    attempt's steps, which the resumed run does again) move to metrics.superseded.jsonl. A line the
    crash cut short is dropped. Returns how many rows moved. New rows then append as usual, so every
    step appears once per lineage (the final validation row repeats the last step, as in any run)."""
    from rlbus.metrics_log import METRICS_FILE
    from rlbus.verl_metric_names import is_validation_row

    path = Path(run_dir) / METRICS_FILE
    if _rank() != 0 or not path.exists():
        return 0
    keep: list[str] = []
    gone: list[str] = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        at = int(row.get("step", 0))
        # the validation at `step` runs again on resume (it is due at the same steps): its row goes too
        again = at == step and is_validation_row(row)
        (keep if at <= step and not again else gone).append(line)
    if gone:
        with open(Path(run_dir) / SUPERSEDED_METRICS, "a") as f:
            f.write("".join(f"{line}\n" for line in gone))
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in keep))
    tmp.replace(path)
    return len(gone)
