"""The way a call travels through probjax_kernels: from `flash_attention` to the first `pallas_call` of a pass,
as the modules it stays in, counted.

    python scripts/call_route.py [--backend interpret|tpu_interpret|mosaic_interpret] [--pass forward|backward]

It traces one call (jit-traced, nothing compiled; GQA 4 -> 2 heads, T != S, so that `q` is told apart from
`k` and `v` by its shape) under a profile hook and follows `q`: every call into a probjax_kernels function
that receives `q` (as given, or padded: an array of shape [B, T or T padded, N, D or D padded], alone or
inside a tuple, list or dict argument) is a step of the way, in call order, up to the `pallas_call` that
receives a block of it, with the calls made on the way by the functions on it (a question asked and answered
is a stay in the module it goes to; comprehensions and closures called by the function that defines them are part of it). Consecutive steps
in one module are one stay. Printed: the stays, the number of
modules, and the returns (a stay in a module the way had already left). docs/contributing.md states the
bounds `tests/test_layout.py` holds these figures to.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

BATCH, Q_LEN, KV_LEN, HEADS, KV_HEADS, HEAD_DIM = 2, 200, 328, 4, 2, 40
PACKAGE = "probjax_kernels"
COMPREHENSIONS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")  # not calls a reader follows
# Where a kernel is launched: Pallas' pallas_call, and the Mosaic GPU kernels' `plgpu.kernel` wrapper.
KERNEL_CALLS = {("jax._src.pallas.pallas_call", "pallas_call"), ("jax._src.pallas.helpers", "kernel")}


def _arrays(value, depth: int = 0):
    """The arrays in a call argument: itself, or those of a tuple / list / dict (two levels deep)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        yield value
    elif depth < 2 and isinstance(value, (tuple, list)):
        for item in value:
            yield from _arrays(item, depth + 1)
    elif depth < 2 and isinstance(value, dict):
        for item in value.values():
            yield from _arrays(item, depth + 1)


def _is_query(array) -> bool:
    if not isinstance(array, jax.Array):  # an array or a tracer of one; not an abstract value or a spec
        return False
    shape = tuple(array.shape)
    return (len(shape) == 4 and shape[0] == BATCH and shape[2] == HEADS and shape[1] >= Q_LEN
            and shape[1] != KV_LEN and shape[3] >= HEAD_DIM)


def _receives_query(frame) -> bool:
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    values = [frame.f_locals.get(name) for name in names]
    if code.co_flags & 0x04:  # *args
        values += list(frame.f_locals.get(code.co_varnames[len(names)], ()))
    return any(_is_query(a) for value in values for a in _arrays(value))


def _nested_in_caller(frame) -> bool:
    """Whether the function of `frame` is defined inside the function that calls it (a closure of its body)."""
    caller = frame.f_back
    return caller is not None and frame.f_code.co_qualname.startswith(f"{caller.f_code.co_qualname}.<locals>.")


def route(backend: str, which: str) -> list[tuple[str, str]]:
    """The (module, function) steps of `q`'s way to the first pallas_call of the pass `which`."""
    from probjax_kernels import FlashConfig, flash_attention

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (BATCH, Q_LEN, HEADS, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(keys[1], (BATCH, KV_LEN, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(keys[2], (BATCH, KV_LEN, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    config = FlashConfig(backend=backend)

    def forward(q, k, v):
        return flash_attention(q, k, v, causal=True, config=config)

    def loss(q, k, v):
        return forward(q, k, v).astype(jnp.float32).sum()

    calls: list[dict] = []  # every call into probjax_kernels: module, function, parent (a call's index)
    stack: list[tuple[object, int]] = []  # (frame, index in calls) of the probjax_kernels frames running
    state = {"on": which == "forward", "chain": None}

    def profile(frame, event, arg):
        if state["chain"] is not None:
            return
        module = frame.f_globals.get("__name__", "")
        name = frame.f_code.co_name
        if event == "return":
            if stack and stack[-1][0] is frame:
                stack.pop()
            return
        if event != "call":
            return
        if (module, name) in KERNEL_CALLS and state["on"]:
            state["chain"] = [index for _, index in stack if index is not None]
            calls.append({"module": "jax.pallas_call", "function": "pallas_call", "parent": None})
            state["chain"].append(len(calls) - 1)
        elif module.startswith(PACKAGE) and (name in COMPREHENSIONS or _nested_in_caller(frame)):
            stack.append((frame, stack[-1][1] if stack else None))  # part of the function it runs in
        elif module.startswith(PACKAGE):
            if which == "backward" and module == "probjax_kernels._autodiff" and name == "_backward":
                state["on"] = True  # the backward pass starts at the transpose of the tangent map
                stack.clear()
            calls.append({"module": module, "function": name, "parent": stack[-1][1] if stack else None,
                          "query": state["on"] and _receives_query(frame), "on": state["on"]})
            stack.append((frame, len(calls) - 1))

    sys.setprofile(profile)
    try:
        traced = jax.jit(forward if which == "forward" else jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v)
        if which == "backward" and state["chain"] is None:
            traced.lower()  # the transpose of the tangent map (the backward kernels) is traced as it lowers
    except Exception:  # noqa: BLE001 - lowering a GPU kernel on the CPU fails after the kernel call we want
        if state["chain"] is None:
            raise
    finally:
        sys.setprofile(None)
    if state["chain"] is None:
        raise RuntimeError(f"no pallas_call reached on backend {backend!r} ({which})")
    chain = set(state["chain"])
    # The way: the calls on the stack at the kernel launch, and every call that one of them made on the way
    # (a question asked and answered: a side trip counts as a stay in the module it goes to).
    return [(c["module"], c["function"]) for i, c in enumerate(calls)
            if i in chain or (c.get("on") and c["parent"] in chain)]


def stays(steps: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Consecutive steps in one module merged: [(module, [function, ...]), ...]."""
    merged: list[tuple[str, list[str]]] = []
    for module, function in steps:
        if merged and merged[-1][0] == module:
            merged[-1][1].append(function)
        else:
            merged.append((module, [function]))
    return merged


def figures(steps: list[tuple[str, str]]) -> dict:
    """modules: distinct probjax_kernels modules on the way; returns: stays in a module already left."""
    way = stays(steps)
    seen, returns = set(), 0
    for module, _ in way:
        returns += module in seen
        seen.add(module)
    modules = {module for module, _ in way if module.startswith(PACKAGE)}
    return {"stays": len(way), "modules": len(modules), "returns": returns}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="interpret")
    parser.add_argument("--pass", dest="which", choices=("forward", "backward"), default="forward")
    args = parser.parse_args()
    steps = route(args.backend, args.which)
    for i, (module, functions) in enumerate(stays(steps), 1):
        print(f"{i:3d}. {module:40s} {', '.join(functions)}")
    f = figures(steps)
    print(f"{f['modules']} modules, {f['stays']} stays, {f['returns']} returns to a module already left")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
