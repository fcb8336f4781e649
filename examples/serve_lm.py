"""Serve synthetic requests with continuous batching (examples/lm/serving.py) and report the throughput.

    .venv/bin/python examples/serve_lm.py --requests 32                         # a fresh tiny model (random weights)
    .venv/bin/python examples/serve_lm.py --out runs/tiny --requests 32 --kv-dtype int8 --print 2

--requests requests, drawn from --seed: prompts of random printable bytes with lengths in --prompt-lens,
budgets of new tokens in --new-tokens, arrival steps in [0, --arrivals). Every engine step packs the running
requests' prompt chunks (--chunk-size) and decode tokens into one row of a --token-buckets size and runs the
model's layers once, with one probjax_kernels.ragged_paged_attention call per layer that appends the new
keys and values to the paged cache (--num-pages pages of --page-size; int8 pages with --kv-dtype int8).
Requests wait for a free slot (--max-seqs) and for pages; finished ones give theirs back. Greedy sampling.
The step is compiled per bucket before the clock starts; the last line gives tokens per second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import probjax_kernels  # noqa: E402
from lm.config import DTYPES, FRAMEWORKS, from_json, make_config  # noqa: E402
from lm.scheduler import Request, ServingConfig  # noqa: E402
from lm.serving import Engine, calibrate_kv_scales  # noqa: E402
from lm.train import build_model, compute_params  # noqa: E402

PRINTABLE = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.,:()=\n", np.uint8)


def synthetic_requests(count: int, prompt_lens: tuple[int, int], new_tokens: tuple[int, int], arrivals: int,
                       seed: int) -> list[Request]:
    """`count` requests of printable-byte prompts, lengths and budgets uniform in the inclusive ranges, arrival
    steps uniform in [0, arrivals)."""
    rng = np.random.default_rng(seed)
    return [
        Request(
            i, rng.choice(PRINTABLE, int(rng.integers(prompt_lens[0], prompt_lens[1] + 1))).astype(np.int32),
            int(rng.integers(new_tokens[0], new_tokens[1] + 1)), int(rng.integers(0, arrivals)),
        )
        for i in range(count)
    ]


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN:MAX") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return bounds


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(word) for word in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of sizes") from None


def _load(args, parser):
    """The model config and its params in the compute dtype: a train_lm.py run's newest checkpoint (--out), or
    a freshly initialised tiny model."""
    if args.out is None:
        config = make_config("tiny", {"framework": args.framework, "dtype": args.dtype})
        return config, compute_params(build_model(config, jax.random.key(args.seed)).params, config)
    from lm.checkpoint import Checkpoints

    out = Path(args.out).expanduser()
    if not (out / "config.json").is_file() or not (out / "checkpoints").is_dir():
        parser.error(f"argument --out: {out} holds no train_lm.py run with checkpoints")
    config = from_json(out / "config.json")
    checkpoints = Checkpoints(out / "checkpoints")
    restored = checkpoints.restore_newest(build_model(config, jax.random.key(config.seed)).params)
    checkpoints.close()
    if restored is None:
        sys.exit(f"no checkpoint in {out / 'checkpoints'} restores")
    return config, compute_params(restored[1], config)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="a train_lm.py run folder; default: a fresh tiny model (random weights)")
    parser.add_argument("--framework", choices=FRAMEWORKS, default="nnx", help="without --out")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="without --out")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-lens", type=_range, default=(4, 96), metavar="MIN:MAX")
    parser.add_argument("--new-tokens", type=_range, default=(4, 48), metavar="MIN:MAX")
    parser.add_argument("--arrivals", type=int, default=32, help="arrival steps are drawn in [0, ARRIVALS)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, help="default: room for half the slots at their longest")
    parser.add_argument("--max-seqs", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--token-buckets", type=_buckets, default=(16, 64), metavar="N,N,...")
    parser.add_argument("--kv-dtype", choices=("compute", "int8"), default="compute")
    parser.add_argument(
        "--backend", choices=("xla", "triton", "interpret", "tpu", "tpu_interpret"),
        help="the attention calls' RaggedConfig.backend; default: the kernel on a GPU or TPU, XLA elsewhere",
    )
    parser.add_argument("--print", type=int, default=0, metavar="N", help="print the first N completions")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.arrivals < 1:
        parser.error("--requests and --arrivals must be at least 1")
    config, params = _load(args, parser)
    requests = synthetic_requests(args.requests, args.prompt_lens, args.new_tokens, args.arrivals, args.seed)
    longest = args.prompt_lens[1] + args.new_tokens[1] - 1
    pages_per_seq = -(-longest // args.page_size)
    num_pages = args.num_pages or max(pages_per_seq, args.max_seqs * pages_per_seq // 2)
    try:
        serving = ServingConfig(
            page_size=args.page_size, num_pages=num_pages, max_seqs=args.max_seqs, pages_per_seq=pages_per_seq,
            chunk_size=args.chunk_size, token_buckets=args.token_buckets, kv_dtype=args.kv_dtype,
        )
    except ValueError as error:
        parser.error(str(error))
    scales = None
    if serving.kv_dtype == "int8":  # calibrated on the prompts, which is all the engine has seen
        scales = calibrate_kv_scales(config, params, jnp.asarray(np.concatenate([r.prompt for r in requests])))
    engine = Engine(config, params, serving, scales, kernel_config=probjax_kernels.RaggedConfig(backend=args.backend))
    print(f"{config.framework} model ({config.num_layers} layers, d_model {config.d_model}, {config.dtype}), "
          f"{jax.devices()[0].platform}; {num_pages} pages of {args.page_size} ({args.kv_dtype}), "
          f"{args.max_seqs} slots, chunks of {args.chunk_size}, buckets {list(serving.token_buckets)}, "
          f"attention backend {args.backend or 'default'}")
    for num_tokens in serving.token_buckets:
        engine.compile(num_tokens)
    results = engine.run(requests, progress=True)
    stats = engine.stats
    seconds = stats["wall_seconds"] - stats["compile_seconds"]
    print(f"{len(requests)} requests in {stats['steps']} steps: {stats['prompt_tokens']} prompt + "
          f"{stats['new_tokens']} new tokens in {seconds:.2f} s = {stats['new_tokens_per_second']:.0f} new tokens/s, "
          f"{(stats['prompt_tokens'] + stats['new_tokens']) / seconds:.0f} tokens/s (compile excluded)")
    for request in requests[: args.print]:
        text = (request.prompt.astype(np.uint8).tobytes() + results[request.id].astype(np.uint8).tobytes())
        print(f"--- request {request.id} (arrived at step {request.arrival}) ---\n{text.decode(errors='replace')}")
    return stats


if __name__ == "__main__":
    main()
