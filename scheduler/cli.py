"""The `tlt` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _bench_engine(args: argparse.Namespace) -> int:
    from scheduler.bench.engine import bench_engine

    result = bench_engine(model_spec=args.model, num_prompts=args.prompts, new_tokens=args.new_tokens, k=args.k,
                          threads=args.threads, dtype=args.dtype, with_hf=not args.no_hf)
    if not args.json:
        for batch, configs in result["configs"].items():
            print(f"{batch}:")
            for name, rep in configs.items():
                print(f"  {name:18s} {rep['tokens_per_s']:8.2f} tok/s  "
                      f"accepted length {rep['mean_accepted_length']:.2f}  x{rep['vs_ours_plain']:.2f} vs ours plain")
    print(json.dumps(result))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from drafter.drafters import NgramDrafter
    from drafter.engine import Engine, Request
    from drafter.loading import encode_prompt, load_model
    from drafter.sampling import SamplingParams

    loaded = load_model(args.model)
    engine = Engine(loaded.model, loaded.tokenizer)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    reqs = [Request(encode_prompt(loaded.tokenizer, p), params) for p in args.prompt]
    drafter = NgramDrafter() if args.k else None
    for out in engine.generate(reqs, k=args.k, drafter=drafter):
        print(out.text)
        print(f"-- {len(out.token_ids)} tokens, {out.num_steps} policy forwards, "
              f"accepted length {out.mean_accepted_length:.2f}, finish: {out.finish_reason}", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from scheduler.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tlt", description="tlt-scheduler: idle-time drafter training for RL")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks; each prints a JSON object last")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    eng = bench_sub.add_parser("engine", help="our engine vs transformers, plain and speculative")
    eng.add_argument("--model", default="smollm2-135m", help="preset, smollm2-135m, .gguf file or HF directory")
    eng.add_argument("--prompts", type=int, default=16, help="number of the 16 fixed prompts to use")
    eng.add_argument("--new-tokens", type=int, default=128)
    eng.add_argument("--k", type=int, default=4, help="draft length for the n-gram and prompt-lookup runs")
    eng.add_argument("--threads", type=int, default=2)
    eng.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    eng.add_argument("--no-hf", action="store_true", help="skip the transformers reference runs")
    eng.add_argument("--json", action="store_true", help="print only the JSON object on stdout")
    eng.set_defaults(func=_bench_engine)

    gen = sub.add_parser("generate", help="generate from prompts with the built-in engine")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--model", default="smollm2-135m")
    gen.add_argument("--k", type=int, default=0, help="n-gram draft length (0 = plain decoding)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_generate)

    demo = sub.add_parser("demo", help="run the main demo on the embedded defaults")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"tlt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
