"""Orbax checkpoints of any framework's params and the optimiser state.

Each pytree is saved as a nested dict of its key-path names ("blocks" -> "0" -> "attention" -> ...), which
orbax stores without knowing NNX states, Equinox modules or optax's named tuples; restoring maps the
saved arrays back onto a freshly built tree of the same structure, with that tree's shardings. A step also
keeps the train losses of the steps since the last metrics row, so that a resumed run averages the same
losses into its next row as an unbroken one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


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
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any, pending_losses: Sequence[float] = ()) -> None:
        """Saves `step`; `pending_losses` are the train losses of the steps since the last metrics row."""
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(to_nested(params)), opt_state=ocp.args.StandardSave(to_nested(opt_state)),
            metrics=ocp.args.JsonSave({"pending_losses": [float(loss) for loss in pending_losses]}),
        ))

    def pending_losses(self, step: int) -> list[np.float32]:
        """The train losses that `step` saved as not yet in a metrics row, as float32 (the dtype of the
        losses they stand for); none for a checkpoint written without them."""
        if "metrics" not in self.manager.item_metadata(step):
            return []
        saved = self.manager.restore(step, args=ocp.args.Composite(metrics=ocp.args.JsonRestore()))
        return [np.float32(loss) for loss in saved["metrics"]["pending_losses"]]

    def restore(self, step: int, params: Any, opt_state: Any | None = None) -> tuple[Any, Any]:
        """The saved params (and opt_state, unless None) of `step`, shaped and sharded like the given ones."""
        items = {"params": ocp.args.StandardRestore(_abstract(params))}
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(_abstract(opt_state))
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        params = from_nested(restored["params"], params)
        return params, None if opt_state is None else from_nested(restored["opt_state"], opt_state)

    def drop_from(self, step: int) -> None:
        """Deletes the checkpoints of `step` and later, once the saves in flight have finished."""
        self.manager.wait_until_finished()
        for saved in self.manager.all_steps():
            if saved >= step:
                self.manager.delete(saved)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
