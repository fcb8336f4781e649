"""Orbax checkpoints of any framework's params and the optimiser state.

Each pytree is saved as a nested dict of its key-path names ("blocks" -> "0" -> "attention" -> ...), which
orbax stores without knowing NNX states, Equinox modules or optax's named tuples; restoring maps the
saved arrays back onto a freshly built tree of the same structure, with that tree's shardings. A step also
keeps (its "progress" item) the train losses of the steps since the last metrics row, so that a resumed run
averages the same losses into its next row as an unbroken one, and the metrics rows up to it, so that a
resume restores rows that metrics.jsonl lost. (Checkpoints written before kept the losses alone, in an item
named "metrics": orbax's own name for a step's metrics, which its CheckpointManager reads when it opens the
folder, where a damaged one failed. Those are still read, after the folder is open.)

In a multi-process run every process calls every method here: each writes and reads only the shards of its
own devices, and orbax's barriers keep them in step. A step becomes visible (`steps`, `latest_step`) only
once every process has written its part and process 0 has committed it (orbax writes into a temporary
folder and renames it), so a run killed mid-save leaves no checkpoint that looks complete.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


def _names(path) -> list[str]:
    names = []
    for entry in path:
        for attribute in ("key", "name", "idx"):
            if hasattr(entry, attribute):
                names.append(str(getattr(entry, attribute)))
                break
    return names


def to_nested(tree: Any) -> dict:
    """The leaves of `tree` in a nested dict keyed by their path names."""
    nested: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        *parents, last = _names(path)
        node = nested
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = leaf
    return nested


def from_nested(nested: dict, like: Any) -> Any:
    """A tree shaped like `like` with the leaves of `nested` (from `to_nested`)."""
    leaves = []
    for path, _ in jax.tree_util.tree_flatten_with_path(like)[0]:
        node = nested
        for name in _names(path):
            node = node[name]
        leaves.append(node)
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def _abstract(tree: Any) -> dict:
    return to_nested(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree))


class Checkpoints:
    """`out/checkpoints/<step>/{params,opt_state,metrics}`, the last `keep` steps kept; saves run in the
    background."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory).absolute()
        # lightweight_initialize: open the folder from its step numbers alone, without reading every step's
        # "metrics" item (a damaged one failed here, before a step could be passed over).
        self.manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, lightweight_initialize=True,
        ))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return sorted(self.manager.all_steps())

    def save(
        self, step: int, params: Any, opt_state: Any, pending_losses: Sequence[float] = (), rows: Sequence[dict] = ()
    ) -> None:
        """Saves `step`; `pending_losses` are the train losses of the steps since the last metrics row, `rows` the
        metrics rows up to `step`."""
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(to_nested(params)), opt_state=ocp.args.StandardSave(to_nested(opt_state)),
            progress=ocp.args.JsonSave(
                {"pending_losses": [float(loss) for loss in pending_losses], "rows": list(rows)}
            ),
        ))

    def progress(self, step: int) -> tuple[list[np.float32], list[dict] | None]:
        """The train losses that `step` saved as not yet in a metrics row, as float32 (the dtype of the losses
        they stand for), and the metrics rows up to it (None from a checkpoint written without them). Raises
        what orbax raises for a damaged item."""
        for name in ("progress", "metrics"):  # "metrics": a checkpoint of an older version, losses only
            if (self.directory / str(step) / name).exists():
                saved = self.manager.restore(step, args=ocp.args.Composite(**{name: ocp.args.JsonRestore()}))[name]
                return [np.float32(loss) for loss in saved["pending_losses"]], saved.get("rows")
        return [], None

    def restore(self, step: int, params: Any, opt_state: Any | None = None) -> tuple[Any, Any]:
        """The saved params (and opt_state, unless None) of `step`, shaped and sharded like the given ones."""
        items = {"params": ocp.args.StandardRestore(_abstract(params))}
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(_abstract(opt_state))
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        params = from_nested(restored["params"], params)
        return params, None if opt_state is None else from_nested(restored["opt_state"], opt_state)

    def restore_newest(
        self, params: Any, opt_state: Any | None = None, *, skipped: list[str] | None = None
    ) -> tuple[int, Any, Any] | None:
        """`(step, params, opt_state)` of the newest checkpoint that restores (see `restore`), or None if none
        does. A checkpoint that fails to restore (a file truncated or lost after it was committed) is passed
        over, and a line saying why is appended to `skipped`. In a multi-process run a step counts only if it
        restored on every process, so all of them continue from the same one."""
        for step in reversed(self.steps()):
            try:
                params_, opt_state_ = self.restore(step, params, opt_state)
                if opt_state is not None:  # resuming training: the losses and rows must restore as well
                    self.progress(step)
                error = None
            except Exception as failure:  # orbax and tensorstore raise many kinds for a damaged file
                error = " ".join(f"{type(failure).__name__}: {failure}".split())[:300]
            if _everywhere(error is None):
                return step, params_, opt_state_
            if skipped is not None:
                skipped.append(f"step {step}: {error or 'failed to restore on another process'}")
        return None

    def drop_from(self, step: int) -> None:
        """Deletes the checkpoints of `step` and later, once the saves in flight have finished."""
        self.manager.wait_until_finished()
        for saved in self.manager.all_steps():
            if saved >= step:
                self.manager.delete(saved)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _everywhere(flag: bool) -> bool:
    """`flag` and-ed over the processes of a multi-process run (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.all(multihost_utils.process_allgather(np.int32(flag))))


def committed_steps(directory: str | Path) -> list[int]:
    """The steps a `Checkpoints` folder holds committed, read without opening it (nothing is created): orbax
    names a committed step's folder by its number and an unfinished one `<step>.orbax-checkpoint-tmp-*`."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(entry.name) for entry in directory.iterdir() if entry.is_dir() and entry.name.isdigit())
