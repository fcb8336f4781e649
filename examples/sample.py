"""Sample text from a train_lm.py checkpoint with the KV-cache decode path.

    .venv/bin/python examples/sample.py --out runs/tiny --prompt "import " --tokens 300
    .venv/bin/python examples/sample.py --out runs/tiny --prompt "import " --prompt "def main(" --tokens 300

Rebuilds the model from --out/config.json, restores the params of the latest checkpoint (or --step) and
decodes one byte per step against each attention layer's KV cache. Several --prompt flags generate for all
of them at once (--num-samples continuations of each): the prompts, of any lengths, run through one prefill,
then every step decodes one byte per sequence with probjax_nn.decode_attention on a paged KV cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402

from lm.checkpoint import Checkpoints  # noqa: E402
from lm.config import ATTENTION_IMPLS, ConfigError, check_prompt, finite_float, from_json  # noqa: E402
from lm.sampling import generate, generate_batch  # noqa: E402
from lm.train import build_model, compute_params  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        usage="%(prog)s --out DIR [--step N] [--prompt TEXT] [--tokens N] [...]  (-h lists the flags)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="the --out folder of a train_lm.py run")
    parser.add_argument("--step", type=int, help="checkpoint step; default: the latest")
    parser.add_argument(
        "--prompt", action="append", help="default: the run's sample_prompt; repeat it for a batch of prompts"
    )
    parser.add_argument("--tokens", type=int, help="bytes to generate; default: the run's sample_tokens")
    parser.add_argument("--num-samples", type=int, help="default: the run's num_samples (1 if that is 0)")
    parser.add_argument("--temperature", type=finite_float, help="0 picks the most likely byte; default: the run's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention", choices=ATTENTION_IMPLS, help="default: the run's (auto = best here)")
    args = parser.parse_args(argv)

    out = Path(args.out).expanduser()
    if not (out / "config.json").is_file():
        parser.error(f"argument --out: {out} holds no train_lm.py run (no config.json)")
    try:
        config = from_json(out / "config.json")
    except (OSError, ValueError, TypeError) as error:
        parser.error(f"argument --out: cannot read {out / 'config.json'}: {error}")
    if args.attention is not None:
        config = dataclasses.replace(config, attention=args.attention)
    # An explicit 0 or "" is a value, not "use the run's" (`or` took the run's value for them).
    prompts = [config.sample_prompt] if args.prompt is None else args.prompt
    tokens = config.sample_tokens if args.tokens is None else args.tokens
    num_samples = max(config.num_samples, 1) if args.num_samples is None else args.num_samples
    temperature = config.temperature if args.temperature is None else args.temperature
    bounds = (("--tokens", tokens, 0), ("--num-samples", num_samples, 1), ("--temperature", temperature, 0))
    for name, value, least in bounds:
        if value < least:
            parser.error(f"{name} must be at least {least}, got {value}")
    if not all(prompts):
        parser.error("--prompt must hold at least one character")
    try:
        encoded = [check_prompt("prompt", prompt) for prompt in prompts]
    except ConfigError as error:
        parser.error(f"argument --prompt: {error}")
    if not (out / "checkpoints").is_dir():  # Checkpoints() would create the folder
        sys.exit(f"no checkpoint in {out / 'checkpoints'}")
    checkpoints = Checkpoints(out / "checkpoints")
    steps = checkpoints.manager.all_steps()
    step = args.step if args.step is not None else checkpoints.latest_step()
    if step is None:
        sys.exit(f"no checkpoint in {out / 'checkpoints'}")
    if step not in steps:
        sys.exit(f"--step {step}: no checkpoint of that step in {out / 'checkpoints'}; it has steps {sorted(steps)}")
    model = build_model(config, jax.random.key(config.seed))
    if args.step is not None:
        params, _ = checkpoints.restore(step, model.params)
    else:  # the newest checkpoint that restores: a damaged newer one is passed over, and said so
        skipped: list[str] = []
        restored = checkpoints.restore_newest(model.params, skipped=skipped)
        for line in skipped:
            print(f"cannot restore the checkpoint of {line}", file=sys.stderr)
        if restored is None:
            sys.exit(f"no checkpoint in {out / 'checkpoints'} restores")
        step, params, _ = restored
    checkpoints.close()
    params = compute_params(params, config)
    if len(prompts) == 1:
        samples = generate(
            model, params, encoded[0], tokens, num_samples=num_samples, temperature=temperature,
            key=jax.random.key(args.seed),
        )
    else:
        batch = [prompt for prompt in encoded for _ in range(num_samples)]
        samples = generate_batch(model, params, batch, tokens, temperature=temperature, key=jax.random.key(args.seed))
    print(f"{config.framework} model, step {step}, attention={config.attention}")
    for i, sample in enumerate(samples):
        print(f"--- sample {i} ---\n{sample.decode('utf-8', errors='replace')}")


if __name__ == "__main__":
    main()
