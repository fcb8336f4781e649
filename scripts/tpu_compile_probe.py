"""Compiles the Mosaic TPU kernels (forward, backward, forward-mode tangent) for TPU generations without a TPU
(deviceless ahead-of-time compilation through libtpu) and prints, per variant and generation, each kernel's
tiles, grid, scoped VMEM (from the compiled HLO) and the compile time.

Run it with a `jax[tpu]` environment (libtpu) on any machine, from the repository root:

    python -m venv ../tpuvenv && ../tpuvenv/bin/pip install "jax[tpu]==0.11.2" numpy
    JAX_PLATFORMS=cpu PYTHONPATH=.shim:. ../tpuvenv/bin/python scripts/tpu_compile_probe.py [--json FILE]

(`.shim/probjax_kernels` links to kernels/, as in docs/contributing.md.) What it proves: every kernel lowers
through Mosaic TPU and compiles for the chip within its VMEM. What it does not: that it runs correctly on a
chip (interpret mode on the CPU checks the numbers) or how fast.
"""

from __future__ import annotations

import argparse
import json
import re
import time
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from probjax_kernels import alibi, causal_mask, create_block_mask, flash_attention, flex_attention
from probjax_kernels import _dispatch, sliding_window, softcap

GENERATIONS = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "v4": "v4:2x2x1"}
_CALL = re.compile(r"%(\S+) = .*custom_call_target=\"tpu_custom_call\"")
_SCOPED = re.compile(r'"used_scoped_memory_configs":\[\{[^]]*"size":"(\d+)"')


def _variants():
    """(name, dtype, (B, T, S, N, K, D, Dv), function of (q, k, v), modes)."""
    def flash(**options):  # no config: the default backend and tiles of the target device
        return lambda q, k, v: flash_attention(q, k, v, **options)

    def flex(score_mod=None, mask=None):
        def call(q, k, v):
            block_mask = None if mask is None else create_block_mask(mask, None, None, q.shape[1], k.shape[1])
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
        return call

    def with_dense_inputs(q, k, v):  # bias [1, N, T, S] (its gradient too), mask [B, 1, T, S], segments
        batch, t, n, _ = q.shape
        bias = jnp.ones((1, n, t, k.shape[1]), q.dtype)
        mask = jnp.arange(k.shape[1])[None, None, None, :] < jnp.arange(t)[None, None, :, None] + 100
        segments = jnp.broadcast_to(jnp.arange(t) // 300, (batch, t))
        return flash_attention(q, k, v, bias=bias * jnp.mean(q), mask=jnp.broadcast_to(mask, (batch, 1, t, t)),
                               q_segment_ids=segments, kv_segment_ids=segments,
                               q_lengths=jnp.full((batch,), t - 7), kv_lengths=jnp.full((batch,), t - 3))

    big = (1, 4096, 4096, 8, 2, 128, 128)
    slopes = jnp.linspace(0.1, 1.0, 8)  # a captured array (read per head from SMEM), made outside the hook

    def alibi_softcap(score, b, h, q_idx, kv_idx):
        return softcap(30.0)(alibi(slopes)(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    return [
        ("bf16 hd128 causal GQA 8:2", jnp.bfloat16, big, flash(causal=True), ("fwd", "bwd", "jvp")),
        ("bf16 hd64 window 256", jnp.bfloat16, (1, 4096, 4096, 8, 8, 64, 64), flash(window=256), ("fwd", "bwd")),
        ("bf16 hd256 causal", jnp.bfloat16, (1, 2048, 2048, 4, 4, 256, 256), flash(causal=True), ("fwd", "bwd")),
        ("f32 hd128 causal", jnp.float32, (1, 2048, 2048, 4, 4, 128, 128), flash(causal=True), ("fwd", "bwd")),
        ("bf16 hd192/128 Dv", jnp.bfloat16, (1, 2048, 2048, 4, 4, 192, 128), flash(causal=True), ("fwd", "bwd")),
        ("bf16 flex alibi+softcap, sliding-window BlockMask", jnp.bfloat16, big,
         flex(alibi_softcap, sliding_window(512)), ("fwd", "bwd", "jvp")),
        ("bf16 causal BlockMask", jnp.bfloat16, big, flex(mask=causal_mask), ("fwd", "bwd")),
        ("bf16 dropout 0.1 causal", jnp.bfloat16, big, flash(causal=True, dropout_rate=0.1, dropout_seed=3),
         ("fwd", "bwd")),
        ("bf16 hd32 bias + mask + segments + lengths", jnp.bfloat16, (2, 1000, 1000, 4, 4, 32, 32),
         with_dense_inputs, ("fwd", "bwd")),
        ("f16 hd16 causal (computed in f32)", jnp.float16, (1, 1000, 1000, 2, 1, 16, 16), flash(causal=True),
         ("fwd", "bwd", "jvp")),
        ("bf16 hd16 causal", jnp.bfloat16, (1, 1000, 1000, 2, 1, 16, 16), flash(causal=True), ("fwd", "bwd")),
    ]


def _tiles(config) -> tuple[int, ...]:
    return (config.block_q, config.block_k, config.block_q_dq, config.block_k_dq, config.block_q_dkv,
            config.block_k_dkv)


def _grids(config, b: int, t: int, s: int, n: int, k: int) -> dict:
    """The kernels' grids for a call without block tables (with them the step axis is the tables' width):
    (B, N, query tiles, key steps) for the forward, dQ and tangent; (B, K, key tiles, group x query steps)
    for dK/dV. T / S are padded to every kernel's tiles (`_autodiff.attention`)."""
    q_multiple = max(config.block_q, config.block_q_dq, config.block_q_dkv)
    kv_multiple = max(config.block_k, config.block_k_dq, config.block_k_dkv)
    t_pad, s_pad = -(-t // q_multiple) * q_multiple, -(-s // kv_multiple) * kv_multiple
    return {"probjax_tpu_forward": (b, n, t_pad // config.block_q, s_pad // config.block_k),
            "probjax_tpu_tangent": (b, n, t_pad // config.block_q, s_pad // config.block_k),
            "probjax_tpu_backward_dq": (b, n, t_pad // config.block_q_dq, s_pad // config.block_k_dq),
            "probjax_tpu_backward_dkv": (b, k, s_pad // config.block_k_dkv, n // k * (t_pad // config.block_q_dkv))}


def _modes(fn, mode: str):
    if mode == "fwd":
        return fn
    if mode == "bwd":
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    return lambda q, k, v: jax.jvp(fn, (q, k, v), (q, k, v))[1]


def probe(generation: str, verbose: bool = True, match: str = "") -> list[dict]:
    topology = topologies.get_topology_desc(topology_name=GENERATIONS[generation], platform="tpu",
                                            chips_per_host_bounds=[1, 1, 1])
    device = topology.devices[0]
    sharding = SingleDeviceSharding(device)
    with jax.default_device(device):  # what `FlashConfig()` resolves to on this chip
        config = _dispatch.default_config(None, q_len=4096, kv_len=4096, head_dim=128)
    assert config.backend == "tpu", config
    if verbose:
        print(f"# {generation} ({device.device_kind}): backend {config.backend!r}, tiles at T = S = 4096 "
              f"(fwd q, fwd k, dQ q, dQ k, dK/dV q, dK/dV k) = {_tiles(config)}")
    rows = []
    for variant_name, dtype, (b, t, s, n, k, d, dv), fn, modes in _variants():
        if match not in variant_name:
            continue
        specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                 for shape in ((b, t, n, d), (b, s, k, d), (b, s, k, dv))]
        for mode in modes:
            with jax.default_device(device), warnings.catch_warnings():
                warnings.simplefilter("error")  # an XLA fallback warning is a failed probe
                start = time.perf_counter()
                try:
                    compiled = jax.jit(_modes(fn, mode)).trace(*specs).lower(lowering_platforms=("tpu",)).compile()
                except Exception as error:  # noqa: BLE001 - every failure is a row of the report
                    rows.append(dict(generation=generation, variant=variant_name, mode=mode, error=str(error)[:500]))
                    if verbose:
                        print(f"{generation} | {variant_name} | {mode} | FAILED: {str(error)[:300]}")
                    continue
                seconds = time.perf_counter() - start
            text = compiled.as_text()
            with jax.default_device(device):
                grids = _grids(_dispatch.default_config(None, q_len=t, kv_len=s, head_dim=max(d, dv)), b, t, s, n, k)
            kernels = []
            for line in text.splitlines():
                call, scoped = _CALL.search(line), _SCOPED.search(line)
                if call:
                    name = call.group(1).rsplit(".", 1)[0]
                    kernels.append(dict(kernel=name, scoped_vmem=int(scoped.group(1)) if scoped else None,
                                        grid=None if "BlockMask" in variant_name else grids.get(name)))
            memory = compiled.memory_analysis()
            row = dict(generation=generation, device_kind=device.device_kind, variant=variant_name, mode=mode,
                       shape=dict(B=b, T=t, S=s, N=n, K=k, D=d, Dv=dv), dtype=jnp.dtype(dtype).name,
                       compile_s=round(seconds, 2), kernels=kernels,
                       hbm_temp=getattr(memory, "temp_size_in_bytes", None))
            rows.append(row)
            if verbose:
                vmem = ", ".join(f"{x['kernel']} grid {x['grid']} {x['scoped_vmem'] / 2**20:.2f} MiB" for x in kernels)
                print(f"{generation} | {variant_name} | {mode} | {seconds:.1f} s | {vmem}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", nargs="*", default=["v5e", "v5p", "v6e"], choices=list(GENERATIONS))
    parser.add_argument("--match", default="", help="only the variants whose name contains this")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args()
    rows = []
    for generation in args.generations:
        rows += probe(generation, match=args.match)
    failures = [row for row in rows if "error" in row]
    print(f"{len(rows) - len(failures)} compiled, {len(failures)} failed")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
